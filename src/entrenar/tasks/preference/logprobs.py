"""Per-sequence log-probabilities of a preference batch's completions, and the reference model that scores them.

A batch (:mod:`entrenar.data.preference`) holds sequences (prompt + completion) packed or padded into rows, with
``labels`` on the completion tokens and ``sequence_ids`` naming each token's sequence. The summed log-probability
of a sequence's completion is gathered from the hidden states chunk by chunk
(:func:`~entrenar.kernels.token_logprobs.token_logprobs`), never from ``[tokens, vocab]`` logits, then summed per
sequence with one ``index_add``.

A batch with the ``shared_*`` keys (:func:`~entrenar.data.preference.shared_prompt_layout`) can run with each
pair's prompt computed once (``shared=True``): one padding-free row ``[prompt, chosen, rejected]`` per pair, the
rejected tokens attending the prompt's keys and their own; only the hidden states that predict a completion token
go through the output head.

A batch in the fixed layout of :mod:`entrenar.data.preference_static` (``pair_mask``: what CUDA graphs replay) is
summed without boolean indexing: its padding tokens add into one sequence past ``num_sequences``, which is dropped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.kernels.host_embedding import head_weight, plain_head, prefetch_head
from entrenar.kernels.token_logprobs import TOKEN_LOGPROBS_CHUNK, token_logprobs
from entrenar.tasks.base import Batch


def _targets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and the sequence each belongs to, flattened [N] (each row's last position: none)."""
    labels, sequences = batch["labels"], batch["sequence_ids"]
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    owners = F.pad(sequences[:, 1:], (0, 1), value=-1).reshape(-1)
    return targets, owners


def sequence_logprobs(model: Any, batch: Batch, head: nn.Module | None,
                      chunk: int = TOKEN_LOGPROBS_CHUNK, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, tokens)`` [num_sequences]: each sequence's summed fp32 completion log-probability under ``model``
    (the model or its parallel wrapper, called with ``hidden_states`` as the training step calls it) and its
    completion token count. ``head``: a plain output ``nn.Linear`` whose weight turns hidden states into
    log-probabilities chunk by chunk; None: the model's own logits (an output head that is not plain).
    ``shared``: through the batch's shared-prompt layout (its ``shared_*`` keys) instead of its rows."""
    if shared:
        return _shared_logprobs(model, batch, head, chunk)
    inputs = (batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
    layout = {"cu_seqlens": batch.get("cu_seqlens"), "max_seqlen": batch.get("max_seqlen")}  # padding-free
    targets, owners = _targets(batch)
    if head is not None:
        prefetch_head(head, batch["input_ids"].device)
        hidden = model.hidden_states(*inputs, **layout)
        token = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head_weight(head, hidden.device), targets, chunk)
    else:
        logits = model(*inputs, **layout)
        valid = targets != IGNORE_INDEX
        log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
        token = log_probs.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1) * valid
    valid = targets != IGNORE_INDEX
    n = int(batch["num_sequences"])
    if "pair_mask" in batch:  # the fixed layout (CUDA graphs): no shape that depends on the data
        index = torch.where(valid, owners, n)  # padding into one more sequence, dropped
        sums = torch.zeros(n + 1, dtype=torch.float32, device=token.device).index_add(0, index, token * valid)
        tokens = torch.zeros(n + 1, dtype=torch.float32, device=token.device).index_add(
            0, index, valid.to(torch.float32))
        return sums[:n], tokens[:n]
    index = owners[valid]
    sums = torch.zeros(n, dtype=torch.float32, device=token.device).index_add(0, index, token[valid])
    tokens = torch.zeros(n, dtype=torch.float32, device=token.device).index_add(
        0, index, torch.ones_like(token[valid]))
    return sums, tokens


def _shared_logprobs(model: Any, batch: Batch, head: nn.Module | None,
                     chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` through the shared-prompt layout."""
    inputs = (batch["shared_input_ids"][None], batch["shared_position_ids"][None], None)
    layout = {"cu_seqlens": batch["shared_cu_seqlens"], "max_seqlen": batch["shared_max_seqlen"],
              "kv_index": batch["shared_kv_index"], "cu_seqlens_k": batch["shared_cu_seqlens_k"],
              "max_seqlen_k": batch["shared_max_seqlen_k"]}
    sources, targets, owners = batch["shared_sources"], batch["shared_targets"], batch["shared_owners"]
    if head is not None:
        prefetch_head(head, sources.device)
        hidden = model.hidden_states(*inputs, **layout)[0].index_select(0, sources)
        token = token_logprobs(hidden, head_weight(head, hidden.device), targets, chunk)
    else:
        logits = model(*inputs, **layout)[0].index_select(0, sources)
        token = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    n = int(batch["num_sequences"])
    m = n + 1 if "pair_mask" in batch else n  # the fixed layout's padding is owned by one more sequence, dropped
    sums = torch.zeros(m, dtype=torch.float32, device=token.device).index_add(0, owners, token)
    tokens = torch.zeros(m, dtype=torch.float32, device=token.device).index_add(0, owners, torch.ones_like(token))
    return sums[:n], tokens[:n]



__all__ = ["plain_head", "sequence_logprobs"]
