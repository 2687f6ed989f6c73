"""Labeled texts from data files, and the batches they train in.

A record's ``text_field`` is tokenized (special tokens as the tokenizer adds them, no EOS, cut to ``seq_len``) and
its ``label_field`` parsed by the run's :class:`~entrenar.tasks.classification.labels.LabelSpec`. A batch is
padded rows (right padding, to the longest row), ``attention_mask``, ``labels`` and each row's loss weight; it is
never packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from entrenar.data import BatchStream, read_records
from entrenar.data.batching import PAD_DOCUMENT
from entrenar.data.formats import split_format
from entrenar.data.sources import Skip
from entrenar.data.tokenize import Example, check_text
from entrenar.errors import ConfigError, DataError
from entrenar.tasks.classification.labels import LabelSpec

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer


@dataclass
class LabeledText:
    """One tokenized text and its target: a class id, a 0/1 vector, or real values."""

    input_ids: list[int]
    target: int | list[float]
    origin: str = ""
    text: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


def read_labeled(path: str, role: str, recipe: Any, tokenizer: Tokenizer, spec: LabelSpec,
                 skipped_out: list[Skip] | None = None, format: str | None = None
                 ) -> tuple[list[LabeledText], list[str]]:
    """The labeled texts of one data file, read as the recipe's data section says, and notes on what was skipped
    or cut (every skipped record is also appended to ``skipped_out``, for the run's skipped.jsonl)."""
    d = recipe.data
    file_format = split_format(format or d.format)[0]
    return read_texts(path, tokenizer, spec, d.text_field, d.label_field, d.seq_len, file_format, d.on_error,
                      f"data.{role}", skipped_out, seed=recipe.training.seed, query=d.query,
                      attach=d.attach)


def read_texts(path: str, tokenizer: Tokenizer, spec: LabelSpec | None, text_field: str = "text",
               label_field: str = "label", seq_len: int = 512, fmt: str = "auto", on_error: str = "raise",
               role: str = "data", skipped_out: list[Skip] | None = None, seed: int = 0,
               query: str | None = None, attach: dict[str, str] | None = None
               ) -> tuple[list[LabeledText], list[str]]:
    """Tokenized texts of a data file with their targets (``spec`` None: no labels read, for prediction)."""
    records, stats = read_records(path, format=fmt, on_error=on_error, seed=seed, query=query,
                                  attach=attach)
    if skipped_out is not None:
        skipped_out.extend(stats.skipped_records)
    examples, skipped, cut = [], [], 0
    for record in records:
        fields = record.fields
        try:
            text = fields.get(text_field)
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{record.where}: field '{text_field}' must be non-empty text")
            check_text(text, record.where, text_field)  # no lone surrogate, no byte-order mark inside
            target: Any = None
            if spec is not None:
                if label_field not in fields:
                    raise DataError(f"{record.where}: no field '{label_field}' (the label)")
                target = spec.parse(fields[label_field], record.where)
        except DataError as e:
            if on_error == "raise":
                raise
            skipped.append(str(e))
            if skipped_out is not None:
                skipped_out.append(Skip(record.file, record.location, "bad label or text", str(e)))
            continue
        ids = tokenizer.encode(text)
        if len(ids) > seq_len:
            ids, cut = ids[:seq_len], cut + 1
        examples.append(LabeledText(ids, target, record.where, text))
    if not examples:
        raise DataError(f"{role} ({path}): no examples")
    notes = []
    if skipped or stats.skipped:
        first = (stats.skip_reasons or skipped)[0]
        notes.append(f"{role}: {len(skipped) + stats.skipped} record(s) skipped (first: {first})")
    if cut:
        notes.append(f"{role}: {cut} text(s) cut to seq_len={seq_len}")
    return examples, notes


def class_weights(setting: Any, examples: list[LabeledText], num_labels: int) -> list[float] | None:
    """Per-class loss weights: none, inverse_freq (n / (C * count)), sqrt_inverse, a list, or auto
    (inverse_freq when the largest class has more than twice the examples of the smallest)."""
    if setting in (None, "none"):
        return None
    if isinstance(setting, (list, tuple)):
        if len(setting) != num_labels:
            raise ConfigError(f"task.class_weights: {len(setting)} weights for {num_labels} labels")
        return [float(w) for w in setting]
    counts = np.bincount([e.target for e in examples], minlength=num_labels).astype(np.float64)
    if setting == "auto":
        present = counts[counts > 0]
        if present.max() <= 2 * present.min():
            return None
        setting = "inverse_freq"
    inverse = counts.sum() / (num_labels * np.maximum(counts, 1))
    return (np.sqrt(inverse) if setting == "sqrt_inverse" else inverse).tolist()


def pad_rows(examples: list[LabeledText], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` right-padded to the longest row, and the attention mask."""
    width = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, : len(e)] = torch.tensor(e.input_ids)
        mask[i, : len(e)] = 1
    return input_ids, mask


def collate(examples: list[LabeledText], pad_id: int, problem_type: str,
            weights: list[float] | None) -> dict[str, torch.Tensor]:
    """Right-padded rows to the longest, with attention mask, labels and each row's loss weight."""
    n = len(examples)
    input_ids, mask = pad_rows(examples, pad_id)
    if problem_type == "single_label":
        labels = torch.tensor([e.target for e in examples], dtype=torch.long)
        row_weight = torch.tensor([weights[cast(int, e.target)] if weights else 1.0 for e in examples])  # a class id
    else:
        labels = torch.tensor([e.target for e in examples], dtype=torch.float32)
        row_weight = torch.full((n,), float(labels.shape[1]))
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "row_weight": row_weight,
            "document_ids": torch.where(mask == 1, 0, PAD_DOCUMENT)}


class LabeledStream(BatchStream):
    """BatchStream's order and exact resume, with classification batches (one text per row, never packed)."""

    def __init__(self, examples: list[LabeledText], batch_size: int, seq_len: int, *, shuffle: bool, seed: int,
                 pad_id: int, problem_type: str, weights: list[float] | None) -> None:
        # BatchStream orders rows by their lengths alone; only its own __next__ reads Example fields, and this
        # class replaces it: the casts say so.
        super().__init__(cast(Sequence[Example], examples), batch_size, seq_len, packing=False, shuffle=shuffle,
                         seed=seed, pad_id=pad_id, pad_to="longest")
        self.problem_type, self.weights = problem_type, weights

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = [cast(LabeledText, self._next_row()[0]) for _ in range(self.batch_size)]
        return collate(rows, self.pad_id, self.problem_type, self.weights)
