"""The reference model of a preference run: what ``task.reference`` becomes, and the reference's log-probabilities.

:func:`reference_of` resolves ``auto``: the same model with its adapters switched off under LoRA/QLoRA
(:mod:`entrenar.adapters.switch`, no second copy), a frozen copy of the starting weights under full fine-tuning
or when ``model.path`` brings the adapter that trains on (an SFT adapter: the policy starts from it),
none for a reference-free loss (SimPO, ORPO). ``precomputed`` scores every example once with the starting weights
into a table kept in the run folder (:mod:`.precomputed`). :class:`Reference` holds what each needs and gives a
batch's reference log-probabilities, without gradients.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entrenar.adapters.switch import adapters_off
from entrenar.config import Recipe
from entrenar.data.preference import preference_eval_batches
from entrenar.errors import CheckpointError
from entrenar.evaluation.loss import autocast_for
from entrenar.loading.runs import brings_adapter
from entrenar.models.transformer import compute_device
from entrenar.tasks.base import Batch
from entrenar.tasks.preference import losses as L
from entrenar.tasks.preference.logprobs import plain_head, sequence_logprobs
from entrenar.tasks.preference.precomputed import (
    REFERENCE_FILE,
    examples_fingerprint,
    read_table,
    weights_fingerprint,
    write_table,
)
from entrenar.tasks.preference.sharing import may_share


def reference_of(recipe: Recipe) -> tuple[str, str]:
    """``(reference, why)``: what ``task.reference`` becomes for this recipe (none for a reference-free loss)."""
    task = recipe.task
    if task.loss in L.REFERENCE_FREE:
        return "none", f"task.loss {task.loss} is reference-free"
    if task.reference != "auto":
        return task.reference, f"task.reference: {task.reference}"
    if recipe.lora is not None and brings_adapter(recipe.model.path):
        return "copy", ("the adapter model.path brings is the policy training starts from: a frozen copy of the "
                        "model as loaded, base and adapter (adapters off would be the bare base; task.reference: "
                        "precomputed scores it once instead, without the copy)")
    if recipe.lora is not None:
        return "adapters_off", "LoRA: the base is the model with its adapters switched off (no second copy)"
    return "copy", "full fine-tuning: a frozen copy of the starting weights (the model's memory once more)"


def graphs_refusal(recipe: Recipe) -> str | None:
    """Why a CUDA graph cannot replay this recipe's preference steps in their fixed layout (None: it can)."""
    if reference_of(recipe)[0] == "precomputed":
        return ("task.reference precomputed looks each pair's row up on the host, which a graph cannot replay; use "
                "task.reference: auto (LoRA: adapters off) or copy")
    return None


class Reference:
    """The reference model of a run, as :func:`reference_of` resolves ``task.reference``, once :meth:`prepare`
    gave it the model."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.kind, _ = reference_of(recipe)  # resolved once: it reads model.path, and each step asks
        self.model: nn.Module | None = None  # the policy: adapters off, or the table's starting weights
        self.copy: nn.Module | None = None  # a frozen copy (task.reference: copy), or a reference model given
        # task.reference precomputed: every example read, the starting weights' fingerprint, the table and its rows
        self.examples: list = []
        self.start: str | None = None
        self._head: nn.Linear | None = None
        self._table: torch.Tensor | None = None
        self._rows: dict[int, int] = {}

    def prepare(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        """Take the model (after adapters): a frozen copy of it, or its starting weights' fingerprint, as the
        reference needs; ``reference``: a separate reference model to use instead (``entrenar eval``)."""
        self.model, self._head = model, plain_head(model)
        if reference is not None:
            self.copy = reference
        elif self.kind == "copy":
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()
        elif self.kind == "precomputed":  # the starting weights, before a resume loads a checkpoint's
            self.start = weights_fingerprint(model)

    @contextlib.contextmanager
    def _as_model(self) -> Iterator[Any]:
        """The reference model to call, without gradients."""
        assert self.model is not None  # prepare() ran
        with torch.no_grad():
            if self.kind == "adapters_off":
                with adapters_off(self.model):
                    yield self.model
            else:
                yield self.copy

    def logprobs(self, batch: Batch, examples: list,
                 shared: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The reference's (sums, tokens) of the batch's sequences (None: a reference-free loss); ``examples``: the
        list its example_index points into; ``shared``: through the shared-prompt layout, as the model's."""
        if self.recipe.task.loss in L.REFERENCE_FREE:
            return None
        if self.kind == "precomputed":
            table = self.precomputed()
            rows = [self._rows[id(examples[i])] for i in batch["example_index"].tolist()]
            return table[rows].to(batch["input_ids"].device).reshape(-1), torch.empty(0)
        with self._as_model() as reference:
            return sequence_logprobs(reference, batch, plain_head(reference), shared=shared)

    def precomputed(self) -> torch.Tensor:
        """The reference table of every example read: from the run folder when its fingerprints match, else
        computed now with the starting weights (refused when the model has left them: a resumed run), each prompt
        once unless ``task.share_prompt`` is false."""
        if self._table is not None:
            return self._table
        assert self.model is not None and self.start is not None  # prepare() ran
        path = Path(self.recipe.output.dir).absolute() / REFERENCE_FILE
        data = examples_fingerprint(self.examples)
        table = read_table(path, data, self.start)
        if table is None:
            if weights_fingerprint(self.model) != self.start:
                raise CheckpointError(f"{path}: the reference log-probabilities of this run are missing or were "
                                      "computed for other data or weights, and the model has left its starting "
                                      "weights (a resumed run); start the run again, or use task.reference: copy")
            table = self._compute_table(may_share(self.recipe, self.model))
            write_table(path, table, data, self.start)
        self._table = table.to(compute_device(self.model))
        self._rows = {id(e): i for i, e in enumerate(self.examples)}
        return self._table

    @torch.no_grad()
    def _compute_table(self, shared: bool = False) -> torch.Tensor:
        """[examples read, 2]: each pair's summed (chosen, rejected) log-probabilities under the model now
        (``shared``: each prompt computed once)."""
        assert self.model is not None
        d, t = self.recipe.data, self.recipe.training
        model, device = self.model, compute_device(self.model)
        table = torch.zeros(len(self.examples), 2, dtype=torch.float32)
        was_training = model.training
        model.eval()
        try:
            for batch in preference_eval_batches(self.examples, t.batch_size, d.seq_len, packing=d.packing,
                                                 share_prompt=shared):
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                with autocast_for(device, t.precision):
                    sums, _ = sequence_logprobs(model, batch, self._head, shared=shared)
                table[batch["example_index"].cpu()] = sums.reshape(-1, 2).float().cpu()
        finally:
            model.train(was_training)
        return table


__all__ = ["Reference", "graphs_refusal", "reference_of"]
