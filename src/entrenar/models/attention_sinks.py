"""Attention with sinks (gpt-oss): a learned logit per head that every query's softmax counts in its denominator.

``softmax([q k^T / sqrt(d), sink])`` with the sink's column dropped: the weights over the keys sum to less than one,
the rest going to no value at all. No SDPA or FlashAttention kernel of this PyTorch takes sinks, so this is the
products as transformers' eager path computes them (scores and softmax in fp32), used by the padded path, the
KV-cache path and the padding-free path where no FlashAttention kernel serves.

A FlashAttention kernel serves anyway (:func:`flash_sink_attention`): with the kernel's log-sum-exp ``lse`` of a
query's scores, the sink only rescales the output, ``out = out0 * sigmoid(lse - sink)``. The backward is the
kernel's own, handed ``grad * sigmoid(lse - sink)`` as the output gradient and the rescaled output in place of its
output: the kernel forms ``P0 * (dP0 - rowsum(dO0 * O))`` from the sink-free probabilities ``P0``, which is then
``P * (dP - rowsum(grad * out))`` for the probabilities ``P = P0 * sigmoid(lse - sink)`` that the sink's column
shrinks: the gradient of attention with sinks, without a kernel that knows them.
"""

from __future__ import annotations

from typing import Protocol

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], k and v [B, Hk, S, D], sinks [Hq] -> [B, Hq, T, D].

    ``mask`` (bool, broadcast to [B, 1, T, S]; True where a query may attend) or, when None, causal attention with
    the last query at the last key, limited to ``window`` latest positions (itself included) if given.
    """
    b, hq, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    if hq != hk:
        k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * d**-0.5
    if mask is None:
        q_pos = torch.arange(s - t, s, device=q.device)[:, None]
        k_pos = torch.arange(s, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (q_pos - k_pos < window)
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().view(1, hq, 1, 1).expand(b, hq, t, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class FlashKernel(Protocol):
    """A FlashAttention kernel's forward and backward over fixed shapes (one layer's call): ``forward(q, k, v)``
    gives ``(out, lse, aux)`` with ``out`` laid out heads at dim 1 (``[N, H, D]`` or ``[B, H, T, D]``) and ``lse``
    in the kernel's own layout; ``rows(lse)`` is that log-sum-exp as a view broadcasting against ``out``;
    ``backward(grad, q, k, v, out, lse, aux)`` gives ``(dq, dk, dv)`` (the kernel's backward computes
    ``rowsum(grad * out)`` from the ``out`` it is handed)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def rows(self, lse: torch.Tensor) -> torch.Tensor: ...

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _kept(lse_rows: torch.Tensor, sinks: torch.Tensor, ndim: int) -> torch.Tensor:
    """``sigmoid(lse - sink)`` in fp32: the share of each query's softmax that its keys keep beside the sink."""
    return torch.sigmoid(lse_rows.float() - sinks.float().view(1, -1, *([1] * (ndim - 2))))


class _FlashSinks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                kernel: FlashKernel) -> torch.Tensor:
        out0, lse, aux = kernel.forward(q, k, v)
        out = (out0.float() * _kept(kernel.rows(lse), sinks, out0.ndim)).to(out0.dtype)
        ctx.kernel = kernel
        ctx.save_for_backward(q, k, v, out, lse, aux, sinks)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, aux, sinks = ctx.saved_tensors
        kept = _kept(ctx.kernel.rows(lse), sinks, out.ndim)
        dq, dk, dv = ctx.kernel.backward((grad.float() * kept).to(out.dtype).contiguous(), q, k, v, out, lse, aux)
        dsinks = None
        if ctx.needs_input_grad[3]:  # d out / d sink = -out * (1 - kept)
            per_query = (grad.float() * out.float()).sum(-1, keepdim=True) * (1 - kept)
            dims = [d for d in range(out.ndim) if d != 1]
            dsinks = -per_query.sum(dims).to(sinks.dtype)
        return dq, dk, dv, dsinks, None


def flash_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         kernel: FlashKernel) -> torch.Tensor:
    """Attention with ``sinks`` ([H]) through ``kernel`` (:class:`FlashKernel`, which fixes the layout, mask and
    scale), differentiable in q, k, v and the sinks: the output the kernel gives rescaled by ``sigmoid(lse -
    sink)``, and its backward with the gradient and output rescaled to match (module docstring)."""
    return _FlashSinks.apply(q, k, v, sinks, kernel)
