"""A run's data: the task's examples of the training and validation files, and the stream of training batches."""

from __future__ import annotations

from dataclasses import dataclass, field

from entrenar.config import Recipe
from entrenar.data import BatchStream, split_validation
from entrenar.data.sources import Skip
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ConfigError
from entrenar.tasks.base import Task


@dataclass
class RunData:
    examples: list  # trained on (after the validation split)
    validation: list
    notes: list[str]  # what was skipped, cut or odd, for the summary
    stream: BatchStream  # resumable, deterministic
    skipped: list[Skip] = field(default_factory=list)  # every record on_error=skip left out (skipped.jsonl)

    @property
    def mean_example_tokens(self) -> float:
        return sum(len(e) for e in self.examples) / len(self.examples)


def read_data(recipe: Recipe, task: Task, tokenizer: Tokenizer) -> RunData:
    """Read, tokenize and split the recipe's data as ``task`` lays it out."""
    d, t = recipe.data, recipe.training
    skipped: list[Skip] = []
    assert d.train is not None  # a recipe that trains names it (Recipe checks; the quickstart resolves its own)
    examples, notes = task.read(d.train, "train", tokenizer, skipped)
    if d.validation:
        validation, validation_notes = task.read(d.validation, "validation", tokenizer, skipped)
        notes += validation_notes
    else:
        examples, validation = split_validation(examples, d.validation_split, seed=t.seed)
    stream, stream_notes = task.stream(examples, tokenizer)  # a task's stream may weigh its rows (class weights)
    if t.early_stopping is not None and not validation:
        raise ConfigError("training.early_stopping: needs a validation set (data.validation or data.validation_split)")
    return RunData(examples, validation, notes + stream_notes, stream, skipped)


__all__ = ["RunData", "read_data"]
