"""Overlapped steps (``training.overlap_steps``): each step read after the next one's micro-steps are launched
gives the run that reads every step at once, bit for bit, and drops a non-finite update on the device exactly
as the guard decides."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_faults import poison_gradients
from test_loop import recipe_for

from entrenar.errors import ConfigError, DataError
from entrenar.train import loop, stepping
from entrenar.train.metrics import read_metrics
from entrenar.train.overlap import DeferredRead


def run(ws, name, *overrides):
    return loop.train(recipe_for(ws, "optimizer.fused=true", *overrides, f"output.dir={ws / name}"), progress=False)


def steps(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"], r.get("skipped"))
            for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def count_deferred_reads(monkeypatch) -> list:
    reads = []

    class Counted(DeferredRead):
        def __init__(self, values):
            reads.append(values.shape)
            super().__init__(values)

    monkeypatch.setattr(stepping, "DeferredRead", Counted)
    return reads


def same_tensors(a, b) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("method", [[], ["lora=null"]], ids=["lora", "full"])
def test_overlapped_steps_give_the_same_run_bit_for_bit(workspace, monkeypatch, method):
    at_once = run(workspace, "at-once", *method, "training.overlap_steps=false")
    reads = count_deferred_reads(monkeypatch)
    overlapped = run(workspace, "overlapped", *method, "training.overlap_steps=true")
    # eval_every 4, save_every 3, max_steps 8: steps 2, 5 and 7 were read late; 3, 4, 6 and 8 at once, and 1,
    # before which the optimizer had no state.
    assert len(reads) == 3
    assert steps(overlapped.run_dir) == steps(at_once.run_dir)
    assert all(r["tokens_per_s"] > 0 for r in read_metrics(overlapped.run_dir / "metrics.jsonl") if "loss" in r)
    name = "model.safetensors" if method else "adapter_model.safetensors"
    assert same_tensors(overlapped.output / name, at_once.output / name)
    assert same_tensors(overlapped.run_dir / "checkpoints" / "step-6" / "optimizer.safetensors",
                        at_once.run_dir / "checkpoints" / "step-6" / "optimizer.safetensors")


def test_a_nonfinite_overlapped_step_is_dropped_on_the_device_as_the_guard_says(workspace, monkeypatch):
    with monkeypatch.context() as patch:
        poison_gradients(patch, {2, 5})  # both read late
        at_once = run(workspace, "at-once", "training.nonfinite=skip", "training.overlap_steps=false")
    with monkeypatch.context() as patch:
        poison_gradients(patch, {2, 5})
        overlapped = run(workspace, "overlapped", "training.nonfinite=skip", "training.overlap_steps=true")
    records = steps(overlapped.run_dir)
    assert [r[0] for r in records if r[5]] == [2, 5]
    assert records == steps(at_once.run_dir)
    assert same_tensors(overlapped.output / "adapter_model.safetensors", at_once.output / "adapter_model.safetensors")
    # Adam never saw the dropped steps: its step count at step 6 is 4 in both runs.
    optimizer_state = load_file(str(overlapped.run_dir / "checkpoints" / "step-6" / "optimizer.safetensors"))
    assert {float(v) for k, v in optimizer_state.items() if k.endswith(".step")} == {4.0}
    trainer = json.loads((overlapped.run_dir / "checkpoints" / "step-6" / "trainer.json").read_text())
    assert trainer["nonfinite"] == {"in_a_row": 0, "total": 2}


def test_sgd_momentum_is_never_built_by_a_dropped_update(workspace, monkeypatch):
    """Fused SGD builds its momentum buffers (uninitialised) in its first step and its kernel fills them; a first
    update dropped on the device would keep the garbage. Steps before the optimizer has state are read at once:
    the poisoned first step is skipped on the host, the later poisoned one on the device, as the synchronous run."""
    runs = {}
    for overlap in ("false", "true"):
        with monkeypatch.context() as patch:
            poison_gradients(patch, {1, 5})
            runs[overlap] = run(workspace, overlap, "optimizer.name=sgd", "training.nonfinite=skip",
                                f"training.overlap_steps={overlap}")
    records = steps(runs["true"].run_dir)
    assert [r[0] for r in records if r[5]] == [1, 5]
    assert records == steps(runs["false"].run_dir)
    assert same_tensors(runs["true"].output / "adapter_model.safetensors",
                        runs["false"].output / "adapter_model.safetensors")


def test_stop_on_an_overlapped_step_names_it_and_writes_nothing_after(workspace, monkeypatch):
    with monkeypatch.context() as patch:
        poison_gradients(patch, {5})
        with pytest.raises(DataError, match=r"step 5: non-finite gradient norm \(nan\); its update was not applied.*"
                                            r"last good checkpoint: .*step-4\)"):
            run(workspace, "run", "training.overlap_steps=true")
    checkpoints = sorted(p.name for p in (workspace / "run" / "checkpoints").iterdir())
    assert "step-5" not in checkpoints and "step-6" not in checkpoints
    assert [r[0] for r in steps(workspace / "run")] == [1, 2, 3, 4]  # step 5 never logged as trained


def test_overlap_steps_true_where_it_cannot_work_says_why(workspace):
    with pytest.raises(ConfigError, match=r"training\.overlap_steps: only a fused optimizer"):
        loop.train(recipe_for(workspace, "optimizer.fused=false", "training.overlap_steps=true"), progress=False)
