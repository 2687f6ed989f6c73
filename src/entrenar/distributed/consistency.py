"""The replica contract of data parallelism: after every step all ranks hold identical trainable weights.

DDP keeps replicas identical only if every rank applies the same reduced gradients to the same weights with
the same optimizer state; a nondeterministic kernel, a rank that skipped a step, or a bit flip breaks that
silently. :func:`check_replicas` hashes each replicated tensor (trainable weights and their optimizer state)
on every rank, compares one digest per rank (one small all-gather), and on a mismatch names the step and the
first tensor that differs. Sharded tensors (FSDP) are not replicas and are not hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch import nn

from entrenar.distributed.world import World
from entrenar.errors import DistributedError


def _is_sharded(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def replicated_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainable parameters and their optimizer state, by name, skipping sharded ones."""
    for name, param in model.named_parameters():
        if not param.requires_grad or _is_sharded(param):
            continue
        yield name, param
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                yield f"{name} (optimizer {key})", value


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # the bytes: -0.0 != 0.0, NaN == NaN
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def tensor_digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, str]]:
    """(name, digest of its bytes) of every replicated tensor, in a fixed order."""
    return [(name, _digest(t)) for name, t in replicated_tensors(model, optimizer)]


def check_replicas(model: nn.Module, optimizer: torch.optim.Optimizer, world: World, step: int) -> None:
    """Raise :class:`DistributedError` naming ``step`` and the first tensor whose bytes differ between ranks."""
    if not world.distributed:
        return
    digests = tensor_digests(model, optimizer)
    summary = hashlib.blake2b("".join(f"{n}={d};" for n, d in digests).encode(), digest_size=16).hexdigest()
    summaries = world.all_gather(summary)
    if len(set(summaries)) == 1:
        return
    per_rank = world.all_gather(digests)  # only on a mismatch: names and digests of every tensor
    for i, (name, _) in enumerate(per_rank[0]):
        values = [ranked[i][1] if i < len(ranked) else None for ranked in per_rank]
        if len(set(values)) > 1:
            odd = [r for r, v in enumerate(values) if v != values[0]]
            raise DistributedError(f"step {step}: replicas diverged; '{name}' differs on rank(s) "
                                   f"{', '.join(map(str, odd))} from rank 0 (the run stops: its ranks no longer "
                                   "train one model)")
    raise DistributedError(f"step {step}: replicas diverged; the ranks hold different sets of trainable tensors")
