"""SwiGLU's gate, ``silu(gate) * up``, in one pass forward and one backward (Triton), with its specification.

The plain path writes ``silu(gate)`` to memory and saves it beside ``gate``
and ``up`` for backward. The kernel computes the product in fp32 in one pass
and saves only ``gate`` and ``up``; backward recomputes the sigmoid.

With ``s = sigmoid(g)``: ``d up = dy * g * s`` and
``d gate = dy * up * s * (1 + g * (1 - s))``.

The product feeds the down projection, whose LoRA adapter needs it again in
backward (for ``dA``). :func:`swiglu_lora_linear` runs the gate and that
projection as one node that saves ``gate`` and ``up`` only and recomputes the
product in backward: one elementwise pass instead of keeping a
[tokens, intermediate] tensor per layer (2 GiB on the LoRA-1B benchmark step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

import torch
import torch.nn.functional as F

from entrenar.kernels._common import autocast_inputs, call_op, cdiv, use_triton
from entrenar.kernels.lora_linear import (
    FusedLoraLinear,
    Weight,
    adapter_compute_dtype,
    adapter_gradients,
    adapters_in,
    base_gradients,
    fusable,
    lora_projections_backward,
    lora_projections_forward,
    node_arguments,
    project_together,
    save_bases,
    saved_bases,
)
from entrenar.models.transformer import MLP

_BLOCK = 2048


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The specification: what ``MLP.forward`` computes between its projections."""
    return F.silu(gate) * up


