"""Per-token log-probabilities of sampled completions, chunk by chunk from the hidden states.

A generation batch is ``[B, P + T]``: left-padded prompts then right-padded completions, ``attention_mask`` 1 on
real tokens. Positions count real tokens only and padding is masked out of attention (a pad is its own document),
so a row's log-probabilities do not depend on how much padding its batch needed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.kernels.host_embedding import head_weight, plain_head, prefetch_head
from entrenar.kernels.token_logprobs import TOKEN_LOGPROBS_CHUNK, token_logprobs


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, L] counting real tokens from 0 (padding: 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        head: nn.Linear | None = None, chunk: int = TOKEN_LOGPROBS_CHUNK,
                        temperature: float = 1.0) -> torch.Tensor:
    """fp32 ``log p(token)`` [B, completion_len] of the last ``completion_len`` tokens of each row of
    ``input_ids`` [B, L] under ``model`` with its logits divided by ``temperature`` (the sampling distribution, as
    TRL scores it), 0 on padding. ``head``: see :func:`plain_head`."""
    padded = not bool(attention_mask.all())
    positions = positions_of(attention_mask)
    documents = attention_mask.long() if padded else None
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)[:, -completion_len:]
    if head is not None:
        prefetch_head(head, input_ids.device)
        hidden = model.hidden_states(input_ids, positions, documents)[:, -completion_len - 1:-1]
        if temperature != 1.0:
            hidden = hidden / temperature  # (h / t) @ W.T = logits / t
        flat = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head_weight(head, hidden.device),
                              targets.reshape(-1), chunk)
        return flat.view(targets.shape)
    logits = model(input_ids, positions, documents)[:, -completion_len - 1:-1].float() / temperature
    valid = targets != IGNORE_INDEX
    picked = torch.log_softmax(logits, -1).gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return picked * valid


__all__ = ["completion_logprobs", "plain_head", "positions_of"]
