"""Loading a sharded (FSDP) model without a whole copy on every rank: the meta device, then rank 0's broadcast.

Rank 0 builds the model as one process would (weights read from the files, adapters and a classifier's head
drawn from the seed); every other rank builds the same structure on the meta device (nothing allocated, only the
files' headers read). After ``fully_shard``, :func:`materialize` allocates each rank's shards and fills them from
rank 0's full state dict (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``: one tensor at
a time is broadcast, each rank keeps its shard).

Why rank 0 reads and broadcasts rather than each rank reading its slices of the safetensors files: every value
a model starts from is then the one a single process would start from, whatever made it (a Hugging Face folder,
a GGUF file, a quantized folder, a run folder, a random init, LoRA's and a head's random draws, QAT's
quantizers), through the one loader the single process uses; slicing would have to be taught to each of those
sources, and the random draws of adapters and heads cannot be sliced and stay equal to a one-process run.
The cost: rank 0 holds the whole model once (as every rank did before) and sends it once over the process
group; the other ranks hold their shards only (1/world of the model, plus one tensor in flight). Where nothing
but the folder's tensors is needed (a full fine-tune of a Hugging Face folder), the plan has every rank read its
own slices instead (:mod:`entrenar.distributed.shard_read`), and this path is not taken.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from entrenar.distributed.world import World

META = torch.device("meta")


def load_device(world: World) -> torch.device:
    """Where a rank of an FSDP run builds its model: rank 0 on the CPU, the others on the meta device."""
    return torch.device("cpu") if world.is_main else META


def full_state(model: nn.Module, world: World) -> dict[str, torch.Tensor] | None:
    """Rank 0's whole state dict (its tensors, kept alive through ``fully_shard``), empty on the other ranks;
    None when there is nothing to send (one process)."""
    if not world.distributed or world.size == 1:
        return None
    return dict(model.state_dict()) if world.is_main else {}


def materialize(model: nn.Module, state: dict[str, torch.Tensor] | None, world: World,
                device: torch.device) -> None:
    """After ``fully_shard``: allocate the meta ranks' shards and fill every rank's from rank 0's ``state``.

    Non-persistent buffers (RoPE's frequencies) are not in a state dict and are broadcast as they are; the torch
    generator continues from rank 0's (which drew the adapters' initial values), as on a resumed run.
    """
    if state is None:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, ValueType, set_model_state_dict

    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    # torch takes dict[str, ValueType], which (dict being invariant) a dict of tensors does not match
    full = cast(dict[str, ValueType], state)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    state.clear()  # rank 0: the whole tensors go once the shards hold them
    with torch.no_grad():
        for module in model.modules():
            if not getattr(module, "holds_shards", False):  # a sharded NF4 base's chunks differ by rank
                for buffer in module.buffers(recurse=False):
                    _broadcast(buffer, device)
    rng: list[Any] = [torch.get_rng_state()]
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])


def _broadcast(tensor: torch.Tensor, device: torch.device) -> None:
    if type(tensor).__name__ == "DTensor":
        return  # a sharded buffer came with the state dict
    moved = tensor.to(device)
    dist.broadcast(moved, src=0)
    if moved is not tensor:
        tensor.copy_(moved)
