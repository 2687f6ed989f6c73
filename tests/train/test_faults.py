"""Non-finite steps: caught before the optimizer applies them, stopped or skipped, never written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_loop import losses, recipe_for

import entrenar
from conftest import crash_after_step
from entrenar.errors import DataError
from entrenar.tasks import causal_lm
from entrenar.train import loop
from entrenar.train.faults import optimizer_step
from entrenar.train.metrics import read_metrics


def poison_gradients(monkeypatch, steps: set[int]) -> None:
    """Make the gradients of the given steps NaN (the loss stays finite): a hook on the final norm's output
    multiplies the gradient flowing back through it by NaN on the n-th forward pass that builds a graph."""
    real_load = entrenar.load
    calls = {"n": 0}

    def load(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)

        def hook(module, inputs, output):
            if output.requires_grad:  # a training forward (evaluation runs without a graph)
                calls["n"] += 1
                if calls["n"] in steps:
                    output.register_hook(lambda grad: grad * float("nan"))

        model.model.norm.register_forward_hook(hook)
        return model, tokenizer

    monkeypatch.setattr(causal_lm, "load", load)


def weights_are_finite(path) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(str(path)).values())


METHODS = {"lora": [], "full": ["lora=null"]}


@pytest.mark.parametrize("method, clip, bad_step", [("lora", 1.0, 6), ("full", 0.0, 6), ("lora", 0.0, 4),
                                                    ("full", 1.0, 4)])
def test_stop_names_the_step_and_a_last_good_checkpoint_that_resumes(workspace, monkeypatch, method, clip, bad_step):
    # bad_step 6 is a checkpoint step (save_every 3), 4 an evaluation step (eval_every 4, whose best is saved).
    good = {6: 4, 4: 3}[bad_step]
    recipe = recipe_for(workspace, *METHODS[method], f"training.max_grad_norm={clip}")
    with monkeypatch.context() as patch:
        poison_gradients(patch, {bad_step})
        with pytest.raises(DataError, match=rf"step {bad_step}: non-finite gradient norm \(nan\); its update was not "
                                            rf"applied.*last good checkpoint: .*step-{good}\)"):
            loop.train(recipe, progress=False)
    run = workspace / "run"
    assert not (run / "checkpoints" / f"step-{bad_step}").exists()
    assert weights_are_finite(run / "checkpoints" / f"step-{good}" / "model.safetensors")
    result = loop.train(recipe, resume=True, progress=False)  # the named checkpoint resumes
    assert result.steps == 8 and all(loss is not None for loss in losses(run))
    assert weights_are_finite(run / "checkpoints" / "step-8" / "model.safetensors")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_skip_drops_the_update_and_resumes_bit_identical_across_it(workspace, monkeypatch, method):
    overrides = [*METHODS[method], "training.nonfinite=skip"]
    with monkeypatch.context() as patch:
        poison_gradients(patch, {4, 6})  # an evaluation step and a checkpoint step
        straight = loop.train(recipe_for(workspace, *overrides, f"output.dir={workspace / 'straight'}"),
                              progress=False)
    records = [r for r in read_metrics(straight.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records if "skipped" in r] == [4, 6]
    assert all(r["skipped"] == "non-finite gradient norm (nan)" and r["grad_norm"] is None
               for r in records if "skipped" in r)
    assert all(r["loss"] is not None for r in records)  # the loss stayed finite: only the gradient was poisoned
    assert "2 update(s) dropped" in straight.summary
    # Dropped updates leave Adam untouched: its step count at step 6 is 4, not 6.
    optimizer_state = load_file(str(straight.run_dir / "checkpoints" / "step-6" / "optimizer.safetensors"))
    assert {float(v) for k, v in optimizer_state.items() if k.endswith(".step")} == {4.0}
    trainer = json.loads((straight.run_dir / "checkpoints" / "step-6" / "trainer.json").read_text())
    assert trainer["nonfinite"] == {"in_a_row": 1, "total": 2}
    output = straight.output / ("adapter_model.safetensors" if method == "lora" else "model.safetensors")
    assert weights_are_finite(output)

    recipe = recipe_for(workspace, *overrides)
    with monkeypatch.context() as patch:
        poison_gradients(patch, {4, 6})
        crash_after_step(patch, recipe, 7)  # the last checkpoint is step 6, the skipped one
    resumed = loop.train(recipe, resume=True, progress=False)
    assert losses(resumed.run_dir) == losses(straight.run_dir)  # bit for bit


def test_skip_gives_up_after_max_skipped_steps_in_a_row(workspace, monkeypatch):
    poison_gradients(monkeypatch, {2, 3, 4, 5})
    with pytest.raises(DataError, match=r"step 4: 3 steps in a row skipped .* more than "
                                        r"training\.max_skipped_steps=2.*last good checkpoint: .*step-3\)"):
        loop.train(recipe_for(workspace, "training.nonfinite=skip", "training.max_skipped_steps=2"), progress=False)


def test_the_gradscaler_skips_overflows_itself_and_says_so():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for grad, expected in ((torch.tensor([1.0, float("inf"), 1.0]), {"scaler_skipped": True}),
                           (torch.ones(3), {})):
        scaler.scale(param.sum()).backward()
        param.grad.copy_(grad * scaler.get_scale())
        scaler.unscale_(optimizer)
        before = param.detach().clone()
        assert optimizer_step(scaler, optimizer, skip=False) == expected
        assert torch.equal(param.detach(), before) == bool(expected)
        optimizer.zero_grad()
    assert scaler.get_scale() == 512.0  # halved once, by the overflow
    # A step the guard drops still closes the scaler's step, so the next unscale_ works.
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    assert optimizer_step(scaler, optimizer, skip=True) == {}
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
