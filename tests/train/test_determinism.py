"""``training.deterministic``: PyTorch's deterministic algorithms for the run only, and an op without one
refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from test_loop import recipe_for

from entrenar.errors import ConfigError
from entrenar.train import loop
from entrenar.train.determinism import deterministic_algorithms
from entrenar.train.metrics import read_metrics


def test_the_mode_holds_for_the_run_and_the_callers_setting_comes_back(workspace, monkeypatch):
    seen = []
    real = loop._train

    def spy(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "_train", spy)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "x")  # recorded, so monkeypatch restores the caller's state
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    loop.train(recipe_for(workspace, "training.deterministic=true", "training.max_steps=2"), progress=False)
    loop.train(recipe_for(workspace, "training.max_steps=2", f"output.dir={workspace / 'b'}"), progress=False)
    assert seen == [(True, ":4096:8"), (False, None)]
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # set for the run only


def test_a_cublas_workspace_that_is_not_deterministic_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match=r"CUBLAS_WORKSPACE_CONFIG=:0:0 in the environment .* :4096:8"), \
            deterministic_algorithms(True):
        pass
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_algorithms(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_an_op_without_a_deterministic_version_is_a_config_error_naming_it():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.raises(ConfigError, match=r"training\.deterministic: some_op_cuda has no deterministic "
                                              r"implementation on this device"), deterministic_algorithms(True):
            raise RuntimeError("some_op_cuda does not have a deterministic implementation, but you set "
                               "'torch.use_deterministic_algorithms(True)'.")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        with pytest.raises(RuntimeError, match="unrelated"), deterministic_algorithms(True):
            raise RuntimeError("unrelated")
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_cpu_run_is_the_same_with_and_without_the_mode(workspace):
    """On a CPU the mode changes no algorithm this loop uses: the same losses and adapters, bit for bit."""
    runs = [loop.train(recipe_for(workspace, f"training.deterministic={flag}", f"output.dir={workspace / flag}"),
                       progress=False) for flag in ("true", "false")]
    lines = [[r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r] for run in runs]
    assert lines[0] == lines[1]
    a, b = (load_file(str(run.output / "adapter_model.safetensors")) for run in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
