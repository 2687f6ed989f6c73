"""Gemma's MLP gate, ``gelu_tanh(gate) * up``, in one pass forward and one backward (Triton), with its specification.

The plain path (:class:`entrenar.models.transformer.GatedMLP`) writes ``gelu(gate)`` to memory, multiplies it by
``up`` in a second kernel, and saves ``gate``, ``gelu(gate)`` and ``up`` for backward, whose two nodes take four
more passes. The kernel computes the product in fp32 in one pass, rounds it once, and saves only ``gate`` and
``up``; backward recomputes the activation.

With ``0.5 * (1 + tanh(a)) = sigmoid(2a)``, GELU's tanh approximation is ``gelu(g) = g * s`` where
``s = sigmoid(2 k (g + c g^3))``, ``k = sqrt(2 / pi)``, ``c = 0.044715``, and
``gelu'(g) = s + 2 g s (1 - s) k (1 + 3 c g^2)``; so ``d up = dy * gelu(g)`` and ``d gate = dy * up * gelu'(g)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from entrenar.kernels._common import call_op, cdiv, use_triton
from entrenar.kernels.lora_linear import project_together
from entrenar.models.transformer import GatedMLP

_BLOCK = 2048
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The specification: what ``GatedMLP.combine`` computes between its projections (tanh approximation)."""
    return F.gelu(gate, approximate="tanh") * up


def geglu_backward_reference(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``gelu_tanh(gate) * up`` (module docstring), in fp32 at least, in the inputs' dtype."""
    dtype = torch.promote_types(gate.dtype, torch.float32)
    dy_, g, u = dy.to(dtype), gate.to(dtype), up.to(dtype)
    s = torch.sigmoid(2 * _K * (g + _C * g**3))
    d_act = s + 2 * g * s * (1 - s) * _K * (1 + 3 * _C * g * g)
    return (dy_ * u * d_act).to(gate.dtype), (dy_ * g * s).to(up.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def forward(G, U, Y, n, K: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(2.0 * K * (g + C * g * g * g))
        tl.store(Y + offs, (g * s * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def backward(DY, G, U, DG, DU, n, K: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(2.0 * K * (g + C * g * g * g))
        d_act = s + 2.0 * g * s * (1.0 - s) * K * (1.0 + 3.0 * C * g * g)
        tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, (dy * u * d_act).to(DG.dtype.element_ty), mask=mask)

    return SimpleNamespace(forward=forward, backward=backward)


def _geglu_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    _kernels().forward[(cdiv(n, _BLOCK),)](gate, up, y, n, K=_K, C=_C, BLOCK=_BLOCK, num_warps=8)
    return y


_geglu = torch.library.custom_op("entrenar::geglu", mutates_args=())(_geglu_impl)


@_geglu.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _geglu_backward_impl(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _kernels().backward[(cdiv(n, _BLOCK),)](dy, gate, up, d_gate, d_up, n, K=_K, C=_C, BLOCK=_BLOCK, num_warps=8)
    return d_gate, d_up


_geglu_backward = torch.library.custom_op("entrenar::geglu_backward", mutates_args=())(_geglu_backward_impl)


@_geglu_backward.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate.contiguous(), up.contiguous())


def _backward(ctx, dy: torch.Tensor):
    gate, up = ctx.saved_tensors
    return _geglu_backward(dy, gate, up)  # the op: torch.compile traces this backward outside dynamo


_geglu.register_autograd(_backward, setup_context=_setup_context)


def _fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return use_triton(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``, fused where Triton can run; other inputs go through the reference."""
    return call_op(_geglu, _geglu_impl, gate, up) if _fits(gate, up) else geglu_reference(gate, up)


class FusedGatedMLP(GatedMLP):
    """A :class:`GatedMLP` with GELU's tanh approximation (Gemma's) whose gate runs the fused kernel, and whose gate
    and up projections run as one node when they are fused LoRA layers; same state dict. The exact (erf) GELU
    keeps the plain product."""

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(project_together(x, self.projections))

    def split(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`GatedMLP.split`, a fused ``gate_up_proj``'s halves made contiguous for the kernel."""
        gate, up = super().split(outputs)
        return (gate.contiguous(), up.contiguous()) if self.fused_gate_up else (gate, up)

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.approximate != "tanh":
            return super().combine(gate, up)
        return self.down_proj(geglu(gate, up))
