"""Devices beyond CUDA and the CPU: xpu and mps accepted in the recipe and the CLI, resolved where PyTorch has
them, refused clearly where it has not (this machine has neither)."""

from __future__ import annotations

import pytest
import torch

from entrenar.config import Recipe, is_device_name
from entrenar.device import resolve_device
from entrenar.errors import ConfigError


def recipe(device: str) -> Recipe:
    return Recipe.from_dict({"model": {"init": "random", "device": device, "config": {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1}}, "data": {"train": "synth:regression:8"}})


@pytest.mark.parametrize("name", ["mps", "xpu", "xpu:1", "cuda", "cuda:3", "cpu", "auto"])
def test_the_recipe_and_the_cli_accept_every_device_pytorch_trains_on(name):
    assert is_device_name(name) and recipe(name).model.device == name
    assert not is_device_name("npu") and not is_device_name("mps:1:2")


@pytest.mark.skipif(torch.backends.mps.is_available() or torch.xpu.is_available(), reason="needs neither here")
@pytest.mark.parametrize(("name", "runtime"), [("mps", "MPS"), ("xpu:1", "XPU")])
def test_the_plan_refuses_a_device_this_machine_lacks_naming_it(name, runtime, tmp_path):
    from entrenar.train.loop import train

    with pytest.raises(ConfigError, match=rf"device '{name}' was asked for, but {runtime} .* is not available"):
        train(recipe(name), dry_run=True)


def test_a_present_xpu_or_mps_resolves_to_itself_and_an_index_past_the_count_is_refused(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("xpu:1") == torch.device("xpu", 1) and resolve_device("mps") == torch.device("mps")
    with pytest.raises(ConfigError, match=r"device 'xpu:2': this machine has 2 XPU \(Intel GPU\) device\(s\)"):
        resolve_device("xpu:2")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")  # unchanged


def test_kernels_auto_are_off_on_a_device_that_is_not_cuda():
    from entrenar.distributed.world import SOLO
    from entrenar.loading import recipe_model_config
    from entrenar.train.plan import plan_run

    plan = plan_run(recipe("cpu"), torch.device("xpu"), SOLO, recipe_model_config(recipe("cpu")), force=True)
    assert plan.kernels is False  # the plain PyTorch paths (on a CPU, auto takes the kernels' PyTorch specs)
    assert plan_run(recipe("cpu"), torch.device("cpu"), SOLO, recipe_model_config(recipe("cpu")), force=True).kernels


def test_auto_dtype_for_a_cuda_device_planned_from_a_machine_without_one(monkeypatch):
    """`entrenar inspect --device cuda` on a CPU-only machine plans in bf16, as the GPU will run (it planned fp32
    weights: a LoRA-1B estimate of 5.1 GiB where the H100 run peaked at 3.4)."""
    import torch

    from entrenar.device import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32
