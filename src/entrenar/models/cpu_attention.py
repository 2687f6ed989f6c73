"""Causal attention of one document as explicit products, for a CPU in bf16.

PyTorch's CPU flash kernel gains little from bf16: on the SmolLM2-135M shape it runs a layer's attention,
forward and backward, at about a quarter of the speed the CPU's bf16 matrix products reach. Written as products,
``softmax(q k^T / sqrt(d)) v`` runs 1.5-1.7x the flash kernel per document, forward and backward (SmolLM2-135M
shape, bench numbers in docs/PERFORMANCE.md). The
precision is FlashAttention-2's: scores and their gradient (``q k^T`` and ``dout v^T``) in fp32, the softmax in
fp32, the probabilities and the score gradient rounded to bf16 for the other four products (fp32 accumulation).
Relative errors against fp64 are within 2.5 times PyTorch's kernel's (outputs 2.2e-3 against 1.6e-3).

:func:`capped_attention` is the explicit path on any device for attention whose scores are soft-capped (Gemma 2),
which SDPA and the flash kernels cannot compute.

The probabilities are kept for backward (``heads x n x n`` bf16 per document), so only documents up to
:data:`EXPLICIT_MAX_LEN` tokens go this way, and only until a layer keeps :data:`EXPLICIT_LAYER_BUDGET`
elements (64 MiB); the rest stay with the flash kernel.
"""

from __future__ import annotations

import torch

EXPLICIT_MAX_LEN = 1024  # the longest document whose probabilities are kept
# The most probabilities one layer keeps for a batch (elements: 64 MiB in bf16); documents past it take the
# flash kernel, so a layer holds at most this much more than flash would, whatever the batch.
EXPLICIT_LAYER_BUDGET = 32 * 2**20


def explicit_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, window: int | None) -> bool:
    """Whether a document of ``n`` tokens runs as explicit products: on a CPU, q, k and v in one 16-bit dtype,
    fully causal (no window that cuts it), at most :data:`EXPLICIT_MAX_LEN` tokens."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and n <= EXPLICIT_MAX_LEN and (window is None or n <= window))


def explicit_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one document: q ``[Hq, n, D]``, k and v ``[Hk, n, D]`` (``Hq`` a multiple of
    ``Hk``: query head ``h`` reads key/value head ``h // (Hq / Hk)``, as SDPA's ``enable_gqa``) -> ``[Hq, n, Dv]``
    (``Dv``: v's head size, which may differ from q's, as under MLA)."""
    return _ExplicitCausal.apply(q.contiguous(), k.contiguous(), v.contiguous())


def _causal_probabilities(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) under the causal mask, products and all in fp32: ``[Hk, groups x n, n]``."""
    hq, n, d = q.shape
    hk = k.shape[0]
    # -inf above the diagonal, added by the product itself (one pass over the scores, not three)
    future = torch.full((n, n), float("-inf"), device=q.device).triu_(1).repeat(hq // hk, 1)
    scores = torch.baddbmm(future, q.view(hk, hq // hk * n, d).float(), k.transpose(1, 2).float(), alpha=d**-0.5)
    return torch.softmax(scores, dim=-1)


class _ExplicitCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the dtypes below are the point
            p = _causal_probabilities(q, k).to(q.dtype)
            out = torch.bmm(p, v)  # [Hk, groups x n, D]
        ctx.save_for_backward(q, k, v, p, out)
        return out.view(*q.shape[:2], v.shape[-1])  # values may be narrower than queries (MLA's v_head_dim)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, p, out = ctx.saved_tensors
        hq, n, d = q.shape
        hk = k.shape[0]
        with torch.autocast(grad_out.device.type, enabled=False):  # a backward called under autocast too
            grad_out = grad_out.reshape(out.shape).to(q.dtype)
            grad_v = torch.bmm(p.transpose(1, 2), grad_out)
            grad_p = torch.bmm(grad_out.float(), v.transpose(1, 2).float())
            # d softmax: p * (dp - rowsum(dp * p)), and rowsum(dp * p) = rowsum(dout * out).
            row = (grad_out.float() * out.float()).sum(-1, keepdim=True)
            grad_s = grad_p.sub_(row).mul_(p).mul_(d**-0.5).to(q.dtype)
            grad_q = torch.bmm(grad_s, k).view(hq, n, d)
            grad_k = torch.bmm(grad_s.transpose(1, 2), q.view(hk, hq // hk * n, d))
        return grad_q, grad_k, grad_v


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None, softcap: float) -> torch.Tensor:
    """``softmax(cap * tanh(q k^T * scale / cap) + mask) v`` as transformers' eager attention computes Gemma 2's,
    scores and softmax in fp32: q ``[B, Hq, T, D]``, k and v ``[B, Hk, S, D]`` -> ``[B, Hq, T, D]``.

    ``mask`` is boolean ``[B or 1, 1, T, S]`` (True: attend), or None for causal attention with ``S == T``;
    ``scale`` None is ``D ** -0.5``. Query head ``h`` reads key/value head ``h // (Hq / Hk)``.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
