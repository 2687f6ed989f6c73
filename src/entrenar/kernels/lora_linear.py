"""A LoRA layer and its frozen base projection as one autograd node with a hand-written backward.

The plain :class:`entrenar.lora.LoraLinear` lets autograd save what each op
needs: an fp32 copy of the input per adapter (the adapters are fp32 on a bf16
base, as in PEFT), ``A x``, and the fp32 sum. Here backward keeps only the
input ``x`` in its own dtype (usually the very tensor another layer saves
anyway) and the small ``A x`` [tokens, r], and recomputes the fp32 cast of
``x`` when it forms the gradient of ``A``.

Forward, in the plain path's precision::

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

from entrenar.lora import LoraLinear


class _LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2.to(lora_a.dtype) @ lora_a.T  # [N, r]
        base = F.linear(x2, weight, bias)
        out = torch.addmm(base.to(lora_b.dtype), xa, lora_b.T, alpha=scaling).to(base.dtype)
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, xa, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb, _ = ctx.needs_input_grad
        s = ctx.scaling
        x2 = x.reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g_adapter = g.to(lora_b.dtype)
        grad_xa = (g_adapter @ lora_b) * s  # [N, r]
        dx = dw = db = da = dlb = None
        if need_x:
            dx = (g @ weight + (grad_xa @ lora_a).to(g.dtype)).view(x.shape)
        if need_w:
            dw = (g.T @ x2).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = g.sum(0).to(weight.dtype)
        if need_a:
            da = grad_xa.T @ x2.to(lora_a.dtype)
        if need_lb:
            dlb = (g_adapter.T @ xa) * s
        return dx, dw, db, da, dlb, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * B(A(x))`` with the adapter path in the adapters' dtype."""
    return _LoraLinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scaling))


class FusedLoraLinear(LoraLinear):
    """A :class:`LoraLinear` whose forward is one autograd node; same parameters, same state dict.

    Falls back to the plain forward where the fused one does not apply: a
    merged adapter, active dropout, or a base that is not a plain ``nn.Linear``
    (NF4, fake-quant).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropout_active = self.training and not isinstance(self.lora_dropout, nn.Identity)
        if self.merged or dropout_active or type(self.base_layer) is not nn.Linear:
            return super().forward(x)
        base = self.base_layer
        return lora_linear(x, base.weight, base.bias, self.lora_A.weight, self.lora_B.weight, self.scaling)
