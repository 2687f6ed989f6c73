"""LoRA layers and their frozen base projections as one autograd node with a hand-written backward.

The plain :class:`entrenar.lora.LoraLinear` lets autograd save what each op
needs: an fp32 copy of the input per adapter (the adapters are fp32 on a bf16
base, as in PEFT), ``A x``, and the fp32 sum. Here backward keeps only the
input ``x`` in its own dtype (usually the very tensor another layer saves
anyway) and the small ``A x`` [tokens, r], and recomputes the fp32 cast of
``x`` when it forms the gradient of ``A``.

Projections that read the same input (q, k and v; gate and up) go through one
node together (:func:`project_together`): one product for all their ``A``
matrices in forward and one for their gradients in backward, so the input is
read once instead of once per adapter, and their input gradients accumulate
into one tensor in place instead of being summed by autograd afterwards.

Forward of each projection ``i``, by default in the plain path's precision::

    y_i = (x W_i^T + b_i + s_i (A_i x)^T B_i^T).to(dtype of x W_i^T)    with A_i x in the adapter dtype

Backward, with ``g_i`` the output gradients::

    dB_i = s_i g_i^T (A_i x)    u_i = s_i g_i B_i    dA_i = u_i^T x    dx = sum_i (g_i W_i + u_i A_i)

The products are plain PyTorch (cuBLAS), so this runs on any device. They run
inside two custom ops, opaque to ``torch.compile``, so that the sums are
written in place under the compiler too (a functionalised ``addmm_`` is an
out-of-place ``addmm``, which first copies its input matrix: about 5% of a
LoRA-1B step on an H200, docs/PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.kernels._common import autocast_inputs
from entrenar.kernels.nf4 import nf4_lora_linear
from entrenar.lora import LoraLinear
from entrenar.quant.nf4 import NF4Linear


def _add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``c + alpha * a @ b`` formed in ``dtype`` and returned in ``c``'s dtype; in place when they agree."""
    if c.dtype == dtype:
        return c.addmm_(a, b, alpha=alpha)
    return torch.addmm(c.to(dtype), a, b, alpha=alpha).to(c.dtype)


def _columns(ranks: Sequence[int]) -> list[slice]:
    """The column ranges of each adapter in the concatenated ``A x``."""
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    return [slice(start, start + r) for start, r in zip(starts, ranks)]


