"""Where a run lives and how it continues: the run folder, the recipe a resume may change, what a checkpoint holds.

A checkpoint keeps the trainable weights (adapters in a LoRA run, with a classifier's head; every weight in a
full fine-tune; QAT's quantizer state), the optimizer, RNG and the trainer's state (data position, counters),
so a resumed run repeats the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entrenar.adapters.lora import load_lora_state_dict, lora_state_dict
from entrenar.config import RESUMABLE_KEYS, Recipe, load_recipe, recipe_changes
from entrenar.errors import CheckpointError
from entrenar.io import atomic
from entrenar.io.checkpoint_files import CHECKPOINTS_DIR, TRAINER_FILE, incomplete_checkpoints
from entrenar.io.run_dir import ADAPTER_DIR, MODEL_DIR, RunDir
from entrenar.quant.qat import load_qat_state_dict, qat_state_dict
from entrenar.tasks.base import Task
from entrenar.train.checkpoint import latest_checkpoint, read_trainer_state
from entrenar.train.optim import LRSchedule


def run_root(recipe: Recipe, resume: str | Path | bool | None) -> Path:
    """The run folder's path: the one ``resume`` names, or the recipe's output.dir."""
    # Absolute, so paths the run records (the quickstart's) hold from any working directory.
    return (Path(resume) if isinstance(resume, (str, Path)) else Path(recipe.output.dir)).absolute()


def run_folder(recipe: Recipe, resume: str | Path | bool | None, dry_run: bool) -> tuple[RunDir, Path | None]:
    """The run folder, and the checkpoint to resume from. Refuses to train over an earlier run's checkpoints."""
    root = run_root(recipe, resume)
    if resume:
        _remove_incomplete(root)
        ckpt = latest_checkpoint(root)
        if ckpt is None:
            raise CheckpointError(f"{root}: no checkpoint to resume from")
        return RunDir(root), ckpt
    if not dry_run and latest_checkpoint(root) is not None:
        raise CheckpointError(f"{root} already holds a run with checkpoints; pass --resume to continue it, "
                              "or set output.dir to a new folder")
    return RunDir(root), None


def _remove_incomplete(root: Path) -> None:
    """Name and delete the ``step-N`` folders that are not whole checkpoints, so none is mistaken for one later."""
    broken = incomplete_checkpoints(root)
    for folder in broken:
        with contextlib.suppress(FileNotFoundError):  # another rank of the run removed it first
            atomic.remove_folder(folder)
    if broken:
        names = ", ".join(folder.name for folder in broken)
        warnings.warn(f"{root / CHECKPOINTS_DIR}: removed {len(broken)} incomplete checkpoint folder(s) ({names}); "
                      "a checkpoint folder lacking its files cannot be resumed from", stacklevel=3)


def recipe_for_resume(recipe: Recipe, run: RunDir) -> Recipe:
    """The saved recipe of the run, with only the changes a resume may make (:data:`RESUMABLE_KEYS`)."""
    if not run.recipe.is_file():
        raise CheckpointError(f"{run.root}: {run.recipe.name} is missing; cannot check that the resumed run is "
                              "the same")
    saved = load_recipe(run.recipe)
    changes = [c for c in recipe_changes(saved, recipe) if not c.startswith((*RESUMABLE_KEYS, "output."))]
    if changes:
        raise CheckpointError(f"{run.root}: the recipe differs from the run being resumed: " + "; ".join(changes)
                              + f" (a resume may change only {', '.join(RESUMABLE_KEYS)})")

    def allowed(section: str) -> dict[str, Any]:
        return {key.split(".")[1]: getattr(getattr(recipe, section), key.split(".")[1])
                for key in RESUMABLE_KEYS if key.startswith(section + ".")}

    return dataclasses.replace(saved, training=dataclasses.replace(saved.training, **allowed("training")),
                               data=dataclasses.replace(saved.data, **allowed("data")),
                               schedule=dataclasses.replace(saved.schedule, **allowed("schedule")))


def check_trainer_state(state: dict, checkpoint: Path, max_steps: int | None, needs_scaler: bool) -> int:
    """The step a checkpoint was taken at, after checking trainer.json holds what resuming needs (and, with
    ``max_steps``, that the run is not already past it)."""
    step, data = state.get("step"), state.get("data")
    where = checkpoint / "trainer.json"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: 'data' (the data stream position) is missing or not a mapping")
    if needs_scaler and not isinstance(state.get("grad_scaler"), dict):
        raise CheckpointError(f"{where}: 'grad_scaler' is missing; it is needed to resume fp16 training")
    if max_steps is not None and step > max_steps:
        raise CheckpointError(f"{checkpoint} is at step {step}, past training.max_steps={max_steps}; "
                              f"resume with --set training.max_steps={step} or more")
    return step


def resumed_schedule(state: dict, recipe: Recipe, checkpoint: Path) -> tuple[LRSchedule, str | None]:
    """The learning-rate schedule from a checkpoint's step on, and the line that tells how a changed
    training.max_steps changed it (None: unchanged). See :meth:`LRSchedule.resumed`."""
    o, s, t = recipe.optimizer, recipe.schedule, recipe.training
    if "schedule" in state:
        saved = LRSchedule(s.name, s.min_lr_ratio * o.lr, ()).load_state_dict(state["schedule"],
                                                                             str(checkpoint / TRAINER_FILE))
    else:  # a checkpoint from before schedules were saved: the recipe's, over the length it was saved with
        training = state["recipe"].get("training") if isinstance(state.get("recipe"), dict) else None
        length = training.get("max_steps") if isinstance(training, dict) else None
        length = length if isinstance(length, int) and length >= max(1, s.warmup_steps) else t.max_steps
        saved = LRSchedule.of(o.lr, s.warmup_steps, length, s.name, s.min_lr_ratio)
    step = state["step"]
    schedule = saved.resumed(step, t.max_steps, s.on_extend, o.lr, s.warmup_steps)
    return schedule, None if schedule == saved else saved.describe_change(schedule, step, s.on_extend)


