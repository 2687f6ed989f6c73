"""A LoRA layer and its frozen base projection as one autograd node with a hand-written backward.

The plain :class:`entrenar.lora.LoraLinear` lets autograd save what each op
needs: an fp32 copy of the input per adapter (the adapters are fp32 on a bf16
base, as in PEFT), ``A x``, and the fp32 sum. Here backward keeps only the
input ``x`` in its own dtype (usually the very tensor another layer saves
anyway) and the small ``A x`` [tokens, r], and recomputes the fp32 cast of
``x`` when it forms the gradient of ``A``.

Forward, by default in the plain path's precision::

    y = (x W^T + b + s * (A x)^T B^T).to(dtype of x W^T)    with A x in the adapter dtype

Backward, with ``g`` the output gradient::

    dB = s * g^T (A x)      d(Ax) = s * g B      dA = d(Ax)^T x      dx = g W + d(Ax) A

This is plain PyTorch (cuBLAS matrix products), so it runs on any device and
``torch.compile`` traces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.kernels._common import autocast_inputs
from entrenar.kernels.nf4 import nf4_lora_linear
from entrenar.lora import LoraLinear
from entrenar.quant.nf4 import NF4Linear


def _add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``c + alpha * a @ b``, overwriting ``c`` (a fresh intermediate) unless torch.compile is tracing.

    ATen's out-of-place ``addmm`` first copies ``c`` into its result, one activation-sized copy per call
    (about 5% of a LoRA-1B step on an H200, docs/PERFORMANCE.md); in place there is none. Under
    torch.compile the in-place call is functionalised into that same copy anyway, so the graph gets the
    plain out-of-place form.
    """
    if torch.compiler.is_compiling():
        return torch.addmm(c, a, b, alpha=alpha)
    return c.addmm_(a, b, alpha=alpha)


class _LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, compute_dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])
        a, b = lora_a.to(compute_dtype), lora_b.to(compute_dtype)
        xa = x2.to(compute_dtype) @ a.T  # [N, r]
        base = F.linear(x2, weight, bias)
        out = _add_product(base.to(compute_dtype), xa, b.T, scaling).to(base.dtype)
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b)
        ctx.scaling, ctx.compute_dtype, ctx.has_bias = scaling, compute_dtype, bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, xa, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        s, cd = ctx.scaling, ctx.compute_dtype
        x2 = x.reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g_adapter = g.to(cd)
        grad_xa = (g_adapter @ lora_b.to(cd)) * s  # [N, r]
        dx = dw = db = da = dlb = None
        if need_x:
            dx = g @ weight
            if dx.dtype == cd:
                dx = _add_product(dx, grad_xa, lora_a.to(cd))
            else:
                dx = dx + (grad_xa @ lora_a).to(dx.dtype)
            dx = dx.view(x.shape)
        if need_w:
            dw = (g.T @ x2).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = g.sum(0).to(weight.dtype)
        if need_a:
            da = (grad_xa.T @ x2.to(cd)).to(lora_a.dtype)
        if need_lb:
            dlb = ((g_adapter.T @ xa) * s).to(lora_b.dtype)
        return dx, dw, db, da, dlb, None, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * B(A(x))``.

    The adapter products run in ``compute_dtype``: by default the adapters'
    own dtype (fp32 on a bf16 base: the plain path's numerics). Passing the
    base dtype (bf16) runs them on the tensor cores with no fp32 copies of
    activations: faster, but the adapter path and the adapter gradients are
    then rounded to bf16 (the adapter weights and optimizer stay fp32).
    """
    (x, weight, bias, lora_a, lora_b), autocast_off = autocast_inputs(x, weight, bias, lora_a, lora_b)
    with autocast_off:
        return _LoraLinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling), compute_dtype or lora_a.dtype)


class FusedLoraLinear(LoraLinear):
    """A :class:`LoraLinear` whose forward is one autograd node; same parameters, same state dict.

    On a plain ``nn.Linear`` base that node is :func:`lora_linear`; on an NF4
    base (QLoRA) it is :func:`entrenar.kernels.nf4.nf4_lora_linear`. Falls back
    to the plain forward where neither applies: a merged adapter, active
    dropout, or another base (fake-quant). ``lora_compute_dtype`` (see
    :func:`lora_linear`) is ``None`` unless :func:`entrenar.kernels.apply_kernels`
    was asked for another.
    """

    lora_compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropout_active = self.training and not isinstance(self.lora_dropout, nn.Identity)
        base = self.base_layer
        if self.merged or dropout_active:
            return super().forward(x)
        if type(base) is nn.Linear:
            return lora_linear(
                x, base.weight, base.bias, self.lora_A.weight, self.lora_B.weight, self.scaling, self.lora_compute_dtype
            )
        if isinstance(base, NF4Linear):
            bias = None if base.bias is None else base.bias.to(x.dtype)
            return nf4_lora_linear(x, base.quantized, bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                                   self.lora_compute_dtype)
        return super().forward(x)
