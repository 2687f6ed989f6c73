"""LoRA layers and their frozen base projections as one autograd node with a hand-written backward.

The plain :class:`entrenar.adapters.lora.LoraLinear` lets autograd save what each op
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

A base weight is a tensor or, for QLoRA, an :class:`~entrenar.quant.nf4.format.NF4Tensor`:
its weight is dequantized in forward and again in backward (the Triton kernel
on CUDA) and never kept between them, so the node holds no 16-bit copy of a
4-bit base.

The products are plain PyTorch (cuBLAS), so this runs on any device and
``torch.compile`` traces it. On a CPU without 16-bit matrix instructions
(:func:`entrenar.device.cpu_products_in_fp32`), where PyTorch emulates a bf16
product at about 1/7 of the fp32 rate, a 16-bit node forms every product in
fp32 and rounds only its outputs and ``dx`` to the activations' dtype: the
base weights and biases enter as the 16-bit products use them (rounded to that
dtype, so the base products equal the 16-bit ones up to fp32 summation order),
the adapters in their own dtype (fp32), as without autocast, where autocast
would round them and ``A x`` to 16 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.adapters.lora import LoraLinear
from entrenar.device import cpu_products_in_fp32
from entrenar.kernels._common import autocast_dtype, autocast_inputs
from entrenar.quant.nf4.format import NF4Linear, NF4Tensor, dequantize_nf4

Weight = torch.Tensor | NF4Tensor  # a base weight as the node takes it


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A base weight as a matrix in ``dtype``: a tensor as it is (cast where its dtype differs), an NF4 weight
    dequantized now (a fresh tensor)."""
    return dequantize_nf4(weight, dtype) if isinstance(weight, NF4Tensor) else weight.to(dtype)


