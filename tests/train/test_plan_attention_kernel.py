"""training.attention_kernel: which variable-length kernel attends packed rows, decided once in the plan."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
from tests.train.test_loop import recipe_for
from tests.train.test_plan import CPU, CUDA, plan

from entrenar.cli.main import main
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.models import fa4
from entrenar.models.hf import load_hf, read_config
from entrenar.train.prepare import prepare

EXTRA = "pip install 'entrenar[fa4]'"


@pytest.fixture
def installed(monkeypatch):
    """A stand-in flash_attn.cute (the plan only imports it)."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))


@pytest.fixture
def missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # its import raises ImportError


def _gpu(monkeypatch, capability):
    monkeypatch.setattr(fa4, "device_capability", lambda device: capability if device.type == "cuda" else None)


def _reason(p):
    return dict(p.reasons)["training.attention_kernel"]


def test_auto_takes_flashattention_4_on_hopper_with_the_extra_installed(workspace, installed, monkeypatch):
    _gpu(monkeypatch, (9, 0))
    auto = plan(workspace, "model.device=cuda", device=CUDA)
    assert auto.attention_kernel == "fa4" and _reason(auto).startswith("fa4 (auto): FlashAttention-4")
    fa2 = plan(workspace, "model.device=cuda", "training.attention_kernel=fa2", device=CUDA)
    assert (fa2.attention_kernel, _reason(fa2)) == ("fa2", "fa2 (as set)")


@pytest.mark.parametrize(("device", "capability", "names"), [
    (CUDA, (8, 0), "cuda has compute capability 8.0"), (CPU, None, "this run trains on cpu"),
    (CUDA, None, "not checked: no CUDA device on this machine")])
def test_auto_keeps_flashattention_2_where_fa4_cannot_run_and_says_why(workspace, installed, monkeypatch, device,
                                                                        capability, names):
    _gpu(monkeypatch, capability)
    p = plan(workspace, f"model.device={device.type}", device=device)
    assert p.attention_kernel == "fa2" and _reason(p).startswith("fa2 (auto:") and EXTRA in _reason(p)
    assert names in _reason(p)


def test_auto_without_the_extra_keeps_flashattention_2_naming_it(workspace, missing, monkeypatch):
    _gpu(monkeypatch, (9, 0))
    p = plan(workspace, "model.device=cuda", device=CUDA)
    assert p.attention_kernel == "fa2" and "flash_attn.cute (the flash-attn-4 package) does not import" in _reason(p)


def test_fa4_on_hopper_with_the_package_is_planned_and_printed(workspace, installed, monkeypatch):
    _gpu(monkeypatch, (9, 0))
    p = plan(workspace, "model.device=cuda", "training.attention_kernel=fa4", device=CUDA)
    assert p.attention_kernel == "fa4"
    assert _reason(p).startswith("fa4 (as set): FlashAttention-4") and "not for" not in _reason(p)
    # What FA4 does not take is named: gpt-oss's sinks, Gemma's capped scores, compiled blocks.
    config = dataclasses.replace(read_config(workspace / "model"), attention_sinks=True)
    p = plan(workspace, "model.device=cuda", "training.attention_kernel=fa4", "training.compile=true", device=CUDA,
             config=config)
    assert _reason(p).endswith("; not for attention sinks (FA2), blocks under torch.compile (FA2)")


def test_fa4_without_the_package_is_one_error_naming_the_setting_and_the_extra(workspace, missing, monkeypatch):
    _gpu(monkeypatch, (9, 0))
    with pytest.raises(ConfigError, match=r"^training\.attention_kernel: fa4: flash_attn\.cute .* does not import "
                                          r"here; install the extra: pip install 'entrenar\[fa4\]'"):
        plan(workspace, "model.device=cuda", "training.attention_kernel=fa4", device=CUDA)


@pytest.mark.parametrize(("device", "capability", "names"), [
    (CUDA, (8, 0), "cuda has compute capability 8.0"), (CUDA, (10, 0), "compute capability 10.0"),
    (CPU, None, "this run trains on cpu")])
def test_fa4_off_hopper_is_refused(workspace, installed, monkeypatch, device, capability, names):
    _gpu(monkeypatch, capability)
    with pytest.raises(ConfigError, match=rf"training\.attention_kernel: fa4: it runs on a Hopper GPU .*{names}"):
        plan(workspace, f"model.device={device.type}", "training.attention_kernel=fa4", device=device)


def test_fa4_planned_for_a_gpu_this_machine_lacks_is_left_unchecked(workspace, missing, monkeypatch):
    """``entrenar inspect`` plans a CUDA run on a machine without one: nothing there to check FA4 against."""
    _gpu(monkeypatch, None)
    p = plan(workspace, "model.device=cuda", "training.attention_kernel=fa4", device=CUDA)
    assert p.attention_kernel == "fa4" and "not checked" in _reason(p)


def test_an_unknown_kernel_is_a_recipe_error(workspace):
    with pytest.raises(ConfigError, match=r"training\.attention_kernel.*fa3"):
        recipe_for(workspace, "training.attention_kernel=fa3")


def test_prepare_hands_the_planned_kernel_to_the_model(workspace):
    """The loop reads the plan only: prepare sets the model's kernel, which every Documents of a forward carries."""
    recipe = recipe_for(workspace)
    planned = dataclasses.replace(plan(workspace), attention_kernel="fa4")
    model = load_hf(workspace / "model")
    assert model.attention_kernel == "fa2"
    assert prepare(model, recipe, planned, World()).model.attention_kernel == "fa4"


def test_the_cli_exits_2_with_the_one_line(workspace, missing, capsys):
    recipe_for(workspace)  # writes recipe.yaml
    code = main(["train", str(workspace / "recipe.yaml"), "--dry-run", "--no-progress",
                 "--set", "training.attention_kernel=fa4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: training.attention_kernel: fa4: ")
    assert EXTRA in err[0]
