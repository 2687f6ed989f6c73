"""Per-sequence log-probabilities of a preference batch's completions, and the reference model that scores them.

A batch (:mod:`entrenar.data.preference`) holds sequences (prompt + completion) packed or padded into rows, with
``labels`` on the completion tokens and ``sequence_ids`` naming each token's sequence. The summed log-probability
of a sequence's completion is gathered from the hidden states chunk by chunk
(:func:`~entrenar.kernels.token_logprobs.token_logprobs`), never from ``[tokens, vocab]`` logits, then summed per
sequence with one ``index_add``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.kernels.token_logprobs import TOKEN_LOGPROBS_CHUNK, token_logprobs
from entrenar.tasks.base import Batch


def _targets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and the sequence each belongs to, flattened [N] (each row's last position: none)."""
    labels, sequences = batch["labels"], batch["sequence_ids"]
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    owners = F.pad(sequences[:, 1:], (0, 1), value=-1).reshape(-1)
    return targets, owners


def sequence_logprobs(model: Any, batch: Batch, head: nn.Module | None,
                      chunk: int = TOKEN_LOGPROBS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, tokens)`` [num_sequences]: each sequence's summed fp32 completion log-probability under ``model``
    (the model or its parallel wrapper, called with ``hidden_states`` as the training step calls it) and its
    completion token count. ``head``: a plain output ``nn.Linear`` whose weight turns hidden states into
    log-probabilities chunk by chunk; None: the model's own logits (an output head that is not plain)."""
    inputs = (batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
    layout = {"cu_seqlens": batch.get("cu_seqlens"), "max_seqlen": batch.get("max_seqlen")}  # padding-free
    targets, owners = _targets(batch)
    if head is not None:
        hidden = model.hidden_states(*inputs, **layout)
        token = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets, chunk)
    else:
        logits = model(*inputs, **layout)
        valid = targets != IGNORE_INDEX
        log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
        token = log_probs.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1) * valid
    valid = targets != IGNORE_INDEX
    n = int(batch["num_sequences"])
    index = owners[valid]
    sums = torch.zeros(n, dtype=torch.float32, device=token.device).index_add(0, index, token[valid])
    tokens = torch.zeros(n, dtype=torch.float32, device=token.device).index_add(
        0, index, torch.ones_like(token[valid]))
    return sums, tokens


__all__ = ["sequence_logprobs"]
