"""entrenar merge against mergekit itself, tensor by tensor, for the deterministic methods.

mergekit's pins fight with the test dependencies, so it is driven through its
CLI: ``mergekit-yaml`` on PATH, or the executable named by ``MERGEKIT_YAML``
(e.g. a separate venv: ``python -m venv /tmp/mk && /tmp/mk/bin/pip install
torch mergekit``). Skipped when neither is there.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from entrenar.merge import merge

MERGEKIT = os.environ.get("MERGEKIT_YAML") or shutil.which("mergekit-yaml")
pytestmark = [pytest.mark.skipif(MERGEKIT is None, reason="mergekit-yaml not installed (set MERGEKIT_YAML)"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from conftest import make_hf_model

    root = tmp_path_factory.mktemp("mk")
    for seed, name in enumerate(("base", "a", "b")):
        make_hf_model("llama", seed=seed, num_hidden_layers=3).save_pretrained(root / name)
    return root


CASES = {
    "linear": {"models": [("a", {"weight": 0.3}), ("b", {"weight": [0.2, 1.0]})]},
    "task_arithmetic": {"base": True, "models": [("a", {"weight": 0.5}), ("b", {"weight": 0.7})],
                        "parameters": {"lambda": 0.8}},
    "ties": {"base": True, "models": [("a", {"weight": 0.6, "density": 0.4}),
                                      ("b", {"weight": 0.9,
                                             "density": [{"filter": "mlp", "value": 0.7}, {"value": 0.3}]})]},
    "breadcrumbs_ties": {"base": True, "models": [("a", {"weight": 1.0, "density": 0.6, "gamma": 0.05}),
                                                  ("b", {"weight": 1.0, "density": 0.5, "gamma": 0.02})]},
    "slerp": {"base": True, "models": [("base", {}), ("b", {})],
              "parameters": {"t": [{"filter": "self_attn", "value": [0.0, 0.5, 1.0]}, {"value": 0.3}]}},
    "nuslerp": {"models": [("a", {"weight": 1.0}), ("b", {"weight": 2.0})]},
    "model_stock": {"base": True, "models": [("a", {}), ("b", {})]},
}


@pytest.mark.parametrize("method", list(CASES))
def test_matches_mergekit(inputs, tmp_path, method):
    case = CASES[method]
    cfg = {"merge_method": method, "dtype": "float32",
           "models": [{"model": str(inputs / name), **({"parameters": p} if p else {})} for name, p in case["models"]]}
    if case.get("base"):
        cfg["base_model"] = str(inputs / "base")
    if "parameters" in case:
        cfg["parameters"] = case["parameters"]
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([MERGEKIT, str(tmp_path / "c.yml"), str(tmp_path / "mk"), "--no-copy-tokenizer"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    merge(cfg, tmp_path / "ours")
    theirs = load_file(tmp_path / "mk" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(ours) == set(theirs)
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6), name
