"""Log-probabilities of target tokens from the hidden states, chunk by chunk: ``[N, V]`` logits are never held.

Preference losses need ``log p(label)`` of every completion token, summed per sequence; the full-vocabulary logits
of a batch (tokens x 128k x 4 bytes) are what makes DPO in other stacks run out of memory. Here forward forms the
logits ``chunk`` rows at a time, keeps only the picked log-probability, and saves ``hidden`` and ``weight`` (which
autograd holds anyway); backward recomputes each chunk's logits and turns the incoming gradient ``g`` into
``grad_logits = g * (onehot(label) - softmax(logits))``, then into the chunk's gradients of the hidden states and
the weight. One extra matrix product per chunk buys the memory of ``[chunk, V]`` instead of ``[N, V]``.

The specification is :func:`entrenar.models.loss.token_logprobs_reference` (``log_softmax`` + ``gather``); both
compute in fp32 whatever the model dtype. It runs the same PyTorch code on CPU and GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from entrenar.kernels._common import autocast_inputs
from entrenar.models.loss import IGNORE_INDEX

TOKEN_LOGPROBS_CHUNK = 1024  # rows per chunk: a 128k vocabulary's fp32 logits chunk is then 0.5 GiB


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (h @ weight.T).float()


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk: int) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, 0)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], weight)
            picked = logits.gather(1, safe[rows].unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
            out[rows] = picked * valid[rows]
        ctx.save_for_backward(hidden, weight, safe, valid)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, safe, valid = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        g = grad_out.float() * valid
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows]
            grad_logits = torch.softmax(_chunk_logits(h, weight), dim=-1)  # -softmax, then + onehot, times g
            grad_logits.neg_().scatter_add_(1, safe[rows].unsqueeze(1),
                                            torch.ones_like(safe[rows], dtype=torch.float32).unsqueeze(1))
            grad_logits.mul_(g[rows].unsqueeze(1))
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


@torch.compiler.disable  # a Python loop over chunks: runs eagerly inside a compiled step
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   chunk: int = TOKEN_LOGPROBS_CHUNK) -> torch.Tensor:
    """fp32 ``log p(labels[i] | hidden[i])`` [N] under the output head ``weight`` [V, H] (0 where ``labels`` is
    -100); ``hidden`` [N, H], ``labels`` [N] next-token targets already shifted. Differentiable in ``hidden`` and
    ``weight``; at most ``[chunk, V]`` logits exist at a time, in forward and in backward."""
    if hidden.ndim != 2 or weight.ndim != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"token_logprobs needs hidden [N, H], weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    (hidden, weight), autocast_off = autocast_inputs(hidden, weight)
    with autocast_off:
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        out = _TokenLogprobs.apply(hidden, weight, labels, chunk)
    return out


__all__ = ["TOKEN_LOGPROBS_CHUNK", "token_logprobs"]