def widened(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A base weight (or bias) as a ``dtype`` product uses it, rounded to ``dtype``, held in fp32 for an fp32
    product (:func:`entrenar.device.cpu_products_in_fp32`)."""
    return dense(weight, dtype).float()


def save_bases(ctx, weights: Sequence[Weight], *tensors: torch.Tensor) -> None:
    """``save_for_backward(*tensors, *the weights)``, an NF4 weight as its buffers (its shape and format on
    ``ctx``). :func:`saved_bases` gives back ``tensors`` and the weights in order.

    Through ``save_for_backward``, not as ``ctx`` attributes: activation checkpointing drops what a node saves
    there until the rerun, so a checkpointed block does not keep a GPU copy of weights streamed in from CPU
    memory (:mod:`entrenar.quant.nf4.streaming`) between its forward and its backward.
    """
    ctx.nf4_bases = [(w.shape, w.dtype, w.blocksize) if isinstance(w, NF4Tensor) else None for w in weights]
    parts: list[torch.Tensor | None] = []  # absmax_scale and absmax_offset are None without double quantization
    for w in weights:
        parts += [w.codes, w.absmax, w.absmax_scale, w.absmax_offset] if isinstance(w, NF4Tensor) else [w]
    ctx.save_for_backward(*tensors, *parts)


def saved_bases(ctx) -> tuple[list[torch.Tensor], list[Weight]]:
    """What :func:`save_bases` kept: the other tensors, then the weights."""
    saved = list(ctx.saved_tensors)
    n_parts = sum(1 if meta is None else 4 for meta in ctx.nf4_bases)
    parts = iter(saved[len(saved) - n_parts:])
    weights = []
    for meta in ctx.nf4_bases:
        if meta is None:
            weights.append(next(parts))
        else:
            codes, absmax, scale, offset = (next(parts) for _ in range(4))
            weights.append(NF4Tensor(codes, absmax, scale, offset, *meta))
    return saved[:len(saved) - n_parts], weights


def _add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``c + alpha * a @ b`` formed in ``dtype`` and returned in ``c``'s dtype, overwriting ``c`` (a fresh
    intermediate) where the dtypes agree, unless torch.compile is tracing.

    ATen's out-of-place ``addmm`` first copies ``c`` into its result, one activation-sized copy per call
    (about 5% of a LoRA-1B step on an H200, docs/PERFORMANCE.md); in place there is none. Under
    torch.compile the in-place call is functionalised into that same copy anyway, so the graph gets the
    plain out-of-place form.
    """
    if c.dtype == dtype and not torch.compiler.is_compiling():
        return c.addmm_(a, b, alpha=alpha)
    return torch.addmm(c.to(dtype), a, b, alpha=alpha).to(c.dtype)


def _columns(ranks: Sequence[int]) -> list[slice]:
    """The column ranges of each adapter in the concatenated ``A x``."""
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    return [slice(start, start + r) for start, r in zip(starts, ranks)]


def adapters_in(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The adapters as the products use them: every ``A`` stacked into one [sum of ranks, in] matrix, in ``dtype``."""
    a = torch.cat(list(lora_a)) if len(lora_a) > 1 else lora_a[0]
    return a.to(dtype), [b.to(dtype) for b in lora_b]


def adapter_compute_dtype(x: torch.Tensor, lora_a: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a node's adapter products: ``compute_dtype`` if set, else autocast's where it is on (it
    runs the plain layer's adapter products in its dtype), else the adapters' own.

    The adapters themselves enter the node uncast (see :func:`lora_projections`), so their gradients leave
    it in their own dtype, written by the products: under bf16 autocast, fp32 gradients with no cast kernels
    or cast nodes after them.
    """
    autocast = autocast_dtype(x)
    if compute_dtype is None and autocast is not None and cpu_products_in_fp32(x.device, autocast):
        return lora_a.dtype  # the node computes in fp32 there (lora_projections_forward): no 16-bit adapter copy
    return compute_dtype or autocast or lora_a.dtype


def lora_projections_forward(
    x: torch.Tensor,
    weights: Sequence[Weight],
    biases: Sequence[torch.Tensor | None],
    a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every projection of ``x`` [N, in] and ``A x`` [N, sum of ranks], from :func:`adapters_in`'s adapters.

    This function and :func:`lora_projections_backward` are the bodies of the
    node; other nodes that end in a LoRA projection
    (:func:`entrenar.kernels.swiglu.swiglu_lora_linear`) call them too.
    """
    out_dtype = x.dtype
    wide = cpu_products_in_fp32(x.device, x.dtype)  # see the module docstring; the outputs rounded once
    if wide:
        x = x.float()
    xa = x.to(a.dtype) @ a.T
    if wide:
        weights = [widened(w, out_dtype) for w in weights]
        biases = [None if bias is None else widened(bias, out_dtype) for bias in biases]
    outs = [_projection(x, w, bias, xa[:, cols], b, s).to(out_dtype)
            for w, bias, b, s, cols in zip(weights, biases, lora_b, scalings, _columns([b.shape[1] for b in lora_b]))]
    return outs, xa


def _projection(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, xa: torch.Tensor, b: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """``x W^T + bias + scaling * (x A^T) B^T``.

    Where the adapter product runs in the activations' dtype, it goes first and the base product adds it in
    its epilogue (``beta``): the output is written once and read once inside a compute-bound GEMM, where
    adding the adapter's product afterwards reads and writes the whole output again in a memory-bound one
    (LoRA-1B through `entrenar train` on an H100: 72.5-72.8k -> 74.4k tokens/s, docs/PERFORMANCE.md).
    """
    if bias is None and xa.dtype == x.dtype and not torch.compiler.is_compiling():
        return (xa @ b.T).addmm_(x, dense(w, x.dtype).T, beta=scaling)
    return _add_product(F.linear(x, dense(w, x.dtype), None if bias is None else bias.to(x.dtype)), xa, b.T,
                        scaling, xa.dtype)


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype``; on CUDA in eager mode a bf16/fp16 product is written in fp32 by the GEMM itself
    (no rounding to 16 bits, no cast kernel), elsewhere formed in ``a``'s dtype and cast (a cast the compiler
    fuses into what follows)."""
    if (a.dtype != dtype and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32
            and not torch.compiler.is_compiling()):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


def _scale_columns(t: torch.Tensor, scalings: Sequence[float], cols: Sequence[slice], in_place: bool) -> torch.Tensor:
    """Each adapter's columns of ``t`` times its scaling: one multiply when the scalings agree."""
    if len(set(scalings)) == 1:
        return t.mul_(scalings[0]) if in_place else t * scalings[0]
    t = t if in_place else t.clone()
    for s, c in zip(scalings, cols):
        t[:, c].mul_(s)
    return t


def lora_projections_backward(
    grads: Sequence[torch.Tensor],
    x: torch.Tensor,
    xa: torch.Tensor,
    weights: Sequence[Weight],
    a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
    need_x: bool,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
    """``dx`` (None unless ``need_x``), the gradient of the stacked ``A`` and each ``dB``.

    The adapter gradients come out in ``grad_dtype`` (default ``a``'s dtype):
    with bf16 adapter math on fp32 adapters, the products write them in fp32.
    """
    cd = a.dtype
    grad_dtype = grad_dtype or cd
    if cpu_products_in_fp32(x.device, grads[0].dtype):  # see the module docstring; dx rounded once
        dtype = grads[0].dtype
        wide = [widened(w, dtype) for w in weights] if need_x else weights  # only dx reads them
        with torch.autocast("cpu", enabled=False):  # a backward called under autocast: its products stay fp32
            dx, d_a, d_b = lora_projections_backward([g.float() for g in grads], x.float(), xa, wide, a, lora_b,
                                                     scalings, need_x, grad_dtype)
        return None if dx is None else dx.to(dtype), d_a, d_b
    cols = _columns([b.shape[1] for b in lora_b])
    # u_i = s_i g_i B_i side by side in one [tokens, sum of ranks] tensor, dB_i = g_i^T (s_i A_i x): the
    # scalings applied once to each small tensor, not per product.
    gcs = [g.to(cd) for g in grads]
    if len(gcs) == 1:
        u = gcs[0] @ lora_b[0]
    elif torch.compiler.is_compiling():  # dynamo refuses out= on a column slice
        u = torch.cat([gc @ b for gc, b in zip(gcs, lora_b)], dim=1)
    else:  # each product writes its columns: no concatenation pass
        u = torch.empty(x.shape[0], cols[-1].stop, dtype=cd, device=x.device)
        for gc, b, c in zip(gcs, lora_b, cols):
            torch.mm(gc, b, out=u[:, c])
    _scale_columns(u, scalings, cols, in_place=True)
    xa_scaled = _scale_columns(xa, scalings, cols, in_place=False)
    d_b = [_product(gc.T, xa_scaled[:, c], grad_dtype) for gc, c in zip(gcs, cols)]
    d_a = _product(u.T, x.to(cd), grad_dtype)
    dx = None
    if need_x and cd == grads[0].dtype and not torch.compiler.is_compiling():
        dx = u @ a  # first, as in _projection: the base products add into it in their epilogues
        for g, w in zip(grads, weights):
            dx.addmm_(g, dense(w, g.dtype))
    elif need_x:
        dx = grads[0] @ dense(weights[0], grads[0].dtype)
        for g, w in zip(grads[1:], weights[1:]):
            dx = _add_product(dx, g, dense(w, g.dtype), 1.0, dx.dtype)
        dx = _add_product(dx, u, a, 1.0, cd)
    return dx, d_a, d_b


def adapter_gradients(d_a: torch.Tensor, d_b: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                      dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The stacked ``A`` gradient split per adapter, then every ``dA_i`` and ``dB_i`` in its adapter's dtype."""
    d_as = d_a.split([b.shape[1] for b in lora_b]) if len(lora_b) > 1 else [d_a]
    return [g.to(dtype) for g, dtype in zip([*d_as, *d_b], dtypes)]


def base_gradients(grads: Sequence[torch.Tensor], x: torch.Tensor, weights: Sequence[Weight],
                   need_w: Sequence[bool], need_bias: Sequence[bool]) -> list[torch.Tensor | None]:
    """``dW_i = g_i^T x`` and ``db_i = sum of g_i`` where asked (a trained base; LoRA leaves it frozen, and an
    NF4 weight is never asked for)."""
    d_w = [(g.T @ x).to(w.dtype) if needed else None for g, w, needed in zip(grads, weights, need_w)]
    d_bias = [g.sum(0).to(w.dtype) if needed else None for g, w, needed in zip(grads, weights, need_bias)]
    return [*d_w, *d_bias]


class _LoraProjections(torch.autograd.Function):
    """Autograd for :func:`lora_projections_forward`; arguments flattened: ``x, n, *weights, *biases, *A, *B,
    scalings, dtype``."""

    @staticmethod
    def forward(ctx, x, n: int, *args):
        weights, biases, lora_a, lora_b = (list(args[i * n:(i + 1) * n]) for i in range(4))
        scalings, compute_dtype = args[4 * n:]
        a, bs = adapters_in(lora_a, lora_b, compute_dtype)
        outs, xa = lora_projections_forward(x.reshape(-1, x.shape[-1]), weights, biases, a, bs, scalings)
        save_bases(ctx, weights, x, xa, a, *bs)
        ctx.n, ctx.scalings = n, scalings
        ctx.adapter_dtypes = [t.dtype for t in (*lora_a, *lora_b)]
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        n = ctx.n
        (x, xa, a, *bs), weights = saved_bases(ctx)
        need = ctx.needs_input_grad
        need_w, need_bias = need[2:2 + n], need[2 + n:2 + 2 * n]
        x2 = x.reshape(-1, x.shape[-1])
        grads = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx, d_a, d_b = lora_projections_backward(grads, x2, xa, weights, a, bs, ctx.scalings, need[0],
                                                 ctx.adapter_dtypes[0])
        dx = None if dx is None else dx.view(x.shape)
        return (dx, None, *base_gradients(grads, x2, weights, need_w, need_bias),
                *adapter_gradients(d_a, d_b, bs, ctx.adapter_dtypes), None, None)


def lora_projections(
    x: torch.Tensor,
    weights: Sequence[Weight],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weights[i], biases[i]) + scalings[i] * B_i(A_i(x))`` for every ``i``, as one autograd node.

    A weight may be an :class:`~entrenar.quant.nf4.format.NF4Tensor` (QLoRA): it is
    dequantized to ``x``'s dtype where used, and a bias is cast to that dtype
    as :class:`~entrenar.quant.nf4.format.NF4Linear` does.
    The adapter products run in ``compute_dtype``: by default the adapters'
    own dtype (fp32 on a bf16 base: the plain path's numerics). Passing the
    base dtype (bf16) runs them on the tensor cores with no fp32 copies of
    activations: faster, but the adapter path and the adapter gradients are
    then rounded to bf16 (the adapter weights and optimizer stay fp32).
    """
    n = len(weights)
    compute_dtype = adapter_compute_dtype(x, lora_a[0], compute_dtype)
    (x, *bases), autocast_off = autocast_inputs(x, *(*weights, *biases))  # one unpack: mypy matches no more to *Ts
    with autocast_off:
        return _LoraProjections.apply(x, n, *bases, *lora_a, *lora_b, tuple(float(s) for s in scalings),
                                      compute_dtype)


def lora_linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * B(A(x))``: :func:`lora_projections` of one projection."""
    return lora_projections(x, [weight], [bias], [lora_a], [lora_b], [scaling], compute_dtype)[0]


def _runs_fused(layer: nn.Module) -> TypeGuard[FusedLoraLinear]:
    """A LoRA layer whose forward is :func:`lora_linear`: a plain linear or NF4 base, unmerged, no active dropout."""
    return (
        isinstance(layer, FusedLoraLinear) and type(layer.base_layer) in (nn.Linear, NF4Linear) and not layer.merged
        and not (layer.training and not isinstance(layer.lora_dropout, nn.Identity))
    )


def _base_weight(layer: FusedLoraLinear) -> Weight:
    base = layer.base_layer
    return base.quantized if isinstance(base, NF4Linear) else cast(torch.Tensor, base.weight)


def _compute_dtype(layer: FusedLoraLinear) -> torch.dtype:
    return layer.lora_compute_dtype or layer.lora_A.weight.dtype


def fusable(layers: Sequence[nn.Module]) -> TypeGuard[Sequence[FusedLoraLinear]]:
    """True if these layers can run as one :func:`lora_projections` node (same adapter compute dtype)."""
    return (all(_runs_fused(layer) for layer in layers)
            and len({_compute_dtype(cast(FusedLoraLinear, layer)) for layer in layers}) == 1)


def node_arguments(layers: Sequence[FusedLoraLinear]) -> tuple:
    """``weights, biases, lora_a, lora_b, scalings, compute_dtype`` of layers that share a node (:func:`fusable`).

    The compute dtype is the layers' own setting (None: see :func:`adapter_compute_dtype`).
    """
    return ([_base_weight(layer) for layer in layers], [layer.base_layer.bias for layer in layers],
            [layer.lora_A.weight for layer in layers], [layer.lora_B.weight for layer in layers],
            [layer.scaling for layer in layers], layers[0].lora_compute_dtype)


def project_together(x: torch.Tensor, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """Each of ``layers`` applied to ``x``: one node for LoRA layers that can share it, else one call each."""
    if len(layers) < 2 or not fusable(layers):
        return tuple(layer(x) for layer in layers)
    return lora_projections(x, *node_arguments(layers))


class FusedLoraLinear(LoraLinear):
    """A :class:`LoraLinear` whose forward is one autograd node; same parameters, same state dict.

    That node is :func:`lora_linear`, on a plain ``nn.Linear`` base or an NF4
    one (QLoRA). Falls back to the plain forward where it does not apply: a
    merged adapter, active dropout, or another base (fake-quant). ``lora_compute_dtype`` (see
    :func:`lora_linear`) is ``None`` unless :func:`entrenar.kernels.apply_kernels`
    was asked for another.
    """

    lora_compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_fused(self):
            return lora_projections(x, *node_arguments([self]))[0]
        return super().forward(x)
