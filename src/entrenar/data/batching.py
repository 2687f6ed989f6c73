"""Batches of examples as tensors: packed or padded, in a deterministic, resumable stream.

Every batch is a dict of LongTensors ``[B, T]``:

- ``input_ids``: tokens (``pad_id`` on padding),
- ``labels``: aligned with ``input_ids``, -100 where no loss is taken. The loss
  at position t predicts ``labels[t+1]`` from tokens up to t, so each
  example's first label is set to -100: in a packed row that is the label that
  would be predicted from the end of the previous example, and the loss never
  crosses from one example into the next,
- ``position_ids``: 0, 1, 2, ... restarting at 0 for each example,
- ``document_ids``: 0, 1, 2, ... one per example within a row, -1 on padding;
  the model attends only within equal ids.

Packing keeps examples whole (none loses its beginning). A shuffled stream
fills rows best-fit: it takes the next :data:`PACK_WINDOW` examples of the
epoch's order, places each in turn in the row it leaves the least room in (not
longest first: rows of like lengths are rows of like examples, and a quickstart
trained worse on them), and emits those rows in a seeded order (rows of 512-2048
tokens of web text: 98.4-98.7% real tokens, where filling rows in stream order
left 13-18% padding).
An unshuffled stream keeps the data's order and fills rows in it (next-fit): an
example that does not fit in what is left of a row starts the next one. A row
holds at most as many examples as the data set has, so a ``seq_len`` longer
than all the data together leaves the rest of the row padding instead of
repeating examples in it. Padding puts one example per row.

:func:`padding_free` lays any such batch out as one row ``[1, N]`` of its real
tokens only, documents end to end, with ``cu_seqlens`` marking where each
starts (the model then attends within documents without a mask and computes no
padding).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from entrenar.data.tokenize import IGNORE_INDEX, Example
from entrenar.errors import CheckpointError, ConfigError, DataError

PAD_DOCUMENT = -1
Batch = dict[str, torch.Tensor]
ExampleT = TypeVar("ExampleT")
CONTEXT_FACTOR = 8  # seq_len may exceed the model's context this many times (context extension), no more


def check_seq_len(seq_len: int, context: int, model: str = "the model", key: str = "data.seq_len") -> list[str]:
    """Notes on ``seq_len`` against the model's context (``max_position_embeddings``): one note above it,
    a ``ConfigError`` above ``CONTEXT_FACTOR`` times it (a row that long is memory spent on nothing the model
    was made for, and packing short examples into it repeats them many times over). ``key``: what the user
    set (``--seq-len`` on the command line)."""
    if seq_len > CONTEXT_FACTOR * context:
        raise ConfigError(f"'{key}' is {seq_len:,}, more than {CONTEXT_FACTOR}x the context of {model} "
                          f"({context:,} tokens, max_position_embeddings); use at most {CONTEXT_FACTOR * context:,}")
    if seq_len > context:
        return [f"{key}={seq_len:,} is beyond the context of {model} ({context:,} tokens, "
                "max_position_embeddings): positions past it are extrapolated"]
    return []


def num_target_tokens(batch: Batch) -> int:
    """Tokens that carry loss: labels other than -100 after the shift (the first column is never a target)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def collate(rows: Sequence[Sequence[Example]], seq_len: int, pad_id: int = 0) -> Batch:
    """Lay out rows of examples (each row's total length <= ``seq_len``) as a ``[len(rows), seq_len]`` batch."""
    shape = (len(rows), seq_len)
    batch = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
        "document_ids": torch.full(shape, PAD_DOCUMENT, dtype=torch.long),
    }
    for r, row in enumerate(rows):
        start = 0
        for doc, example in enumerate(row):
            n = len(example)
            end = start + n
            if end > seq_len:
                where = example.origin or f"row {r} example {doc}"
                raise DataError(f"{where}: {n} tokens do not fit in seq_len={seq_len} (truncate first)")
            batch["input_ids"][r, start:end] = torch.tensor(example.input_ids, dtype=torch.long)
            batch["labels"][r, start:end] = torch.tensor(example.labels, dtype=torch.long)
            batch["labels"][r, start] = IGNORE_INDEX  # never predicted from the previous example
            batch["position_ids"][r, start:end] = torch.arange(n)
            batch["document_ids"][r, start:end] = doc
            start = end
    return batch


