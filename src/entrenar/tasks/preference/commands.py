"""A model's preference metrics on a data file (``entrenar eval`` on preference data), as a run's evaluation
computes them."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from torch import nn

from entrenar.config import Recipe
from entrenar.config.sections import DataSection, LoraSection, TaskSection, TrainingSection
from entrenar.data.preference import read_preference_file
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ConfigError
from entrenar.models.transformer import Transformer
from entrenar.tasks.preference import losses as L
from entrenar.tasks.preference.metrics import PreferenceEval
from entrenar.tasks.preference.task import PreferenceTask


def evaluate_preference_file(model: Transformer, tokenizer: Tokenizer, path: str | Path, task: TaskSection, *,
                             seq_len: int = 512, batch_size: int = 4, lora: bool = False,
                             reference: nn.Module | None = None, precision: str = "fp32",
                             columns: dict[str, str] | None = None) -> PreferenceEval:
    """TRL's preference metrics of ``model`` on a preference data file, as a run's evaluation computes them
    (``entrenar eval`` on preference data). ``task``: the loss and its settings (a run's ``task`` section);
    ``lora``: the model carries an adapter, whose base (adapters switched off) is the reference; otherwise
    ``reference`` is a separate reference model, which a loss with a reference needs."""
    if task.loss not in L.REFERENCE_FREE and not lora and reference is None:
        raise ConfigError(f"task.loss {task.loss} compares the model with a reference: evaluate an adapter (its base "
                          "is the reference) or pass the reference model")
    cols = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "completion": "completion",
            "label": "label", **(columns or {})}
    settings = {**{f.name: getattr(task, f.name) for f in fields(task)}, "type": "preference"}
    settings["reference"] = "auto" if task.loss in L.REFERENCE_FREE else ("adapters_off" if lora else "copy")
    recipe = Recipe(task=TaskSection(**settings), lora=LoraSection() if lora else None,
                    data=DataSection(seq_len=seq_len, prompt_field=cols["prompt"], chosen_field=cols["chosen"],
                                     rejected_field=cols["rejected"], completion_field=cols["completion"],
                                     label_field=cols["label"]),
                    training=TrainingSection(batch_size=batch_size, precision=precision))
    evaluator = PreferenceTask(recipe)
    evaluator.prepare(model, reference)
    examples, _, _ = read_preference_file(
        str(path), tokenizer, seq_len=seq_len, kind="unpaired" if task.loss == "kto" else "pairs",
        columns={k: v for k, v in cols.items()}, key="--data")
    return evaluator.evaluate(model, list(examples), tokenizer)


__all__ = ["evaluate_preference_file"]
