"""Where a run lives and how it continues: the run folder, the recipe a resume may change, what a checkpoint holds.

A checkpoint keeps the trainable weights (adapters in a LoRA run, with a classifier's head; every weight in a
full fine-tune; QAT's quantizer state), the optimizer, RNG and the trainer's state (data position, counters),
so a resumed run repeats the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entrenar.adapters.lora import load_lora_state_dict, lora_state_dict
from entrenar.config import RESUMABLE_KEYS, Recipe, load_recipe, recipe_changes
from entrenar.errors import CheckpointError
from entrenar.io import atomic
from entrenar.io.checkpoint_files import CHECKPOINTS_DIR, incomplete_checkpoints
from entrenar.io.run_dir import RunDir
from entrenar.quant.qat import load_qat_state_dict, qat_state_dict
from entrenar.tasks.base import Task
from entrenar.train.checkpoint import latest_checkpoint


def run_folder(recipe: Recipe, resume: str | Path | bool | None, dry_run: bool) -> tuple[RunDir, Path | None]:
    """The run folder, and the checkpoint to resume from. Refuses to train over an earlier run's checkpoints."""
    # Absolute, so paths the run records (the quickstart's) hold from any working directory.
    root = (Path(resume) if isinstance(resume, (str, Path)) else Path(recipe.output.dir)).absolute()
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
                               data=dataclasses.replace(saved.data, **allowed("data")))


def check_trainer_state(state: dict, checkpoint: Path, max_steps: int, needs_scaler: bool) -> int:
    """The step a checkpoint was taken at, after checking trainer.json holds what resuming needs."""
    step, data = state.get("step"), state.get("data")
    where = checkpoint / "trainer.json"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: 'data' (the data stream position) is missing or not a mapping")
    if needs_scaler and not isinstance(state.get("grad_scaler"), dict):
        raise CheckpointError(f"{where}: 'grad_scaler' is missing; it is needed to resume fp16 training")
    if step > max_steps:
        raise CheckpointError(f"{checkpoint} is at step {step}, past training.max_steps={max_steps}; "
                              f"resume with --set training.max_steps={step} or more")
    return step


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


__all__ = ["check_trainer_state", "load_trainable_state", "recipe_for_resume", "run_folder", "trainable_state"]
