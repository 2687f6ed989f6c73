"""Resuming: the learning rate when a resume changes the run's length (schedule.on_extend), what Ctrl-C says and
whether its command continues the run, a resume with nothing to do, and a resumed run's summary."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil

import pytest
from test_loop import losses, recipe_for

from conftest import make_workspace
from entrenar.cli.main import main
from entrenar.errors import ConfigError
from entrenar.train import loop
from entrenar.train.loop import train
from entrenar.train.metrics import MetricsLogger, read_metrics
from entrenar.train.resume import Interrupted

BASE, FLOOR, WARMUP = 1e-2, 1e-3, 2  # recipe_for: optimizer.lr, min_lr_ratio 0.1 (the default), warmup_steps


def cosine(step: int, peak: float, start: int, warmup: int, end: int) -> float:
    """The lr of ``step`` by hand: linear warmup from ``start``, then cosine from ``peak`` to FLOOR at ``end``."""
    if step - start < warmup:
        return peak * (step - start + 1) / (warmup + 1)
    progress = min(1.0, (step - start - warmup) / (end - start - warmup))
    return FLOOR + (peak - FLOOR) * (1 + math.cos(math.pi * progress)) / 2


def lrs(run_dir) -> list[float]:
    return [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def stop_at(step: int):
    """A MetricsLogger.log_step that raises KeyboardInterrupt right after ``step`` is logged (Ctrl-C there)."""
    real = MetricsLogger.log_step

    def log_step(self, logged, *args, **kwargs):
        record = real(self, logged, *args, **kwargs)
        if logged == step:
            raise KeyboardInterrupt
        return record

    return log_step


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """An 8-step cosine run stopped by Ctrl-C after step 7; its last checkpoint is step 6 (save_every 3)."""
    ws = make_workspace(tmp_path_factory.mktemp("resume"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", stop_at(7))
        with pytest.raises(Interrupted) as stop:
            train(recipe_for(ws), progress=False)
    return ws, stop.value


def copy_of(interrupted, name):
    ws, _ = interrupted
    shutil.copytree(ws / "run", ws / name)
    return ws, ws / name


def test_extending_a_run_continues_the_lr_curve_without_a_jump_by_default(interrupted, capsys):
    ws, run = copy_of(interrupted, "continue")
    old = [cosine(i, BASE, 0, WARMUP, 8) for i in range(8)]
    assert lrs(run) == pytest.approx(old[:7], rel=1e-12)

    result = train(recipe_for(ws, "training.max_steps=12"), resume=run, progress=False, verbose=True)
    peak = old[6]  # step 7 gets what the 8-step schedule gave it, and decays from there to the floor at 12
    expected = old[:6] + [cosine(i, peak, 6, 0, 12) for i in range(6, 12)]
    assert lrs(run) == pytest.approx(expected, rel=1e-12)
    assert max(lrs(run)[6:]) == pytest.approx(old[6], rel=1e-12)  # no jump: rescaling would give 7.9e-3
    line = (f"training.max_steps 8 -> 12: lr {old[5]:.2e} at step 6, {old[6]:.2e} at step 7 (schedule.on_extend: "
            "continue, decays on from there to the floor at the new end; or rewarm: ")
    assert line in capsys.readouterr().out
    assert ("schedule", line) == next((k, v[:len(line)]) for k, v in _rows(result.summary) if k == "schedule")


@pytest.mark.parametrize("on_extend", ["rewarm", "rescale"])
def test_extending_a_run_rewarms_or_rescales_when_the_recipe_says(interrupted, on_extend, capsys):
    ws, run = copy_of(interrupted, on_extend)
    train(recipe_for(ws, "training.max_steps=12", f"schedule.on_extend={on_extend}"), resume=run, progress=False,
          verbose=True)
    old = [cosine(i, BASE, 0, WARMUP, 8) for i in range(6)]
    if on_extend == "rewarm":  # a new warmup of schedule.warmup_steps from step 7, then cosine to the floor at 12
        added = [cosine(i, BASE, 6, WARMUP, 12) for i in range(6, 12)]
    else:  # the 8-step schedule recomputed over 12 steps, as transformers' schedulers do on resume
        added = [cosine(i, BASE, 0, WARMUP, 12) for i in range(6, 12)]
    assert lrs(run) == pytest.approx(old + added, rel=1e-12)
    assert f"{added[0]:.2e} at step 7 (schedule.on_extend: {on_extend}," in capsys.readouterr().out


def test_an_extended_run_resumed_again_keeps_its_extended_curve(interrupted):
    """The checkpoints carry the schedule: stopped after step 10 of the extended run and resumed with the same
    recipe, it ends as the extension run straight through does (the curve is not recomputed from the recipe)."""
    ws, straight = copy_of(interrupted, "extended-straight")
    train(recipe_for(ws, "training.max_steps=12"), resume=straight, progress=False)
    ws, run = copy_of(interrupted, "extended-twice")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", stop_at(10))
        with pytest.raises(Interrupted, match="the last checkpoint is step 9"):
            train(recipe_for(ws, "training.max_steps=12"), resume=run, progress=False)
    train(recipe_for(ws, "training.max_steps=12"), resume=run, progress=False)
    assert lrs(run) == lrs(straight) and losses(run) == losses(straight)


def test_a_checkpoint_without_a_saved_schedule_continues_from_the_length_it_was_saved_with(interrupted):
    """Checkpoints written before schedules were saved: the old length comes from the recipe they keep."""
    ws, run = copy_of(interrupted, "old-checkpoint")
    state_file = run / "checkpoints" / "step-6" / "trainer.json"
    state = json.loads(state_file.read_text())
    del state["schedule"]
    state_file.write_text(json.dumps(state))
    train(recipe_for(ws, "training.max_steps=12"), resume=run, progress=False)
    old = [cosine(i, BASE, 0, WARMUP, 8) for i in range(7)]
    assert lrs(run) == pytest.approx(old[:6] + [cosine(i, old[6], 6, 0, 12) for i in range(6, 12)], rel=1e-12)


def test_an_extension_that_cannot_train_is_refused_before_the_model_loads(workspace, monkeypatch):
    short = ["training.max_steps=4", "training.eval_every=0", "training.save_every=0", "schedule.min_lr_ratio=0"]
    train(recipe_for(workspace, *short), progress=False)
    monkeypatch.setattr(loop, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=r"schedule\.on_extend: continue .* at step 4, and that is 0 .* to rewarm"):
        train(recipe_for(workspace, *short, "training.max_steps=6"), resume=True, progress=False)
    with pytest.raises(ConfigError, match=r"rewarm: the new warmup \(schedule\.warmup_steps=2\) is longer than the "
                                          r"1 step\(s\) left after step 4; raise training\.max_steps to at least 6"):
        train(recipe_for(workspace, *short, "training.max_steps=5", "schedule.on_extend=rewarm"), resume=True,
              progress=False)


def _rows(summary: str) -> list[tuple[str, str]]:
    return [(line[:15].strip(), line[15:].strip()) for line in summary.splitlines()]


def test_ctrl_c_names_the_checkpoint_and_its_command_resumes_the_run(workspace, monkeypatch, capsys):
    recipe_for(workspace)  # writes recipe.yaml (output.dir: run)
    straight_dir = workspace / "straight"
    assert main(["train", str(workspace / "recipe.yaml"), "--set", f"output.dir={straight_dir}", "--no-progress"]) == 0
    straight = capsys.readouterr().out.split("saving ...\n")[-1]
    run = workspace / "run"
    argv = ["train", str(workspace / "recipe.yaml"), "--set", "training.log_every=4", "--no-progress"]
    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", stop_at(7))
        assert main(argv) == 130
    err = capsys.readouterr().err.splitlines()
    command = ["entrenar", *argv[:-1], "--resume", str(run)]
    assert err == [f"interrupted; the last checkpoint is step 6 ({run / 'checkpoints' / 'step-6'})",
                   f"continue with: {shlex.join(command)}"]

    given = shlex.split(err[1].removeprefix("continue with: "))
    assert given[0] == "entrenar" and main(given[1:]) == 0
    resumed = capsys.readouterr().out.split("saving ...\n")[-1]
    assert losses(run) == losses(straight_dir)
    # The summary has the uninterrupted run's shape, the held-out loss before and after training included.
    assert [key for key, _ in _rows(resumed)] == [key for key, _ in _rows(straight)]
    assert dict(_rows(resumed))["held-out loss"] == dict(_rows(straight))["held-out loss"]


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(workspace, monkeypatch, capsys):
    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", stop_at(2))
        with pytest.raises(Interrupted) as stop:
            train(recipe_for(workspace), progress=False)
        assert stop.value.checkpoint is None and str(stop.value) == (
            "interrupted before the first checkpoint (training.save_every: 3): there is nothing to resume\n"
            "start again with: train(recipe)")
        assert main(["train", str(workspace / "recipe.yaml")]) == 130
    assert capsys.readouterr().err.endswith(
        f"there is nothing to resume\nstart again with: entrenar train {workspace / 'recipe.yaml'}\n")


def _files(folder) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*"))}


def test_resuming_a_finished_run_says_there_is_nothing_to_do_and_writes_nothing(workspace, monkeypatch, capsys):
    short = ["training.max_steps=4", "training.eval_every=0", "training.save_every=2"]
    train(recipe_for(workspace, *short), progress=False)
    run = workspace / "run"
    before = _files(run)
    assert main(["train", str(workspace / "recipe.yaml"), *[x for s in short for x in ("--set", s)], "--resume"]) == 0
    assert capsys.readouterr().out == (
        f"nothing to do: {run} finished at step 4 of training.max_steps=4 and saved its result; to train longer, "
        "raise training.max_steps above 4 and resume again (the learning rate then follows schedule.on_extend, "
        "now continue)\n")
    assert _files(run) == before

    # Stopped while saving its result (the adapter older than the last checkpoint): resuming saves it.
    os.utime(run / "checkpoints" / "step-4" / "trainer.json", ns=(1, max(t for t, _ in before.values()) + 10**9))
    result = train(recipe_for(workspace, *short), resume=True, progress=False)
    assert not result.summary.startswith("nothing to do") and result.output == run / "adapter"
    assert (run / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns > before[
        str(run / "adapter" / "adapter_model.safetensors")][0]


def test_resuming_a_run_that_stopped_early_says_there_is_nothing_to_do(workspace, monkeypatch):
    stopping = ["training.eval_every=2", "training.save_every=2",
                "training.early_stopping={metric: eval_loss, patience: 3, min_delta: 10}"]
    assert train(recipe_for(workspace, *stopping), progress=False).steps == 6
    monkeypatch.setattr(loop, "load_model", lambda *a: pytest.fail("the model was loaded"))
    result = train(recipe_for(workspace, *stopping), resume=True, progress=False)
    assert result.steps == 6 and result.summary.startswith(
        f"nothing to do: {workspace / 'run'} stopped early at step 6 (3 evaluation(s) without improvement")