def check_resume(run: RunDir, checkpoint: Path, recipe: Recipe) -> tuple[int, str | None]:
    """Before anything loads: check the checkpoint's trainer.json and how the schedule goes on (a refused
    ``schedule.on_extend`` is found now). Returns the checkpoint's step and, when the run has finished (its last
    step, or an early stop, checkpointed and its result saved after it), why there is nothing to do."""
    state = read_trainer_state(checkpoint)
    if recipe.training.max_steps is None:  # training.epochs: the length is known once the data is read, and the
        return check_trainer_state(state, checkpoint, None, needs_scaler=False), None  # Trainer checks it then
    step = check_trainer_state(state, checkpoint, recipe.training.max_steps, needs_scaler=False)
    resumed_schedule(state, recipe, checkpoint)
    stopping = recipe.training.early_stopping
    counter = state.get("early_stopping")
    bad_evals = counter.get("bad_evals", 0) if isinstance(counter, dict) else 0
    stopped = stopping is not None and isinstance(bad_evals, int) and bad_evals >= stopping["patience"]
    if (step < recipe.training.max_steps and not stopped) or not _result_saved_after(run, recipe, checkpoint):
        return step, None
    if step < recipe.training.max_steps:
        patience = stopping["patience"] if stopping is not None else 0
        return step, (f"nothing to do: {run.root} stopped early at step {step} ({bad_evals} evaluation(s) without "
                      f"improvement, training.early_stopping.patience: {patience}) and saved its result; to train "
                      "on, raise training.early_stopping.patience (or set training.early_stopping to null) and "
                      "resume again")
    return step, (f"nothing to do: {run.root} finished at step {step} of training.max_steps={step} and saved its "
                  f"result; to train longer, raise training.max_steps above {step} and resume again (the learning "
                  f"rate then follows schedule.on_extend, now {recipe.schedule.on_extend})")


def _result_saved_after(run: RunDir, recipe: Recipe, checkpoint: Path) -> bool:
    """Whether every file of the run's result (and a QAT run's integer model) was written after ``checkpoint``:
    a run stopped while saving them has not finished, and resuming it saves them."""
    folders = [run.root / (ADAPTER_DIR if recipe.lora is not None else MODEL_DIR)]
    if recipe.qat is not None:
        folders.append(run.quantized)
    files = [path for folder in folders for path in folder.rglob("*") if path.is_file()]
    saved = (checkpoint / TRAINER_FILE).stat().st_mtime_ns
    return all(folder.is_dir() for folder in folders) and bool(files) and all(
        path.stat().st_mtime_ns >= saved for path in files)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, with where it can continue from: the run folder and its last checkpoint (None: none
    was saved). Its text spells the Python call; :meth:`describe` takes a front end's own spelling."""

    def __init__(self, run_dir: Path, checkpoint: Path | None, save_every: int) -> None:
        self.run_dir, self.checkpoint, self.save_every = run_dir, checkpoint, save_every
        super().__init__(self.describe(f"train(recipe, resume={str(run_dir)!r})", "train(recipe)"))

    @property
    def step(self) -> int | None:
        """The step of the last checkpoint."""
        match = re.fullmatch(r"step-(\d+)", self.checkpoint.name) if self.checkpoint is not None else None
        return int(match.group(1)) if match else None

    def describe(self, resume_with: str, start_with: str) -> str:
        """Two lines: what was saved, and the command that goes on (``resume_with``) or starts again."""
        if self.checkpoint is None:
            when = ("training.save_every: 0 saves one only at the end" if not self.save_every else
                    f"training.save_every: {self.save_every}")
            return (f"interrupted before the first checkpoint ({when}): there is nothing to resume\n"
                    f"start again with: {start_with}")
        return (f"interrupted; the last checkpoint is step {self.step} ({self.checkpoint})\n"
                f"continue with: {resume_with}")


def trainable_state(model: nn.Module, recipe: Recipe, task: Task) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps: the adapters (and what the task trains whole) in a LoRA run, every weight
    otherwise; and QAT's quantizer state."""
    if recipe.lora is not None:
        return {**lora_state_dict(model), **task.head_state(model), **qat_state_dict(model)}
    return {**dict(model.named_parameters()), **qat_state_dict(model)}


def load_trainable_state(model: nn.Module, recipe: Recipe, task: Task, state: dict[str, torch.Tensor],
                         source: str) -> None:
    """Put a checkpoint's :func:`trainable_state` back into ``model``."""
    state = load_qat_state_dict(model, state, source)  # takes the quantizer state, leaves the rest
    if recipe.lora is not None:
        head_names = task.head_state(model)
        head = {name: state.pop(name) for name in list(state) if name in head_names}
        load_lora_state_dict(model, state, source=source)
        with torch.no_grad():
            for name, tensor in head.items():
                model.get_parameter(name).copy_(tensor)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


__all__ = ["Interrupted", "check_resume", "check_trainer_state", "load_trainable_state", "recipe_for_resume",
           "resumed_schedule", "run_folder", "run_root", "trainable_state"]
