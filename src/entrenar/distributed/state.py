"""A sharded (FSDP2) model's state as one process holds it, for the checkpoint and output code as it is.

Under ``fully_shard`` each parameter is a DTensor holding this rank's shard. :func:`full_params` swaps every
sharded parameter for a plain one holding the whole tensor (gathered on every rank, kept in CPU memory) for
the duration of a ``with`` block, so ``named_parameters()``, ``save_adapter`` and ``save_merged`` read full
tensors; with ``write_back=True`` what the block copied into them (a resumed checkpoint) is scattered back
into the shards. :func:`full_optimizer` does the same for the optimizer's state. Both are collectives: every
rank enters them, in the same order. For a single process or DDP they change nothing.

The checkpoint is then the single-process format (rank 0 writes it), which any number of processes resumes.
The cost: each rank holds the full trainable state in CPU memory while it is saved or loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn


def is_dtensor_shard(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor: this rank's shard of a value ``fully_shard`` split across the ranks."""
    return type(tensor).__name__ == "DTensor"


def gather_whole(tensor: Any) -> torch.Tensor:
    """A DTensor's full value as a plain CPU tensor of its own (a collective: every rank calls it)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor.full_tensor())  # a copy: what full_tensor() returns may be a view of a collective's buffer
    return out


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor_shard(p) for p in model.parameters())


@contextmanager
def full_params(model: nn.Module, write_back: bool = False, trainable_only: bool = False) -> Iterator[None]:
    """Within the block, every sharded parameter of ``model`` is a plain full CPU one (tied ones stay tied);
    with ``trainable_only``, only those that train (an adapter's output needs no frozen base gathered)."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # groups left gathered after a forward (the root, the last block) register shards again
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    full: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not is_dtensor_shard(param) or (trainable_only and not param.requires_grad):
                continue
            if id(param) not in full:
                full[id(param)] = nn.Parameter(gather_whole(param.detach()), requires_grad=param.requires_grad)
            swapped.append((module, name, param))
            module._parameters[name] = full[id(param)]
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
    if write_back:
        from torch.distributed.tensor import DTensor, distribute_tensor

        done: set[int] = set()
        with torch.no_grad():
            for _, _, param in swapped:
                if id(param) in done:
                    continue
                done.add(id(param))
                whole = full[id(param)].detach().to(param.device, param.dtype)
                shard = cast(DTensor, param)  # only sharded parameters were swapped
                shard.to_local().copy_(distribute_tensor(whole, shard.device_mesh, shard.placements).to_local())


class _FullOptimizer:
    """An optimizer seen as one process would hold it: ``state_dict()`` with full tensors, ``load_state_dict()``
    scattering full tensors into the shards. ``param_groups`` are the optimizer's own (shapes are global)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gather: bool) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self._full = self._gathered() if gather else None

    def _gathered(self) -> dict:
        state = self.optimizer.state_dict()
        state["state"] = {i: {k: gather_whole(v) if is_dtensor_shard(v) else v for k, v in s.items()}
                          for i, s in state["state"].items()}
        return state

    def state_dict(self) -> dict | None:
        return self._full  # None on a view made to load into (gather=False)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.tensor import distribute_tensor

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        ids = [i for group in state["param_groups"] for i in group["params"]]
        by_id = dict(zip(ids, params))
        for i, entry in state["state"].items():
            param = by_id[i]
            if not is_dtensor_shard(param):
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0:
                    entry[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        self.optimizer.load_state_dict(state)


def full_optimizer(optimizer: torch.optim.Optimizer, gather: bool = True) -> Any:
    """``optimizer`` itself, or for sharded parameters a view with full tensors (gathered now, on every rank,
    unless ``gather`` is False: a view to load into)."""
    sharded = any(is_dtensor_shard(p) for group in optimizer.param_groups for p in group["params"])
    return _FullOptimizer(optimizer, gather) if sharded else optimizer


def main_writes(world: Any, model: nn.Module, fn: Any, *args: Any, trainable_only: bool = False,
                **kwargs: Any) -> Any:
    """``fn(*args)`` on rank 0 (``World.main_only``) while ``model``'s parameters (or its trainable ones) are
    whole on every rank."""
    with full_params(model, trainable_only=trainable_only):
        return world.main_only(fn, *args, **kwargs)
