"""SwiGLU's gate, ``silu(gate) * up``, in one pass forward and one backward (Triton), with its specification.

The plain path writes ``silu(gate)`` to memory and saves it beside ``gate``
and ``up`` for backward. The kernel computes the product in fp32 in one pass
and saves only ``gate`` and ``up``; backward recomputes the sigmoid.

With ``s = sigmoid(g)``: ``d up = dy * g * s`` and
``d gate = dy * up * s * (1 + g * (1 - s))``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from entrenar.kernels._common import cdiv, use_triton
from entrenar.models.transformer import MLP

_BLOCK = 2048


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The specification: what ``MLP.forward`` computes between its projections."""
    return F.silu(gate) * up


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def forward(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def backward(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)

    return SimpleNamespace(forward=forward, backward=backward)


@torch.library.custom_op("entrenar::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    _kernels().forward[(cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK, num_warps=8)
    return y


@_swiglu.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("entrenar::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _kernels().backward[(cdiv(n, _BLOCK),)](dy, gate, up, d_gate, d_up, n, BLOCK=_BLOCK, num_warps=8)
    return d_gate, d_up


@_swiglu_backward.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate.contiguous(), up.contiguous())


def _backward(ctx, dy: torch.Tensor):
    gate, up = ctx.saved_tensors
    return _swiglu_backward(dy, gate, up)


_swiglu.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, fused where Triton can run; other inputs go through the reference."""
    if not use_triton(gate, up) or gate.shape != up.shape or gate.dtype != up.dtype:
        return swiglu_reference(gate, up)
    return _swiglu(gate, up)


class FusedMLP(MLP):
    """An :class:`MLP` whose gate runs the fused kernel; same projections, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