def padding_free(batch: Batch) -> dict[str, torch.Tensor | int]:
    """The batch as one row ``[1, N]`` of its N real tokens, each document whole and in order.

    Adds ``cu_seqlens`` (int32 ``[D + 1]``: document i spans ``cu_seqlens[i]:cu_seqlens[i + 1]``) and
    ``max_seqlen`` (the longest document, a Python int: attention kernels size their grid by it, and reading it
    from a GPU tensor would stall the step), and drops ``document_ids``; every other ``[R, T]`` tensor is laid out
    as the tokens are, and any other key is kept as it is. Labels keep their
    -100 at each document's first token, so no loss crosses from one document into the next.
    """
    documents = batch["document_ids"]
    keep = documents >= 0
    # A document starts wherever its id differs from the token before it in the same row.
    starts = keep.clone()
    starts[:, 1:] &= documents[:, 1:] != documents[:, :-1]
    cu_seqlens = torch.nonzero(starts[keep]).flatten()
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([int(keep.sum())])]).to(torch.int32)
    # Any other per-token tensor (a preference batch's sequence_ids) is laid out alike; other keys pass as they are.
    out = {key: value[keep][None] if isinstance(value, torch.Tensor) and value.shape == documents.shape else value
           for key, value in batch.items() if key != "document_ids"}
    return {**out, "cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}


def packed_documents(batch: Batch, capacity: int | None = None) -> dict[str, torch.Tensor | int]:
    """The batch with ``cu_seqlens`` and ``max_seqlen`` over its rows laid end to end, shape kept ``[B, T]``.

    The model then attends within each document through a variable-length kernel (FlashAttention's on CUDA)
    instead of a dense ``[B, 1, T, T]`` document mask, which keeps SDPA off its flash kernel. Every token is a
    member of one segment: a document, or a run of padding (its output is never used: its labels are -100).
    ``document_ids`` stays for what reads it (router statistics, token counts). Computed on the host, before
    the batch moves, so the step reads nothing back from the device.

    ``capacity`` (for CUDA graphs, which replay fixed shapes) pads ``cu_seqlens`` to ``capacity + 1`` entries
    with empty segments and sets ``max_seqlen`` to the row length; a batch with more segments than that keeps
    its own layout (and runs eagerly).
    """
    rows, t = batch["document_ids"].shape
    cu_seqlens = torch.nonzero(_segment_starts(batch["document_ids"]).flatten()).flatten()
    segments = len(cu_seqlens)
    if capacity is not None and segments <= capacity:
        end = cu_seqlens.new_full((capacity + 1 - segments,), rows * t)
        return {**batch, "cu_seqlens": torch.cat([cu_seqlens, end]).to(torch.int32), "max_seqlen": t}
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([rows * t])]).to(torch.int32)
    return {**batch, "cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}


def _segment_starts(documents: torch.Tensor) -> torch.Tensor:
    """Where :func:`packed_documents`' segments start: each row's first token and every change of document id
    (padding runs included)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def segment_capacity(stream: BatchStream, batches: int = 32, margin: float = 1.25) -> int:
    """How many segments :func:`packed_documents` should make room for under CUDA graphs: the most in the
    stream's next ``batches`` batches, with a margin, to a multiple of 16 (the stream is left where it was)."""
    state = stream.state_dict()
    most = 1
    for _ in range(batches):
        most = max(most, int(_segment_starts(next(stream)["document_ids"]).sum()))
    stream.load_state_dict(state)
    return -(-int(most * margin) // 16) * 16


PACK_WINDOW = 512  # examples a shuffled stream packs best-fit at a time


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of item positions, each item placed in turn (in the given order) in the row it leaves the least room
    in; rows in the order they were opened. Items are at most ``capacity`` long."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row index), sorted
    for index, n in enumerate(lengths):  # in the given order: sorting by length would give rows of like examples
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):  # the fullest row it still fits in
            left, r = room.pop(at)
        else:
            left, r = capacity, len(rows)
            rows.append([])
        rows[r].append(index)
        if left - n > 0:
            bisect.insort(room, (left - n, r))
    return rows


def epoch_order(count: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order epoch ``epoch`` visits ``count`` examples in: as stored, or a permutation drawn from the seed
    sequence (seed, epoch), not seed + epoch: runs with neighbouring seeds must not share epochs."""
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng([seed, epoch]).permutation(count)


class EpochCursor:
    """Where a stream is in its epoch-by-epoch visit of ``count`` examples (:func:`epoch_order`): ``take(n)``
    gives the next ``n`` indices, crossing into the next epoch's order; ``(epoch, position)`` is its whole state."""

    def __init__(self, count: int, shuffle: bool, seed: int) -> None:
        self.count, self.shuffle, self.seed = count, shuffle, seed
        self.seek(0, 0)

    def seek(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position
        self.order = epoch_order(self.count, self.shuffle, self.seed, epoch)

    def take(self, n: int) -> list[int]:
        taken = []
        for _ in range(n):
            taken.append(int(self.order[self.position]))
            self.position += 1
            if self.position == self.count:
                self.seek(self.epoch + 1, 0)
        return taken


class BatchStream:
    """An endless, deterministic stream of batches over ``examples``, epoch after epoch.

    Each epoch visits every example once, in an order drawn from a generator
    seeded by ``(seed, epoch)`` when ``shuffle`` is set. The stream is a pure
    function of ``(seed, epoch, position)``, where ``position`` is the index in
    the epoch's order of the next example not yet emitted; ``state_dict()``
    returns these and ``load_state_dict()`` restores them, so a resumed stream
    continues with exactly the batch an uninterrupted one would give.

    A batch may span an epoch boundary (its rows continue into the next epoch's
    order), so every batch has ``batch_size`` rows. With ``packing=False`` each
    row is one example padded to ``seq_len``, or to the batch's longest example
    with ``pad_to="longest"``.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        seq_len: int,
        *,
        packing: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        pad_id: int = 0,
        pad_to: str = "seq_len",
    ) -> None:
        if not examples:
            raise DataError("no examples to batch")
        if batch_size < 1 or seq_len < 2:
            raise ConfigError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        if pad_to not in ("seq_len", "longest"):
            raise ConfigError(f"pad_to {pad_to!r} must be 'seq_len' or 'longest'")
        for index, example in enumerate(examples):
            if not 0 < len(example) <= seq_len:
                where = example.origin or f"example {index}"
                raise DataError(f"{where}: {len(example)} tokens; examples must have 1..seq_len={seq_len}")
        self.examples = examples
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.packing = packing
        self.shuffle = shuffle
        self.seed = seed
        self.pad_id = pad_id
        self.pad_to = pad_to
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)
        # Best-fit rows of the window of examples starting at `position`, and how many of them were emitted.
        # A state saved before best-fit packing existed resumes filling rows in stream order, as it was made.
        self.packer = "best_fit" if packing and shuffle else "next_fit"
        self.row = 0
        self._rows: list[list[int]] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self.examples), self.shuffle, self.seed, epoch)

    def _peek(self) -> Example:
        return self.examples[int(self._order[self.position])]

    def _advance(self) -> None:
        self.position += 1
        if self.position == len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)

    def _window_rows(self) -> list[list[int]]:
        """The best-fit rows (example indices) of the window starting at ``position`` in this epoch's order."""
        window = [int(i) for i in self._order[self.position:self.position + PACK_WINDOW]]
        rows = [[window[i] for i in row] for row in best_fit([len(self.examples[i]) for i in window], self.seq_len)]
        order = np.random.default_rng([self.seed, self.epoch, self.position]).permutation(len(rows))
        return [rows[int(i)] for i in order]

    def _next_row(self) -> list[Example]:
        if self.packer == "best_fit":
            if self._rows is None:
                self._rows = self._window_rows()
            row = [self.examples[i] for i in self._rows[self.row]]
            self.row += 1
            if self.row == len(self._rows):  # the window is spent: the next one (or the next epoch's first)
                self.position, self.row, self._rows = self.position + PACK_WINDOW, 0, None
                if self.position >= len(self.examples):
                    self.epoch, self.position = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
            return row
        row = [self._peek()]
        self._advance()
        if self.packing:
            used = len(row[0])
            # Each example at most once a row: the bound when seq_len holds more than the whole data set.
            while len(row) < len(self.examples) and used + len(self._peek()) <= self.seq_len:
                row.append(self._peek())
                used += len(row[-1])
                self._advance()
        return row

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = [self._next_row() for _ in range(self.batch_size)]
        width = self.seq_len
        if not self.packing and self.pad_to == "longest":
            width = max(len(row[0]) for row in rows)
        return collate(rows, width, self.pad_id)

    def rows_per_epoch(self) -> int:
        """Rows one pass over the examples makes (each example once): packed as this stream packs its first
        epoch, or one example a row unpacked. What ``training.epochs`` counts in."""
        if not self.packing:
            return len(self.examples)
        fresh = BatchStream(self.examples, 1, self.seq_len, packing=True, shuffle=self.shuffle, seed=self.seed)
        rows = 0
        while fresh.epoch == 0:
            fresh._next_row()
            rows += 1
        return rows

    def skip(self, batches: int) -> None:
        """Move past ``batches`` batches without building them (another rank's share of a step)."""
        for _ in range(batches * self.batch_size):
            self._next_row()

    def state_dict(self) -> dict[str, int | str]:
        """Where the stream is, as JSON-able ints (with the dataset size and seed, checked on load; the packer)."""
        state: dict[str, int | str] = {"epoch": self.epoch, "position": self.position,
                                       "num_examples": len(self.examples), "seed": self.seed}
        if self.packer == "best_fit":
            state.update(packer="best_fit", row=self.row)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (as a checkpoint's JSON holds it); refuses a state taken over different data or
        another seed."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"data stream state {state!r} lacks integer 'epoch' and 'position'") from e
        check_stream_state(state, {"num_examples": len(self.examples), "seed": self.seed}, epoch, position)
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
        self._rows, self.row = None, 0
        if self.packing and self.shuffle:  # a state saved before best-fit packing resumes as it was packed
            self.packer = state.get("packer", "next_fit")
            if self.packer == "best_fit":
                row = state.get("row")
                self._rows = self._window_rows()  # what the next row is read from
                if not isinstance(row, int) or not 0 <= row < len(self._rows):
                    raise CheckpointError(f"data stream state row={row!r} is out of range for the window of "
                                          f"examples at position {position}")
                self.row = row


def split_validation(
    examples: Sequence[ExampleT], fraction: float, seed: int = 0
) -> tuple[list[ExampleT], list[ExampleT]]:
    """Split off a random ``fraction`` of examples (at least one when > 0) for validation: ``(train, validation)``.
    Any kind of example: language-model examples, preference pairs, unpaired examples."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return list(examples), []
    n_val = max(1, round(fraction * len(examples)))
    if n_val >= len(examples):
        raise DataError(f"cannot hold out {fraction:.0%} of {len(examples)} examples for validation "
                        "and keep any for training")
    order = np.random.default_rng(seed).permutation(len(examples))
    held_out = set(order[:n_val].tolist())
    train = [e for i, e in enumerate(examples) if i not in held_out]
    validation = [examples[i] for i in sorted(held_out)]
    return train, validation


def eval_batches(
    examples: Sequence[Example],
    batch_size: int,
    seq_len: int,
    *,
    packing: bool = True,
    pad_id: int = 0,
) -> Iterator[Batch]:
    """One pass over ``examples`` in order (for validation), rows filled as ``BatchStream`` fills them;
    the last batch may have fewer rows."""
    rows: list[list[Example]] = []
    row: list[Example] = []
    used = 0
    for example in examples:
        if row and (not packing or used + len(example) > seq_len):
            rows.append(row)
            row, used = [], 0
            if len(rows) == batch_size:
                yield collate(rows, seq_len, pad_id)
                rows = []
        row.append(example)
        used += len(example)
    if row:
        rows.append(row)
    if rows:
        yield collate(rows, seq_len, pad_id)


def check_stream_state(state: Mapping[str, Any], run: Mapping[str, Any], epoch: int, position: int,
                       unit: str = "examples") -> None:
    """Refuse a data stream's saved ``state`` (a checkpoint's) that this run cannot resume to the same batches:
    one whose value of a key of ``run`` (dataset size, seed, kind of stream) differs from this run's, or whose
    ``epoch`` and ``position`` fall outside ``run["num_examples"]`` ``unit``."""
    for key, mine in run.items():
        if state.get(key, mine) != mine:
            raise CheckpointError(f"data stream state has {key}={state[key]} but this run has {key}={mine}; "
                                  "resuming would not give the same batches")
    size = run["num_examples"]
    if epoch < 0 or not 0 <= position < size:
        raise CheckpointError(f"data stream state epoch={epoch} position={position} is out of range "
                              f"for {size} {unit}")
