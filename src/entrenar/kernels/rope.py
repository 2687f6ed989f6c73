"""Rotary position embedding of q and k in one kernel (Triton), with its PyTorch specification.

The plain path (:func:`entrenar.models.transformer.apply_rope`) builds
``rotate_half`` copies and five elementwise results per tensor. The kernel
reads each (batch, position) row of q and k once, rotates every head with the
row's cos/sin in fp32 and writes the result once, in the input's memory
layout (q and k are usually transposed views of the projections' output).

With ``x = [x1, x2]`` (halves of the head dimension) and ``cos = [c1, c2]``,
``sin = [s1, s2]``, forward is ``[x1 c1 - x2 s1, x2 c2 + x1 s2]``; backward is
the transposed map ``[g1 c1 + g2 s2, g2 c2 - g1 s1]``, which is forward with
``(s1, s2)`` replaced by ``(-s2, -s1)``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from entrenar.kernels._common import call_op, next_power_of_2, use_triton
from entrenar.kernels.lora_linear import project_together
from entrenar.models.transformer import Attention
from entrenar.models.transformer import apply_rope as apply_rope_reference


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def rope(Q, K, QO, KO, COS, SIN, seq_len,
             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t, sc_b, sc_t,
             n_q_heads, n_k_heads, half,
             BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
        # One program per (batch, position): all heads of q and k share that row of cos/sin.
        pid = tl.program_id(0).to(tl.int64)
        b = pid // seq_len
        t = pid % seq_len
        d = tl.arange(0, BLOCK_HALF)
        dmask = d < half
        cs = b * sc_b + t * sc_t + d
        c1 = tl.load(COS + cs, mask=dmask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + cs + half, mask=dmask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + cs, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + cs + half, mask=dmask, other=0.0).to(tl.float32)
        if BACKWARD:
            neg_s2 = -s2
            s2 = -s1
            s1 = neg_s2
        # q, then k: the same rotation over each tensor's heads.
        heads = tl.arange(0, BLOCK_QH)
        mask = (heads < n_q_heads)[:, None] & dmask[None, :]
        x_ptr = Q + b * sq_b + t * sq_t + heads[:, None] * sq_h + d[None, :]
        y_ptr = QO + b * sqo_b + t * sqo_t + heads[:, None] * sqo_h + d[None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr, (x1 * c1[None, :] - x2 * s1[None, :]).to(QO.dtype.element_ty), mask=mask)
        tl.store(y_ptr + half, (x2 * c2[None, :] + x1 * s2[None, :]).to(QO.dtype.element_ty), mask=mask)

        heads = tl.arange(0, BLOCK_KH)
        mask = (heads < n_k_heads)[:, None] & dmask[None, :]
        x_ptr = K + b * sk_b + t * sk_t + heads[:, None] * sk_h + d[None, :]
        y_ptr = KO + b * sko_b + t * sko_t + heads[:, None] * sko_h + d[None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr, (x1 * c1[None, :] - x2 * s1[None, :]).to(KO.dtype.element_ty), mask=mask)
        tl.store(y_ptr + half, (x2 * c2[None, :] + x1 * s2[None, :]).to(KO.dtype.element_ty), mask=mask)

    return SimpleNamespace(rope=rope)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_impl(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # keeps the inputs' (transposed) layout
    b, n_q, t, d = q.shape
    n_k = k.shape[1]
    cos_stride_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    _kernels().rope[(b * t,)](
        q, k, q_out, k_out, cos, sin, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_stride_b, cos.stride(1), n_q, n_k, d // 2,
        BLOCK_QH=next_power_of_2(n_q), BLOCK_KH=next_power_of_2(n_k), BLOCK_HALF=next_power_of_2(d // 2),
        BACKWARD=backward, num_warps=4,
    )
    return q_out, k_out


_rope = torch.library.custom_op("entrenar::rope", mutates_args=())(_rope_impl)


@_rope.register_fake
def _(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
    return torch.empty_like(_last_dim_contiguous(q)), torch.empty_like(_last_dim_contiguous(k))


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = _rope(dq, dk, cos, sin, not ctx.backward)  # the op: compile traces this backward outside dynamo
    return dq_in, dk_in, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes the kernel handles: q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B or 1, T, D], no grad to cos/sin."""
    if q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    return (
        k.shape[0] == b and k.shape[2:] == (t, d) and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b)
        and d % 2 == 0 and q.dtype == k.dtype and not (cos.requires_grad or sin.requires_grad)
    )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`entrenar.models.transformer.apply_rope`, fused where Triton can run."""
    if not use_triton(q, k, cos, sin) or not _fits(q, k, cos, sin):
        return apply_rope_reference(q, k, cos, sin)
    return call_op(_rope, _rope_impl, q, k, cos, sin, False)


class FusedRopeAttention(Attention):
    """An :class:`Attention` that rotates q and k with the fused kernel; same projections, same state dict.

    When q, k and v are fused LoRA layers (``apply_kernels`` with ``"lora"``),
    they also run as one node (:func:`entrenar.kernels.lora_linear.project_together`).
    """

    rotate = staticmethod(apply_rope)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split(project_together(x, self.projections))