@torch.library.custom_op("entrenar::lora_projections", mutates_args=())
def lora_projections_forward(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scalings: list[float],
    compute_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Forward of every projection of ``x`` [N, in]; returns their outputs and, last, ``A x`` [N, sum of ranks].

    This op and :func:`lora_projections_backward` are the bodies of the node; other
    nodes that end in a LoRA projection (:func:`entrenar.kernels.swiglu.swiglu_lora_linear`) call them too.
    """
    a = torch.cat([t.to(compute_dtype) for t in lora_a])
    xa = x.to(compute_dtype) @ a.T
    outs = []
    for w, bias, b, s, cols in zip(weights, biases, lora_b, scalings, _columns([t.shape[0] for t in lora_a])):
        outs.append(_add_product(F.linear(x, w, bias), xa[:, cols], b.to(compute_dtype).T, s, compute_dtype))
    return [*outs, xa]


@lora_projections_forward.register_fake
def _(x, weights, biases, lora_a, lora_b, scalings, compute_dtype):
    rank = sum(t.shape[0] for t in lora_a)
    return [*(x.new_empty(x.shape[0], w.shape[0]) for w in weights), x.new_empty(x.shape[0], rank, dtype=compute_dtype)]


@torch.library.custom_op("entrenar::lora_projections_backward", mutates_args=())
def lora_projections_backward(
    grads: list[torch.Tensor],
    x: torch.Tensor,
    xa: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scalings: list[float],
    compute_dtype: torch.dtype,
    need_x: bool,
) -> list[torch.Tensor]:
    """Returns ``dx`` (empty unless ``need_x``), then ``dA_i`` for each projection, then ``dB_i``."""
    cd = compute_dtype
    columns = _columns([t.shape[0] for t in lora_a])
    us, d_b = [], []
    for g, b, s, cols in zip(grads, lora_b, scalings, columns):
        gc = g.to(cd)
        us.append((gc @ b.to(cd)).mul_(s))
        d_b.append((gc.T @ xa[:, cols]).mul_(s).to(b.dtype))
    u = torch.cat(us, dim=1)
    d_a_all = u.T @ x.to(cd)
    d_a = [d_a_all[cols].to(a.dtype, copy=True) for cols, a in zip(columns, lora_a)]  # outputs may not alias
    dx = x.new_empty(0)
    if need_x:
        dx = grads[0] @ weights[0]
        for g, w in zip(grads[1:], weights[1:]):
            dx.addmm_(g, w)
        dx = _add_product(dx, u, torch.cat([a.to(cd) for a in lora_a]), 1.0, cd)
    return [dx, *d_a, *d_b]


@lora_projections_backward.register_fake
def _(grads, x, xa, weights, lora_a, lora_b, scalings, compute_dtype, need_x):
    dx = grads[0].new_empty(x.shape[0], x.shape[1]) if need_x else x.new_empty(0)
    return [dx, *(torch.empty_like(a) for a in lora_a), *(torch.empty_like(b) for b in lora_b)]


class _LoraProjections(torch.autograd.Function):
    """Autograd for :func:`lora_projections_forward`; arguments flattened: ``x, n, *weights, *biases, *A, *B, scalings, dtype``."""

    @staticmethod
    def forward(ctx, x, n: int, *args):
        weights, biases, lora_a, lora_b = (list(args[i * n:(i + 1) * n]) for i in range(4))
        scalings, compute_dtype = args[4 * n:]
        x2 = x.reshape(-1, x.shape[-1])
        *outs, xa = lora_projections_forward(x2, weights, biases, lora_a, lora_b, list(scalings), compute_dtype)
        ctx.save_for_backward(x, xa, *weights, *lora_a, *lora_b)
        ctx.n, ctx.scalings, ctx.compute_dtype = n, list(scalings), compute_dtype
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        n = ctx.n
        x, xa, *rest = ctx.saved_tensors
        weights, lora_a, lora_b = rest[:n], rest[n:2 * n], rest[2 * n:]
        need = ctx.needs_input_grad
        need_w, need_bias = need[2:2 + n], need[2 + n:2 + 2 * n]
        x2 = x.reshape(-1, x.shape[-1])
        grads = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx, *d_ab = lora_projections_backward(grads, x2, xa, weights, lora_a, lora_b, ctx.scalings, ctx.compute_dtype,
                                          need[0])
        d_w = [(g.T @ x2).to(w.dtype) if needed else None for g, w, needed in zip(grads, weights, need_w)]
        d_bias = [g.sum(0).to(w.dtype) if needed and has else None
                  for g, w, needed, has in zip(grads, weights, need_bias, ctx.has_bias)]
        return (dx.view(x.shape) if need[0] else None), None, *d_w, *d_bias, *d_ab, None, None


def lora_projections(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weights[i], biases[i]) + scalings[i] * B_i(A_i(x))`` for every ``i``, as one autograd node.

    The adapter products run in ``compute_dtype``: by default the adapters'
    own dtype (fp32 on a bf16 base: the plain path's numerics). Passing the
    base dtype (bf16) runs them on the tensor cores with no fp32 copies of
    activations: faster, but the adapter path and the adapter gradients are
    then rounded to bf16 (the adapter weights and optimizer stay fp32).
    """
    n = len(weights)
    (x, *tensors), autocast_off = autocast_inputs(x, *weights, *biases, *lora_a, *lora_b)
    with autocast_off:
        return _LoraProjections.apply(x, n, *tensors, tuple(float(s) for s in scalings),
                                      compute_dtype or lora_a[0].dtype)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * B(A(x))``: :func:`lora_projections` of one projection."""
    return lora_projections(x, [weight], [bias], [lora_a], [lora_b], [scaling], compute_dtype)[0]


def _runs_fused(layer: nn.Module) -> bool:
    """A LoRA layer whose forward is :func:`lora_linear`: a plain linear base, unmerged, no active dropout."""
    return (
        isinstance(layer, FusedLoraLinear) and type(layer.base_layer) is nn.Linear and not layer.merged
        and not (layer.training and not isinstance(layer.lora_dropout, nn.Identity))
    )


def _compute_dtype(layer: FusedLoraLinear) -> torch.dtype:
    return layer.lora_compute_dtype or layer.lora_A.weight.dtype


def fusable(layers: Sequence[nn.Module]) -> bool:
    """True if these layers can run as one :func:`lora_projections` node (same adapter compute dtype)."""
    return all(_runs_fused(layer) for layer in layers) and len({_compute_dtype(layer) for layer in layers}) == 1


def project_together(x: torch.Tensor, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """Each of ``layers`` applied to ``x``: one node for LoRA layers that can share it, else one call each."""
    if len(layers) < 2 or not fusable(layers):
        return tuple(layer(x) for layer in layers)
    return lora_projections(
        x, [layer.base_layer.weight for layer in layers], [layer.base_layer.bias for layer in layers],
        [layer.lora_A.weight for layer in layers], [layer.lora_B.weight for layer in layers],
        [layer.scaling for layer in layers], _compute_dtype(layers[0]),
    )


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
        base = self.base_layer
        if _runs_fused(self):
            return lora_linear(
                x, base.weight, base.bias, self.lora_A.weight, self.lora_B.weight, self.scaling, self.lora_compute_dtype
            )
        dropout_active = self.training and not isinstance(self.lora_dropout, nn.Identity)
        if isinstance(base, NF4Linear) and not (self.merged or dropout_active):
            bias = None if base.bias is None else base.bias.to(x.dtype)
            return nf4_lora_linear(x, base.quantized, bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                                   self.lora_compute_dtype)
        return super().forward(x)
