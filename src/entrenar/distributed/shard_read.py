"""An FSDP run whose every weight is one tensor of a Hugging Face folder: each rank reads its own shards.

The general path (:mod:`entrenar.distributed.materialize`) has rank 0 read the whole model into its CPU memory
and broadcast it tensor by tensor. Where every parameter of the model is a tensor of the folder's safetensors
files under the same name and shape (a full fine-tune of a causal LM, nothing drawn at random: no adapters, no
head, no quantizers), nothing needs rank 0: every rank builds the model on the meta device, ``fully_shard``
splits it, and each rank reads the rows of its own shard of each tensor straight from the files (safetensors'
``get_slice``) onto its device. The values are the same bits: the slice of the file's tensor, cast as the
whole-model load casts it (``copy_`` into the weights' dtype; the widening bf16 -> fp32 of a full fine-tune is
exact). On a 403M-parameter model on 2 gloo processes the model's part of the start-up (load to sharded) went
from 4.9-12.1 s to 1.6-2.9 s, and no rank holds the whole model any more (docs/DISTRIBUTED.md,
bench/fsdp_startup.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from entrenar.errors import DistributedError
from entrenar.io.hf_files import weight_files
from entrenar.io.safetensors_dtypes import SAFETENSORS_DTYPES
from entrenar.models.config import ModelConfig, rope_inv_freq
from entrenar.models.transformer import Transformer

# Computed from the config by every loader (RoPE's frequencies): the one buffer a model read this way may hold.
COMPUTED_BUFFERS = {"inv_freq"}


def shard_index(folder: str | Path, config: ModelConfig) -> tuple[dict[str, tuple[Path, str]] | None, str]:
    """Which file and tensor hold each parameter of a model of ``config`` (by the parameter's name), read from the
    safetensors headers only; None, with why, when some parameter is not exactly one floating-point tensor of its
    name and shape (stacked or renamed experts, an MXFP4 layout, extra tensors): such a folder takes the general
    path. A tied head stored beside its embedding is read from whichever of the two the whole-model load copies
    last (both go into the one parameter there)."""
    if config.model_type == "gpt_oss":
        return None, "gpt-oss's experts are stored in their own layout"
    with torch.device("meta"):
        model = Transformer(config)
    buffers = {name for name, _ in model.named_buffers()}
    if not buffers <= COMPUTED_BUFFERS:
        return None, f"the model holds buffers read from the files ({', '.join(sorted(buffers - COMPUTED_BUFFERS))})"
    params = dict(model.named_parameters())  # a tied head once, under the embedding's name
    canonical = {alias: name for alias, p in model.named_parameters(remove_duplicate=False)
                 for name, q in params.items() if p is q}
    index: dict[str, tuple[Path, str]] = {}
    stored: set[str] = set()
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older checkpoints store RoPE's buffer; every loader computes it
                piece = reader.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                if name not in canonical or name in stored:
                    return None, f"{f.name} holds '{name}', which is not one parameter of the model"
                param = canonical[name]
                if dtype is None or not dtype.is_floating_point or list(piece.get_shape()) != list(params[param].shape):
                    return None, f"{f.name}: '{name}' is not a floating-point tensor of the parameter's shape"
                stored.add(name)
                index[param] = (f, name)  # the whole-model load's order: the last one stays
    missing = [name for name in params if name not in index]
    if missing:
        return None, f"no tensor in the files for {missing[0]}"
    return index, "every rank reads its own shards from the files"


def read_shards(model: nn.Module, index: dict[str, tuple[Path, str]], device: torch.device) -> None:
    """After ``fully_shard`` of a model built on the meta device: allocate this rank's shards on ``device`` and
    fill each from its rows of the file tensor ``index`` names; RoPE's frequencies computed as every loader
    computes them. The torch generator is rank 0's afterwards, as after :func:`~.materialize.materialize`."""
    made = sorted(name for name, _ in model.named_buffers() if name not in COMPUTED_BUFFERS)
    if made:  # nothing holds their values on a meta rank: the plan should have taken the general path
        raise DistributedError(f"the sharded model holds buffers no file has ({', '.join(made)})")
    model.to_empty(device=device)
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if name not in index:  # the plan indexed the model as built; nothing may rename a parameter since
            raise DistributedError(f"parameter {name} of the sharded model has no tensor in the files' index")
        f, stored = index[name]
        by_file.setdefault(f, []).append((stored, param))
    with torch.no_grad():
        for f, params in by_file.items():
            with safe_open(str(f), framework="pt") as reader:
                for stored, target in params:
                    local, slices = _local_rows(target)
                    if local.numel():
                        piece = reader.get_slice(stored)[slices]
                        local.copy_(piece.to(local.device))  # the cast on the device: the same bits
    root = cast(Transformer, model)
    root.inv_freq = rope_inv_freq(root.config).to(device)
    if dist.is_initialized():
        rng: list[Any] = [torch.get_rng_state()]
        dist.broadcast_object_list(rng, src=0)
        torch.set_rng_state(rng[0])


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's part of ``param``, the slices of the whole tensor it holds)."""
    if type(param).__name__ != "DTensor":
        return param, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sharded = cast(Any, param)
    shape, offset = compute_local_shape_and_global_offset(param.shape, sharded.device_mesh, sharded.placements)
    local = sharded.to_local()
    assert tuple(local.shape) == tuple(shape) and math.prod(shape) == local.numel()
    return local, tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))
