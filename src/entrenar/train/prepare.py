"""Everything applied to the model before training, in one documented order, as torchtitan's parallelize does.

    model, tokenizer = load_model(recipe, task, plan)       # load, QAT, LoRA, the task's own trainable parts
    prepared = prepare(model, recipe, plan, world)           # the rest, below, in this order

1. QAT fake quantization (before LoRA, which then wraps the fake-quantized layers: LoRA-QAT)    build_model
2. LoRA adapters (or the adapter ``model.path`` brought, trained on), then the task's trainable    build_model
   parts (a classifier's head)
3. the frozen embedding table to pinned CPU memory (``training.offload_embeddings``)
4. activation checkpointing and activation offload (``training.activation_checkpointing``, ``offload_activations``)
5. fused kernels swapped into the modules (``training.kernels``), and the packed rows' attention kernel
   (``training.attention_kernel``: FlashAttention-2 or -4)
6. the NF4 base streamed from CPU memory block by block (``training.offload_weights``)
7. MoE training hooks (router losses, balancing, diagnostics)
8. ``torch.compile`` of each decoder block (``training.compile``)
9. DDP (flat gradients or torch's DDP) or FSDP2 from outside (``training.parallel``): the step model the
   micro-step calls
10. context parallelism around it (``training.context_parallel``): each row split over a group of ranks

The model itself knows nothing of any of this: each step wraps or replaces modules from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from entrenar.adapters.layer import RankError
from entrenar.adapters.lora import apply_lora, continue_adapter, lora_config_of, lora_layers
from entrenar.config import Recipe
from entrenar.data.tokenizer import Tokenizer
from entrenar.distributed.context_parallel import context_parallel
from entrenar.distributed.flat_grads import FlatReplicated
from entrenar.distributed.parallelize import Single, parallelize
from entrenar.distributed.world import World
from entrenar.errors import AdapterError, ConfigError
from entrenar.kernels import apply_kernels
from entrenar.kernels.host_embedding import offload_embeddings
from entrenar.loading import require_tokenizer
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.streaming import nf4_in_host_memory, stream_weights
from entrenar.quant.qat import apply_qat_recipe, lora_qat_layers
from entrenar.tasks.base import Task
from entrenar.train.moe import MoeTraining, moe_training
from entrenar.train.plan import RunPlan


@dataclass
class Prepared:
    """The model as the Trainer steps it."""

    model: Transformer  # the plain model (eval, saving, checkpoints read and write it)
    step_model: Single  # what the micro-step calls: the model, or its DDP/FSDP wrapper
    moe: MoeTraining | None  # router losses, balancing and diagnostics (None for a dense model)
    cuda_graphs: bool  # resolved with the built MoE layers (:meth:`RunPlan.graphs`)
    trainable: list[nn.Parameter]


def load_model(recipe: Recipe, task: Task, plan: RunPlan) -> tuple[Transformer, Tokenizer]:
    """:func:`build_model` as the plan says: its dtype, device and quantization."""
    with nf4_in_host_memory(plan.offload_weights):  # a streamed base is never all on the GPU, not even loading
        return build_model(recipe, task, plan.weights_dtype, plan.load_device, plan.quantize)


def build_model(recipe: Recipe, task: Task, dtype: str, device: torch.device, quantize: str | None
                ) -> tuple[Transformer, Tokenizer]:
    """(model, tokenizer) as the run trains them: loaded by the task (steps 1-2 above), in train mode. Also what
    ``entrenar diagnose`` builds."""
    model, tokenizer = task.load(dtype, device, quantize)
    tokenizer = require_tokenizer(tokenizer, recipe.model.path)  # the data needs one
    model.train()
    lora = lora_config_of(recipe.lora)
    continued = lora is not None and next(lora_layers(model), None) is not None
    if continued and recipe.qat is not None:
        raise ConfigError(f"qat: {recipe.model.path} brings a trained adapter; QAT wraps the base layers before "
                          "LoRA does, so start from the base model")
    if recipe.qat is not None:
        apply_qat_recipe(model, recipe.qat, None if lora is None else lora.target_modules)
    if lora is not None and continued:
        # model.path brought an adapter (a PEFT folder, a LoRA run): it trains on from its weights
        continue_adapter(model, lora, str(recipe.model.path))
    elif lora is not None:
        try:
            apply_lora(model, lora)
        except AdapterError as e:
            raise AdapterError(f"lora.{'r' if isinstance(e, RankError) else 'target_modules'}: {e}") from None
        if recipe.qat is not None:
            lora_qat_layers(model, recipe.qat)  # the learned steps train beside the adapters (LoRA froze them)
    task.prepare(model)
    return model, tokenizer


def prepare(model: Transformer, recipe: Recipe, plan: RunPlan, world: World) -> Prepared:
    """Steps 3-9 above, as the plan decided them."""
    t = recipe.training
    if plan.offload_embeddings:
        _as_setting("offload_embeddings", offload_embeddings, model)
    _as_setting("activation_checkpointing", model.set_activation_checkpointing, t.activation_checkpointing)
    _as_setting("offload_activations", model.set_activation_offload, t.offload_activations)
    if t.tiled_mlp and not model.set_tiled_mlp(t.tiled_mlp):
        raise ConfigError("training.tiled_mlp: no layer of this model has a dense MLP to tile (MoE layers keep "
                          "theirs whole); set it to 0")
    if plan.kernels:
        apply_kernels(model, lora_compute_dtype=plan.lora_compute_dtype)  # same parameters and names
    model.set_attention_kernel(plan.attention_kernel)
    if plan.offload_weights:
        stream_weights(model, plan.device)
    moe = moe_training(model, recipe, plan.accumulation, world)
    if plan.compile:
        # Block by block, not the whole step: compiled around torch.utils.checkpoint, the step held 10-22 GiB
        # more at the Llama-8B shape (the recomputation was undone; docs/PERFORMANCE.md). Per block,
        # checkpointing and offload keep their saving.
        for block in model.model.layers:
            block.compile()
    # ddp over a small trainable set: the model unwrapped, one flat all-reduce a step (graphs and overlap stay).
    step_model = FlatReplicated(model, world) if plan.flat_gradients else \
        parallelize(model, plan.mode, world, plan.device, t.precision, prefetch=t.fsdp_prefetch,
                    shard_files=plan.shard_files)
    if plan.context_parallel > 1:  # each row split over cp ranks; DDP/FSDP over the whole world inside
        step_model = context_parallel(step_model, world, plan.context_parallel, plan.device)
    graphs = plan.graphs(moe is None or moe.replayable(plan.device, plan.compute_dtype))
    return Prepared(model, step_model, moe, graphs, [p for p in model.parameters() if p.requires_grad])


def _as_setting(key: str, apply: Any, *args: Any) -> None:
    """``apply(*args)``, its refusal (a ValueError, or ConfigError from a kernel) named by its recipe key."""
    try:
        apply(*args)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"training.{key}: {e}") from None


__all__ = ["Prepared", "build_model", "load_model", "prepare"]
