"""Fused GPU kernels, applied to a model from outside.

Each fused op lives in its own file beside its plain PyTorch specification:

* :mod:`.rmsnorm` - RMSNorm forward and backward, Gemma's ``1 + weight`` norm too (Triton);
* :mod:`.rope` - RoPE on q and k together (Triton);
* :mod:`.swiglu` - ``silu(gate) * up`` forward and backward (Triton);
* :mod:`.geglu` - Gemma's ``gelu_tanh(gate) * up`` forward and backward (Triton);
* :mod:`.fused_linear_ce` - output projection + cross-entropy in chunks, no full logits (Triton + cuBLAS);
* :mod:`.lora_linear` - LoRA and its frozen base as one node with a hand-written backward (PyTorch);
* :mod:`.norm_projections` - a block's RMSNorm inside the LoRA node of the projections it feeds;
* :mod:`.moe_routing` - the MoE grouped path's routed activation and gather-sum (Triton).

:func:`apply_kernels` swaps the fused versions into a model by changing the
class of its modules to a subclass that overrides only ``forward``, so
parameters, buffers, module names, state dicts and ``isinstance`` checks stay
as they were (MoE experts, quantized or wrapped by LoRA, instead get the fused
routing steps as their ``routing_ops``), and :func:`remove_kernels` undoes it. Every fused forward falls
back to the specification wherever its kernel cannot run (CPU tensors, no
Triton, unusual shapes), so a model with kernels applied works everywhere.

The loss is not a module: a training step calls
:func:`fused_linear_cross_entropy` on ``model.hidden_states(...)`` and
``model.lm_head.weight`` instead of :func:`entrenar.models.loss.chunked_cross_entropy`.
"""

from __future__ import annotations

import torch
from torch import nn

from entrenar.adapters.lora import LoraLinear
from entrenar.errors import ConfigError
from entrenar.kernels._common import triton_available
from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy
from entrenar.kernels.geglu import FusedGatedMLP, geglu
from entrenar.kernels.lora_linear import FusedLoraLinear, lora_linear
from entrenar.kernels.moe_routing import FUSED_ROUTING_OPS
from entrenar.kernels.norm_projections import FusedBlock
from entrenar.kernels.rmsnorm import FusedOffsetRMSNorm, FusedRMSNorm, offset_rms_norm, rms_norm
from entrenar.kernels.rope import FusedRopeAttention, apply_rope
from entrenar.kernels.swiglu import FusedMLP, swiglu
from entrenar.models.moe import Experts
from entrenar.models.transformer import MLP, Attention, Block, GatedMLP, OffsetRMSNorm, RMSNorm

KERNELS = ("rms_norm", "rope", "swiglu", "geglu", "lora", "moe_routing")

# kernel name -> its (plain class, fused subclass) pairs
_SWAPS: dict[str, tuple[tuple[type[nn.Module], type[nn.Module]], ...]] = {
    "rms_norm": ((RMSNorm, FusedRMSNorm), (OffsetRMSNorm, FusedOffsetRMSNorm)),
    "rope": ((Attention, FusedRopeAttention),),
    "swiglu": ((MLP, FusedMLP),),
    "geglu": ((GatedMLP, FusedGatedMLP),),
    "lora": ((LoraLinear, FusedLoraLinear), (Block, FusedBlock)),
    "moe_routing": (),  # not a class swap: every Experts module (any subclass) gets FUSED_ROUTING_OPS
}


def apply_kernels(
    model: nn.Module, kernels: tuple[str, ...] | list[str] = KERNELS, lora_compute_dtype: torch.dtype | None = None
) -> list[str]:
    """Swap the fused forward of each named kernel into ``model``; return the names of the modules changed.

    Only modules whose class is exactly the plain one are changed, so
    subclasses with forwards of their own are left alone and applying twice
    changes nothing. ``lora_compute_dtype=torch.bfloat16`` runs the adapter
    products of a bf16 model in bf16 (see :func:`lora_linear`); the default
    keeps the adapters' own dtype, as the plain path does.
    """
    unknown = [k for k in kernels if k not in _SWAPS]
    if unknown:
        raise ConfigError(f"apply_kernels: unknown kernels {unknown}; known: {', '.join(KERNELS)}")
    by_class = {plain: fused for k in kernels for plain, fused in _SWAPS[k]}
    changed = []
    for name, module in model.named_modules():
        fused = by_class.get(type(module))
        if fused is FusedBlock and not block_fusable(module):
            fused = None  # MoE, MLA and post-norm blocks keep their own forward
        if fused is not None:
            module.__class__ = fused
            changed.append(name)
        elif "moe_routing" in kernels and isinstance(module, Experts) and "routing_ops" not in module.__dict__:
            module.routing_ops = FUSED_ROUTING_OPS
            changed.append(name)
        if isinstance(module, FusedLoraLinear) and lora_compute_dtype is not None:
            module.lora_compute_dtype = lora_compute_dtype
    return changed


def block_fusable(block: Block) -> bool:
    """Whether :class:`FusedBlock` can run this block: a dense MLP and q/k/v attention (not an MoE or MLA layer),
    with a norm feeding the projections and none after them (not OLMo 2's post-norm blocks, nor GLM-4's
    post_block_norms). Phi-3's fused qkv_proj / gate_up_proj run as one node each."""
    return (isinstance(block.mlp, MLP) and isinstance(block.self_attn, Attention) and not block.post_norm
            and not block.post_block_norms)


def remove_kernels(model: nn.Module) -> list[str]:
    """Put the plain forwards back; return the names of the modules changed."""
    plain_of = {fused: plain for pairs in _SWAPS.values() for plain, fused in pairs}
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, Experts) and module.__dict__.pop("routing_ops", None) is not None:
            changed.append(name)
        plain = plain_of.get(type(module))
        if plain is not None:
            module.__dict__.pop("lora_compute_dtype", None)
            module.__class__ = plain
            changed.append(name)
    return changed


__all__ = [
    "KERNELS",
    "FusedBlock",
    "FusedGatedMLP",
    "FusedLoraLinear",
    "FusedMLP",
    "FusedOffsetRMSNorm",
    "FusedRMSNorm",
    "FusedRopeAttention",
    "apply_kernels",
    "apply_rope",
    "block_fusable",
    "fused_linear_cross_entropy",
    "geglu",
    "lora_linear",
    "FUSED_ROUTING_OPS",
    "offset_rms_norm",
    "remove_kernels",
    "rms_norm",
    "swiglu",
    "triton_available",
]
