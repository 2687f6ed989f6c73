"""Data parallelism applied to a plain model from outside, as torchtitan does: DDP or FSDP2.

:func:`parallelize` takes the model the loop built (adapters, quantization, kernels already in place) and gives
back what the loop's micro-step calls: ``step_model(...)`` and ``step_model.hidden_states(...)`` run the
model's forward through the wrapper, and ``step_model.sync(last)`` says whether this micro-batch's backward
reduces gradients. The model object stays the loop's ``model`` for everything else (eval, saving); its code
knows nothing of any of this.

- ``ddp``: every rank holds a replica; only trainable parameters are broadcast and all-reduced (frozen bases,
  NF4 codes and buffers are ignored by DDP), buckets are sized for adapters, and accumulation micro-steps
  skip the all-reduce (``no_sync``). For LoRA/QLoRA and full fine-tunes that fit one device.
- ``fsdp``: ``fully_shard`` on each decoder block, then on the root (embeddings, final norm and head in one
  group, so tied embeddings stay one parameter); parameters, gradients and optimizer state are sharded.
  Gradients are reduce-scattered on every micro-step, so unsharded gradients never pile up.
  With ``training.fsdp_prefetch`` (the default) each block's all-gathers, its parameters' and its sharded NF4
  base's, are issued one block ahead, forward and backward (:func:`set_block_prefetch`,
  :func:`~entrenar.quant.nf4.sharding.prefetch_nf4`).

Both average gradients over ranks; the loop divides each rank's token-summed loss by the global step's target
tokens over ``world.size``, so the sum of what they average is the one-process gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from entrenar.distributed.materialize import full_state, materialize
from entrenar.distributed.shard_read import read_shards
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.quant.nf4.sharding import BlockGather, prefetch_nf4, scatter_nf4, shard_nf4_layers

MiB = 2**20


class Single:
    """One process: the model itself, gradients always kept."""

    mode = "single"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(*args, **kwargs)

    def hidden_states(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = cast(Callable[..., torch.Tensor], self.model.hidden_states)  # a method, not a Tensor or Module
        return forward(*args, **kwargs)

    def sync(self, last: bool) -> AbstractContextManager:
        return nullcontext()

    def carry(self, values: torch.Tensor) -> torch.Tensor | None:
        """Hand this rank's ``values`` (a small fp32 vector, called inside the step's last :meth:`sync`) to the
        collective that reduces the step's gradients when that context ends: the tensor returned then holds their
        mean over the ranks. None where there is no such collective to ride (one process, torch's DDP, FSDP):
        the caller reduces them itself."""
        return None


class _Entry(nn.Module):
    """What DDP wraps: one forward that runs any of the model's forward methods, so ``hidden_states`` (the fused
    loss's entry) also passes through DDP's forward, which arms its gradient hooks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(*args, **kwargs) if method == "forward" else getattr(self.model, method)(*args, **kwargs)


class Replicated(Single):
    """DDP over the trainable parameters."""

    mode = "ddp"

    def __init__(self, model: nn.Module, world: World, device: torch.device) -> None:
        super().__init__(model)
        from torch.nn.parallel import DistributedDataParallel

        entry = _Entry(model)
        frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
        buffers = [f"model.{n}" for n, _ in model.named_buffers()]
        # Identical on every rank already (read from the same files); broadcasting a frozen base would cost as
        # much as the model and reducing it nothing.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(entry, frozen + buffers)
        trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.ddp = DistributedDataParallel(
            entry,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=bucket_mb(trainable_bytes),
            gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy of them
        )

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.ddp("forward", *args, **kwargs)

    def hidden_states(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.ddp("hidden_states", *args, **kwargs)

    def sync(self, last: bool) -> AbstractContextManager:
        """All-reduce only on the last micro-batch of a step; the others accumulate locally."""
        return nullcontext() if last else self.ddp.no_sync()


class Sharded(Single):
    """FSDP2: each decoder block and the root sharded over the ranks."""

    mode = "fsdp"

    def __init__(self, model: nn.Module, world: World, device: torch.device, precision: str,
                 prefetch: bool = True, shard_files: dict[str, tuple[Path, str]] | None = None) -> None:
        super().__init__(model)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mesh = init_device_mesh(device.type, (world.size,))
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # All-gathers in the compute dtype (half the traffic of fp32 master weights); gradients reduced in fp32.
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        layers = list(cast(nn.ModuleList, cast(nn.Module, model.model).layers))  # the decoder's blocks
        nf4 = shard_nf4_layers(model, world)  # a QLoRA base: each rank keeps its chunks (before the state below)
        # rank 0's whole tensors (the other ranks built the model on meta), or nothing: every rank built it on
        # meta and reads its own shards from the files
        state = full_state(model, world) if shard_files is None else None
        for i, block in enumerate(layers):
            # The last block's parameters are needed again at once by backward: keep them gathered.
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if shard_files is not None:
            read_shards(model, shard_files, device)  # each rank's shards, from the files
        else:
            materialize(model, state, world, device)  # each rank's shards, from rank 0
        scatter_nf4(nf4, world, device)
        register_fsdp_forward_method(model, "hidden_states")
        self.nf4_gathers: list[BlockGather] = []
        if prefetch:
            set_block_prefetch(layers)
            self.nf4_gathers = prefetch_nf4(layers, world)


def set_block_prefetch(blocks: list[nn.Module]) -> None:
    """FSDP2's explicit prefetching over the decoder's blocks (each already ``fully_shard``-ed): entering block
    i's forward issues block i + 1's all-gather, entering block i's backward issues block i - 1's, so the next
    block's parameters travel while this one computes (FSDP2 on its own issues a forward all-gather only when
    its block is called, which a GPU running behind the CPU hides but a CPU-bound step does not)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [cast(FSDPModule, b) for b in blocks]
    for i, block in enumerate(sharded):
        if i + 1 < len(sharded):
            block.set_modules_to_forward_prefetch([sharded[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([sharded[i - 1]])


def bucket_mb(trainable_bytes: int) -> float:
    """DDP bucket size: about eight buckets of an adapter's gradients (so the all-reduce of the last layers'
    overlaps backward of the first), between 1 MiB and DDP's default 25 MiB."""
    return float(min(25.0, max(1.0, trainable_bytes / 8 / MiB)))


def parallelize(model: nn.Module, mode: str, world: World, device: torch.device, precision: str = "fp32",
                prefetch: bool = True, shard_files: dict[str, tuple[Path, str]] | None = None) -> Single:
    """Wrap ``model`` for ``mode`` (``single``, ``ddp`` or ``fsdp``: the run plan's ``training.parallel``);
    ``prefetch`` (fsdp: ``training.fsdp_prefetch``) issues each block's all-gathers one block ahead;
    ``shard_files`` (fsdp, the plan's): every rank built ``model`` on meta and reads its shards from these files
    (:mod:`~entrenar.distributed.shard_read`)."""
    if mode == "single":
        return Single(model)
    if mode == "ddp":
        return Replicated(model, world, device)
    if mode == "fsdp":
        return Sharded(model, world, device, precision, prefetch, shard_files)
    raise ConfigError(f"training.parallel must be ddp, fsdp or auto, got {mode!r}")