def swiglu_backward_reference(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``silu(gate) * up`` (module docstring), in fp32 at least, returned in the inputs' dtype."""
    dtype = torch.promote_types(gate.dtype, torch.float32)
    dy_, g, u = dy.to(dtype), gate.to(dtype), up.to(dtype)
    s = torch.sigmoid(g)
    return (dy_ * u * s * (1 + g * (1 - s))).to(gate.dtype), (dy_ * g * s).to(up.dtype)


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


def _swiglu_impl(gate: torch.Tensor, up: torch.Tensor, rebuild: bool = False) -> torch.Tensor:
    # ``rebuild`` changes nothing computed: it marks the call that rebuilds the product in a backward, so that
    # torch.compile does not merge it with the forward's call (and then keep the product alive in between).
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    _kernels().forward[(cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK, num_warps=8)
    return y


_swiglu = torch.library.custom_op("entrenar::swiglu", mutates_args=())(_swiglu_impl)


@_swiglu.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, rebuild: bool = False) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _swiglu_backward_impl(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _kernels().backward[(cdiv(n, _BLOCK),)](dy, gate, up, d_gate, d_up, n, BLOCK=_BLOCK, num_warps=8)
    return d_gate, d_up


_swiglu_backward = torch.library.custom_op("entrenar::swiglu_backward", mutates_args=())(_swiglu_backward_impl)


@_swiglu_backward.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    gate, up, _ = inputs
    ctx.save_for_backward(gate.contiguous(), up.contiguous())


def _backward(ctx, dy: torch.Tensor):
    gate, up = ctx.saved_tensors
    return *_swiglu_backward(dy, gate, up), None  # the op: torch.compile traces this backward outside dynamo


_swiglu.register_autograd(_backward, setup_context=_setup_context)


def _fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return use_triton(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype


def swiglu(gate: torch.Tensor, up: torch.Tensor, rebuild: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, fused where Triton can run; other inputs go through the reference.

    ``rebuild=True`` marks a backward's recomputation of a forward's product (see :func:`_swiglu`).
    """
    return call_op(_swiglu, _swiglu_impl, gate, up, rebuild) if _fits(gate, up) else swiglu_reference(gate, up)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`swiglu` with respect to ``gate`` and ``up`` (no autograd graph)."""
    if _fits(gate, up):
        return call_op(_swiglu_backward, _swiglu_backward_impl, dy, gate, up)
    if gate.device.type == "cpu" and gate.dtype in (torch.bfloat16, torch.float16) and gate.dtype == up.dtype:
        return _swiglu_backward_as_autograd(dy, gate, up)
    return swiglu_backward_reference(dy, gate, up)


def _swiglu_backward_as_autograd(dy: torch.Tensor, gate: torch.Tensor,
                                 up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What PyTorch's autograd computes for ``silu(gate) * up`` in 16 bits (transformers' MLP under autocast), bit
    for bit: each op works in fp32 inside and rounds its output. On a CPU that is four passes over 16-bit tensors
    where the fp32 reference makes five fp32 copies and a dozen fp32 passes (9% of a SmolLM2-135M bf16 step)."""
    dy = dy.to(gate.dtype)
    return torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)


class _SwigluLoraLinear(torch.autograd.Function):
    """``lora_linear(swiglu(gate, up), ...)`` saving ``gate``, ``up`` and ``A h``; ``h`` itself is rebuilt."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scaling: float, compute_dtype: torch.dtype,
                output_needed: bool):
        a, (b,) = adapters_in([lora_a], [lora_b], compute_dtype)
        if output_needed:
            h = swiglu(gate, up).reshape(-1, gate.shape[-1])
            (out,), xa = lora_projections_forward(h, [weight], [bias], a, [b], [scaling])
        else:  # see swiglu_lora_linear: neither the product nor h; A h is left to backward, which rebuilds h
            n = gate.numel() // gate.shape[-1]
            out = gate.new_empty(n, weight.shape[0])
            # A stride-0 stand-in with A h's shape and dtype: what checkpointing checks the rerun's tensors against.
            xa = torch.empty((), dtype=a.dtype, device=gate.device).expand(n, a.shape[0])
        save_bases(ctx, [weight], gate, up, xa, a, b)
        ctx.scaling, ctx.adapter_dtypes = scaling, (lora_a.dtype, lora_b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (gate, up, xa, a, b), (weight,) = saved_bases(ctx)
        need_gate, need_up, need_w, need_bias = ctx.needs_input_grad[:4]
        h = swiglu(gate, up, rebuild=True).reshape(-1, gate.shape[-1])
        if xa.numel() and xa.stride() == (0, 0):  # saved by a rerun that left A h to backward
            xa = h.to(a.dtype) @ a.T
        g = grad_out.reshape(-1, grad_out.shape[-1])
        need_h = need_gate or need_up
        dh, d_a, (d_b,) = lora_projections_backward([g], h, xa, [weight], a, [b], [ctx.scaling], need_h,
                                                    ctx.adapter_dtypes[0])
        d_gate = d_up = None
        if need_h:
            d_gate, d_up = swiglu_backward(dh.view(gate.shape), gate, up)
        return (d_gate, d_up, *base_gradients([g], h, [weight], [need_w], [need_bias]),
                *adapter_gradients(d_a, [d_b], [b], ctx.adapter_dtypes), None, None, None)


def swiglu_lora_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    compute_dtype: torch.dtype | None = None,
    output_needed: bool = True,
) -> torch.Tensor:
    """``lora_linear(swiglu(gate, up), weight, bias, lora_a, lora_b, scaling, compute_dtype)`` as one node
    (``weight`` a tensor or an NF4 weight, as in :func:`entrenar.kernels.lora_linear.lora_projections`).

    Same numbers as the two ops in turn; backward recomputes ``swiglu(gate, up)``
    instead of keeping it (see the module docstring).

    ``output_needed=False`` saves what backward reads but returns an uninitialised
    tensor instead of the product: no base product, no dequantization of an NF4
    weight, not even ``swiglu(gate, up)``, whose ``A h`` backward then forms from
    the ``h`` it rebuilds anyway. A checkpointed block's rerun asks for that
    (:mod:`entrenar.models.recompute`); the gradients are the same either way.
    """
    compute_dtype = adapter_compute_dtype(gate, lora_a, compute_dtype)
    (gate, up, weight, bias), autocast_off = autocast_inputs(gate, up, weight, bias)
    with autocast_off:
        out = _SwigluLoraLinear.apply(gate, up, weight, bias, lora_a, lora_b, float(scaling), compute_dtype,
                                      output_needed)
    return out.view(*gate.shape[:-1], out.shape[-1])


class FusedMLP(MLP):
    """An :class:`MLP` whose gate runs the fused kernel; same projections, same state dict.

    When its projections are fused LoRA layers (``apply_kernels`` with
    ``"lora"``), gate and up run as one node and the down projection rebuilds
    its input in backward (:func:`swiglu_lora_linear`).
    """

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(project_together(x, self.projections))

    def split(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`MLP.split`; a fused ``gate_up_proj``'s halves are strided views, made contiguous here
        because the kernels read gate and up (and write their gradients) as flat rows."""
        gate, up = super().split(outputs)
        return (gate.contiguous(), up.contiguous()) if self.fused_gate_up else (gate, up)

    def combine(self, gate: torch.Tensor, up: torch.Tensor, output_needed: bool = True) -> torch.Tensor:
        """``down(silu(gate) * up)``; ``output_needed=False``: see :func:`swiglu_lora_linear` (a hint, ignored
        where the down projection is not a fused LoRA layer)."""
        down = self.down_proj
        if fusable([down]):
            (weight,), (bias,), (lora_a,), (lora_b,), (scaling,), compute_dtype = node_arguments(
                [cast(FusedLoraLinear, down)])
            return swiglu_lora_linear(gate, up, weight, bias, lora_a, lora_b, scaling, compute_dtype, output_needed)
        return down(swiglu(gate, up))
