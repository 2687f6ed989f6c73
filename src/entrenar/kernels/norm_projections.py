"""RMSNorm and the LoRA projections that read its output, as one autograd node that does not keep that output.

In a decoder block the input norm feeds q, k and v and the post-attention
norm feeds gate and up. Run apart, the norm's node saves the block input
``h`` for its backward and the projections' node saves the normed ``x`` for
the adapters' ``dA = u^T x``: two [tokens, hidden] tensors where one would do.
Here the node saves ``h`` and the fp32 ``1/rms`` per row, and rebuilds ``x``
in backward with one more pass of the norm kernel (1 GiB less on the LoRA-1B
benchmark step, two such tensors per layer).

Forward and backward are those of :func:`entrenar.kernels.rmsnorm.rms_norm`
followed by :func:`entrenar.kernels.lora_linear.lora_projections`, in the same
precision, so the numbers equal the two nodes in turn.

:class:`FusedBlock` is the decoder block that uses it where its norms and
projections allow, and otherwise runs the norm and its module's projections
as the plain block does. When a checkpointed block reruns for backward
(:mod:`entrenar.models.recompute`), it skips the down projection's product
and the SwiGLU product before it: that rerun's output is thrown away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
from torch import nn

from entrenar.kernels._common import autocast_inputs
from entrenar.kernels.lora_linear import (
    FusedLoraLinear,
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
from entrenar.kernels.rmsnorm import rms_norm_and_rstd, rms_norm_backward
from entrenar.kernels.swiglu import FusedMLP
from entrenar.models.padding_free import Documents
from entrenar.models.recompute import recomputing
from entrenar.models.transformer import MLP, Attention, Block, KVCache, OffsetRMSNorm, RMSNorm


class _NormLoraProjections(torch.autograd.Function):
    """Autograd for ``lora_projections(rms_norm(h, norm_weight, eps), ...)``; arguments flattened:
    ``h, norm_weight, eps, n, *weights, *biases, *A, *B, scalings, dtype``."""

    @staticmethod
    def forward(ctx, h, norm_weight, eps: float, n: int, *args):
        weights, biases, lora_a, lora_b = (list(args[i * n:(i + 1) * n]) for i in range(4))
        scalings, compute_dtype = args[4 * n:]
        a, bs = adapters_in(lora_a, lora_b, compute_dtype)
        x, rstd = rms_norm_and_rstd(h, norm_weight, eps)
        outs, xa = lora_projections_forward(x.reshape(-1, x.shape[-1]), weights, biases, a, bs, scalings)
        save_bases(ctx, weights, h, norm_weight, rstd, xa, a, *bs)
        ctx.n, ctx.eps, ctx.scalings = n, eps, scalings
        ctx.adapter_dtypes = [t.dtype for t in (*lora_a, *lora_b)]
        return tuple(out.view(*h.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        n = ctx.n
        (h, norm_weight, rstd, xa, a, *bs), weights = saved_bases(ctx)
        need = ctx.needs_input_grad
        need_h, need_norm = need[0], need[1]
        need_w, need_bias = need[4:4 + n], need[4 + n:4 + 2 * n]
        x = rms_norm_and_rstd(h, norm_weight, ctx.eps, rebuild=True)[0].reshape(-1, h.shape[-1])
        grads = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
        dx, d_a, d_b = lora_projections_backward(grads, x, xa, weights, a, bs, ctx.scalings, need_h or need_norm,
                                                 ctx.adapter_dtypes[0])
        dh = d_norm = None
        if need_h or need_norm:
            dh, d_norm = rms_norm_backward(dx.view(h.shape), h, norm_weight, rstd)
        return (dh if need_h else None, d_norm if need_norm else None, None, None,
                *base_gradients(grads, x, weights, need_w, need_bias),
                *adapter_gradients(d_a, d_b, bs, ctx.adapter_dtypes), None, None)


def norm_lora_projections(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scalings: Sequence[float],
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """``lora_projections(rms_norm(h, norm_weight, eps), weights, ...)`` as one node that rebuilds the normed
    input in backward instead of keeping it. ``h`` and ``norm_weight`` share a dtype (see :func:`fits`)."""
    n = len(weights)
    compute_dtype = adapter_compute_dtype(h, lora_a[0], compute_dtype)
    (h, norm_weight, *bases), autocast_off = autocast_inputs(h, norm_weight, *(*weights, *biases))  # one unpack
    with autocast_off:
        return _NormLoraProjections.apply(h, norm_weight, float(eps), n, *bases, *lora_a, *lora_b,
                                          tuple(float(s) for s in scalings), compute_dtype)


def fits(h: torch.Tensor, norm: nn.Module, layers: Sequence[nn.Module]) -> bool:
    """True if ``layers`` applied to ``norm(h)`` can run as one :func:`norm_lora_projections` node.

    The norm is an RMSNorm (not Gemma's offset one) whose weight has ``h``'s dtype, and under autocast
    that is autocast's dtype too (so the norm's output is the same with or
    without it), and the layers can share a LoRA node
    (:func:`entrenar.kernels.lora_linear.fusable`).
    """
    device = h.device.type
    return (
        isinstance(norm, RMSNorm) and not isinstance(norm, OffsetRMSNorm)  # Gemma's (1 + w) rounds otherwise
        and norm.weight.dtype == h.dtype and norm.weight.shape == h.shape[-1:]
        and (not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == h.dtype)
        and fusable(layers)
    )


def norm_then_project(
    h: torch.Tensor, norm: nn.Module, layers: Sequence[nn.Module], project: Callable[[torch.Tensor], tuple]
) -> tuple[torch.Tensor, ...]:
    """Each of ``layers`` applied to ``norm(h)``: by :func:`norm_lora_projections` where :func:`fits` allows,
    else ``project(norm(h))`` (the module's own projections of those layers)."""
    if not fits(h, norm, layers):
        return project(norm(h))
    rms = cast(RMSNorm, norm)  # fits() checked
    return norm_lora_projections(h, rms.weight, rms.eps, *node_arguments(cast(Sequence[FusedLoraLinear], layers)))


class FusedBlock(Block):
    """A decoder :class:`Block` whose norms run inside the LoRA nodes of the projections they feed (q, k, v;
    gate, up) where :func:`fits` allows; elsewhere the norm, then its module's projections. Same state dict."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        # dense, q/k/v attention: apply_kernels keeps MoE, MLA and post-norm blocks plain
        attn, mlp = cast(Attention, self.self_attn), cast(MLP, self.mlp)
        m = self.residual_multiplier  # Granite's; 1 elsewhere
        q, k, v = attn.split(norm_then_project(x, self.input_layernorm, attn.projections,
                                               partial(project_together, layers=attn.projections)))
        out = attn.attend(q, k, v, cos, sin, mask, cache)
        x = x + (out if m == 1.0 else out * m)
        if self.tiles_mlp(x):  # models/tiled.py: its node skips the tiles in a checkpointed rerun itself
            out = self.tiled_feed_forward(x)
            return x + (out if m == 1.0 else out * m)
        gate, up = self._gate_up(x)
        if recomputing() and isinstance(mlp, FusedMLP):  # a checkpointed rerun: backward reads what combine saves
            return mlp.combine(gate, up, output_needed=False)
        out = mlp.combine(gate, up)
        return x + (out if m == 1.0 else out * m)

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mlp = cast(MLP, self.mlp)
        return mlp.split(norm_then_project(x, self.post_attention_layernorm, mlp.projections,
                                           partial(project_together, layers=mlp.projections)))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half with the post-attention norm inside the gate/up LoRA node where it fits."""
        return cast(MLP, self.mlp).combine(*self._gate_up(x))
