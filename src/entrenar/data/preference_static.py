"""Preference micro-batches in one fixed layout, so a CUDA graph captured on one replays every other.

A preference batch (:func:`~entrenar.data.preference.collate_preference`) changes shape with its pairs: the tokens of
its padding-free row, its documents, the keys the shared-prompt layout gathers, the completion tokens it scores. A
CUDA graph replays the launches of one micro-step with the shapes and the host numbers (kernel grids, segment
counts) it was captured with, so :func:`static_preference_batch` pads every batch to capacities that hold any
``batch_size`` units of the data set (:func:`static_capacity`: the sums of the largest units, so nothing is cut):

* the row: the real tokens, then at least one padding token, which form one last segment of their own (id 0,
  position 0, label -100, sequence -1); missing pairs are empty segments before it; ``max_seqlen`` (and
  ``max_seqlen_k``) is the row length, as packed rows under graphs have it;
* the shared-prompt keys (``shared_kv_index``): the real ones, then the padding segment's, which are the last token
  repeated, then the padding tokens themselves (bottom-right aligned, every padding query sees at least one key);
* the scored completion tokens (``shared_sources``/``shared_targets``/``shared_owners``): padded with the last
  token's hidden state, target 0 and owner ``num_sequences``, one sequence past the real ones whose sum is dropped;
* ``num_sequences`` = 2 x capacity (pairs, or KTO examples with their mismatched KL sequences), ``pair_mask``
  [capacity] 1 for a real unit and 0 for a missing one, which weighs its loss and metrics by zero; KTO's
  ``desirable`` padded with False and ``kl_offset`` = capacity.

Every index points at a real position of the padded tensors and every padded value stays finite, so the padded
positions change nothing of the real ones (:mod:`entrenar.tasks.preference.logprobs` masks them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from entrenar.data.batching import PAD_DOCUMENT, padding_free
from entrenar.data.preference import PreferenceBatch, PreferenceExample, PreferencePair
from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.errors import ConfigError


@dataclass(frozen=True)
class StaticCapacity:
    """What every padded micro-batch holds: ``units`` pairs (or KTO examples), ``tokens`` in the padding-free row of
    the unshared sequences, and in the shared-prompt layout ``shared_tokens`` tokens, ``shared_keys`` gathered keys
    and ``shared_targets`` scored completion tokens."""

    units: int
    tokens: int
    shared_tokens: int
    shared_keys: int
    shared_targets: int


def _largest(values: Sequence[int], k: int) -> int:
    return sum(sorted(values, reverse=True)[:k])


def _rounded(tokens: int, multiple: int = 8) -> int:
    """Up to a multiple of 8: the row's products keep shapes the GPU's matrix units take whole."""
    return -(-tokens // multiple) * multiple


def static_capacity(examples: Sequence[PreferenceExample], batch_size: int, seq_len: int,
                    kl: bool = False) -> StaticCapacity:
    """Capacities that any ``batch_size`` of ``examples`` fit in (the sum of the ``batch_size`` largest of each
    count), plus at least one padding token (to a multiple of 8), so the padding segment is never empty."""
    if batch_size < 1 or not examples:
        raise ConfigError(f"static preference layout: needs batch_size >= 1 and examples, got {batch_size} and "
                          f"{len(examples)}")
    most_completion = max(len(c) for e in examples for c in e.sequences())
    unshared, shared, prompts, targets = [], [], [], []
    for e in examples:
        p = len(e.prompt)
        tokens = sum(p + len(c) for c in e.sequences())
        if kl:  # the mismatched sequence: this prompt with another example's completion, cut to seq_len
            tokens += min(seq_len, p + most_completion)
        unshared.append(tokens)
        if isinstance(e, PreferencePair):
            shared.append(p + len(e.chosen) + len(e.rejected))
            prompts.append(p)
            targets.append(len(e.chosen) + len(e.rejected))
    shared_tokens = _rounded(_largest(shared, batch_size) + 1)
    return StaticCapacity(units=batch_size, tokens=_rounded(_largest(unshared, batch_size) + 1),
                          shared_tokens=shared_tokens,
                          shared_keys=shared_tokens + _largest(prompts, batch_size),
                          shared_targets=_largest(targets, batch_size))


def _pad(values: torch.Tensor, size: int, fill: float | int, what: str) -> torch.Tensor:
    """``values`` [n] (or [1, n]) padded at the end to ``size`` with ``fill``."""
    n = values.shape[-1]
    if n > size:
        raise ConfigError(f"static preference layout: {what} has {n} entries, more than its capacity {size} (a batch "
                          "of examples the capacity was not computed from)")
    return F.pad(values, (0, size - n), value=fill)


def _segments(cu: torch.Tensor, empty: int, end: int) -> torch.Tensor:
    """``cu_seqlens`` [D + 1] with ``empty`` empty segments after its last, then one to ``end`` (the padding)."""
    last = int(cu[-1])
    return torch.cat([cu.to(torch.int32), torch.full((empty,), last, dtype=torch.int32),
                      torch.tensor([end], dtype=torch.int32)])


def static_preference_batch(batch: PreferenceBatch, capacity: StaticCapacity, shared: bool) -> PreferenceBatch:
    """``batch`` (as :func:`~entrenar.data.preference.collate_preference` makes it, its rows not yet laid out) in the
    fixed layout of ``capacity``: through the shared-prompt keys (``shared``) or as one padding-free row of its
    sequences. The host-side counts (``example_index``, ``shared_tokens``, ``shared_counted_tokens``) are left out:
    they vary from batch to batch, and the step does not read them."""
    units = len(batch["example_index"])
    cap = capacity.units
    if units > cap:
        raise ConfigError(f"static preference layout: a micro-batch of {units} units, more than its capacity {cap}")
    mask = torch.zeros(cap, dtype=torch.float32)
    mask[:units] = 1.0
    out: PreferenceBatch = {"pair_mask": mask, "num_sequences": 2 * cap, "static_shared": shared}
    if "desirable" in batch:
        out["desirable"] = _pad(batch["desirable"].bool(), cap, False, "desirable")
    kl = "kl_offset" in batch
    if kl:
        out["kl_offset"] = cap
    if shared:
        if "shared_input_ids" not in batch:
            raise ConfigError("static preference layout: shared=True needs a batch with the shared_* keys "
                              "(collate_preference(share_prompt=True))")
        tokens, keys = capacity.shared_tokens, capacity.shared_keys
        n = len(batch["shared_input_ids"])
        pad_q = tokens - n
        if pad_q < 1:
            raise ConfigError(f"static preference layout: the shared row has {n} tokens, its capacity {tokens} "
                              "leaves no padding token")
        kv = batch["shared_kv_index"]
        extra = keys - len(kv) - pad_q  # padding keys beyond the padding tokens' own
        if extra < 0:
            raise ConfigError(f"static preference layout: {len(kv)} keys do not fit the key capacity {keys}")
        empty = 2 * (cap - units)
        out.update({
            "shared_input_ids": _pad(batch["shared_input_ids"], tokens, 0, "shared_input_ids"),
            "shared_position_ids": _pad(batch["shared_position_ids"], tokens, 0, "shared_position_ids"),
            "shared_cu_seqlens": _segments(batch["shared_cu_seqlens"], empty, tokens),
            "shared_max_seqlen": tokens,
            "shared_kv_index": torch.cat([kv, torch.full((extra,), tokens - 1, dtype=kv.dtype),
                                          torch.arange(n, tokens, dtype=kv.dtype)]),
            "shared_cu_seqlens_k": _segments(batch["shared_cu_seqlens_k"], empty, keys),
            "shared_max_seqlen_k": keys,
            "shared_sources": _pad(batch["shared_sources"], capacity.shared_targets, tokens - 1, "shared_sources"),
            "shared_targets": _pad(batch["shared_targets"], capacity.shared_targets, 0, "shared_targets"),
            "shared_owners": _pad(batch["shared_owners"], capacity.shared_targets, 2 * cap, "shared_owners"),
        })
        return out
    flat = cast(dict[str, torch.Tensor], {k: v for k, v in padding_free(
        {k: batch[k] for k in ("input_ids", "labels", "position_ids", "document_ids", "sequence_ids")}).items()
        if k != "max_seqlen"})
    sequence_ids = flat["sequence_ids"]
    if kl:  # the KL sequences follow the capacity's examples, not this batch's
        sequence_ids = torch.where(sequence_ids >= units, sequence_ids + (cap - units), sequence_ids)
    tokens = capacity.tokens
    if sequence_ids.shape[-1] >= tokens:
        raise ConfigError(f"static preference layout: {sequence_ids.shape[-1]} tokens leave no padding token in "
                          f"the capacity {tokens}")
    sequences = int(batch["num_sequences"])
    out.update({
        "input_ids": _pad(flat["input_ids"], tokens, 0, "input_ids"),
        "labels": _pad(flat["labels"], tokens, IGNORE_INDEX, "labels"),
        "position_ids": _pad(flat["position_ids"], tokens, 0, "position_ids"),
        "sequence_ids": _pad(sequence_ids, tokens, PAD_DOCUMENT, "sequence_ids"),
        "cu_seqlens": _segments(flat["cu_seqlens"], 2 * cap - sequences, tokens),
        "max_seqlen": tokens,
    })
    return out


def is_static(batch: PreferenceBatch) -> bool:
    """Whether a batch is in the fixed layout of :func:`static_preference_batch`."""
    return "pair_mask" in batch


__all__ = ["StaticCapacity", "is_static", "static_capacity", "static_preference_batch"]
