"""A run's data: the task's examples of the training and validation files, and the stream of training batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entrenar.config import Recipe
from entrenar.data import BatchStream, split_validation
from entrenar.data.mix import mix, weighted
from entrenar.data.sources import Skip
from entrenar.data.synth import is_synth
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ConfigError, DataError, ModelError
from entrenar.io import hub
from entrenar.tasks.base import Task

# What a run without held-out examples says at the start and in --dry-run.
NO_VALIDATION = "nothing will be evaluated: no held-out loss, no best checkpoint; set data.validation or " \
                "data.validation_split"


@dataclass
class RunData:
    examples: list  # trained on (after the validation split)
    validation: list
    notes: list[str]  # what was skipped, cut or odd, for the summary
    stream: BatchStream  # resumable, deterministic
    skipped: list[Skip] = field(default_factory=list)  # every record on_error=skip left out (skipped.jsonl)

    @property
    def mean_example_tokens(self) -> float:
        return sum(example_tokens(e) for e in self.examples) / len(self.examples)


def example_tokens(example: Any) -> int:
    """Tokens an example becomes: its length, or for a preference example (a prompt and its completions, each a
    sequence of its own) the sum of its sequences'."""
    sequences = getattr(example, "sequences", None)
    if callable(sequences):
        return sum(len(example.prompt) + len(completion) for completion in sequences())
    return len(example)


def check_paths(recipe: Recipe) -> None:
    """Every file the recipe names besides the model exists (the training files, the validation file, a random
    model's tokenizer unless it is a Hub id): checked before anything is loaded, so a typo costs no model load.
    Synthetic sources (``synth:``) are not files."""
    d, m = recipe.data, recipe.model
    named = [("data.train" if isinstance(d.train, str) else f"data.train[{i}].path", path)
             for i, (path, _, _) in enumerate(d.sources())]
    named += [("data.validation", d.validation)] if d.validation is not None else []
    named += [("model.tokenizer", m.tokenizer)] if m.tokenizer is not None and _local(m.tokenizer) else []
    for key, path in named:
        if not is_synth(path) and not Path(path).exists():
            raise DataError(f"{key}: no such file or folder: {path}")


def _local(name: str) -> bool:
    """Whether ``name`` means a local path (as :func:`entrenar.io.hub.resolve` decides), not a Hub id."""
    try:
        hub_id = hub.parse_hub_id(name)
    except ModelError:  # neither a path that exists nor an id: the loader says why
        return False
    return hub_id is None or Path(hub_id.repo.split("/")[0]).expanduser().is_dir()


def read_data(recipe: Recipe, task: Task, tokenizer: Tokenizer) -> RunData:
    """Read, tokenize and split the recipe's data as ``task`` lays it out."""
    d, t = recipe.data, recipe.training
    skipped: list[Skip] = []
    assert d.train is not None  # a recipe that trains names it (Recipe checks; the quickstart resolves its own)
    if isinstance(d.train, str):
        examples, notes = task.read(d.train, "train", tokenizer, skipped)
        parts = [(examples, 1.0)]
    else:  # several files, each in its format, mixed by weight (entrenar.data.mix)
        parts, notes = [], []
        for path, weight, format in d.sources():
            part, part_notes = task.read(path, "train", tokenizer, skipped, format=format)
            parts.append((part, weight))
            notes += part_notes
    if d.validation:
        validation, validation_notes = task.read(d.validation, "validation", tokenizer, skipped)
        notes += validation_notes
    else:  # each file's share held out before the mix repeats any example
        splits = [split_validation(part, d.validation_split, seed=t.seed) for part, _ in parts]
        parts = [(kept, weight) for (kept, _), (_, weight) in zip(splits, parts, strict=True)]
        validation = [example for _, held in splits for example in held]
    examples = mix(parts, t.seed)
    if not isinstance(d.train, str):
        notes.append("data.train: mixed " + ", ".join(
            f"{path} x{weight:g} ({len(weighted(part, weight, t.seed, i)):,} examples)"
            for i, ((path, weight, _), (part, _)) in enumerate(zip(d.sources(), parts, strict=True))))
    stream, stream_notes = task.stream(examples, tokenizer)  # a task's stream may weigh its rows (class weights)
    if t.early_stopping is not None and not validation:
        raise ConfigError("training.early_stopping: needs a validation set (data.validation or data.validation_split)")
    return RunData(examples, validation, notes + stream_notes, stream, skipped)


__all__ = ["NO_VALIDATION", "RunData", "check_paths", "example_tokens", "read_data"]
