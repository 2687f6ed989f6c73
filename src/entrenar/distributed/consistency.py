"""The replica contract of data parallelism: after every step all ranks hold identical trainable weights.

DDP keeps replicas identical only if every rank applies the same reduced gradients to the same weights with
the same optimizer state; a nondeterministic kernel, a rank that skipped a step, or a bit flip breaks that
silently. :class:`ReplicaCheck` sums the bytes of every replicated tensor (trainable weights and their optimizer
state) on its own device, twice (plainly, and weighted by each byte's position), in chunks of 16 MiB that run
across tensors (a LoRA model's hundreds of small tensors take a few chunks, not a few launches each), all-gathers
the sums on the device and compares them there: nothing waits for the device, and the verdict is read at the next
check, at a step that saves or evaluates, or at the end (:meth:`ReplicaCheck.settle`), when the device has long
finished. Only on a mismatch does it sum tensor by tensor, to name the step and the first tensor that differs.
The tensors' names, dtypes and shapes are compared once, at the first check. Sharded tensors (FSDP) are not
replicas and are not checked.

Hashing each tensor on the host instead copied every tensor to the CPU one by one: on 4 H200s the check step of
the LoRA-1B benchmark ran at a quarter of the others' rate (about 0.4 s; docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from entrenar.distributed.state import is_dtensor_shard
from entrenar.distributed.world import World
from entrenar.errors import DistributedError


def replicated_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainable parameters and their optimizer state, by name, skipping sharded ones."""
    for name, param in model.named_parameters():
        if not param.requires_grad or is_dtensor_shard(param):
            continue
        yield name, param
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                yield f"{name} (optimizer {key})", value


# Bytes summed per chunk as int64: 255 x 65,521 x 2^24 stays far inside int64, and the chunk's int64 copy is 128 MiB.
_CHUNK_BYTES = 1 << 24
_WEIGHT_MODULUS = 65521  # a prime: position weights 1..65521 repeat with a period no tensor layout shares


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _chunk_sums(chunk: torch.Tensor, start: int) -> torch.Tensor:
    """``[2]`` int64: the sum of ``chunk``'s bytes and of each byte times a weight of its position ``start + i``
    (bytes, so -0.0 != 0.0 and NaN == NaN)."""
    wide = chunk.to(torch.int64)
    weights = torch.arange(start, start + wide.numel(), device=wide.device) % _WEIGHT_MODULUS + 1
    return torch.stack([wide.sum(), (wide * weights).sum()])


def _stream_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[chunks, 2]`` int64 on the tensors' device (at least one tensor): the bytes of ``tensors`` end to end,
    summed in chunks of ``_CHUNK_BYTES`` (small tensors joined into one chunk, a large one split)."""
    sums: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []
    pending_bytes = position = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, position
        if pending:
            chunk = pending[0] if len(pending) == 1 else torch.cat(pending)
            sums.append(_chunk_sums(chunk, position))
            position += chunk.numel()
            pending, pending_bytes = [], 0

    for tensor in tensors:
        data = _bytes(tensor)
        for start in range(0, data.numel(), _CHUNK_BYTES):
            piece = data[start:start + _CHUNK_BYTES]
            if pending_bytes + piece.numel() > _CHUNK_BYTES:
                flush()
            pending.append(piece)
            pending_bytes += piece.numel()
    flush()
    return torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.int64, device=tensors[0].device)


def replica_sums(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor | None:
    """``[chunks, 2]`` int64 on ``device``: :func:`_stream_sums` of the replicated tensors of each device they live
    on, in a fixed order (None when there are none). Equal on every rank when the replicas are."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in replicated_tensors(model, optimizer):
        by_device.setdefault(t.device, []).append(t)
    if not by_device:
        return None
    return torch.cat([_stream_sums(ts).to(device, non_blocking=True) for ts in by_device.values()])


def tensor_digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, str]]:
    """(name, digest of its bytes) of every replicated tensor, in a fixed order: summed where each tensor lives,
    read to the host in one copy per device."""
    named = list(replicated_tensors(model, optimizer))
    if not named:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    sums: list[list[int]] = [[] for _ in named]
    for indices in by_device.values():
        host = torch.stack([_stream_sums([named[i][1]]).sum(0) for i in indices]).cpu().tolist()
        for i, values in zip(indices, host):
            sums[i] = [*values, named[i][1].numel(), *named[i][1].shape]
    return [(name, hashlib.blake2b(repr((str(t.dtype), sums[i])).encode(), digest_size=16).hexdigest())
            for i, (name, t) in enumerate(named)]


def _layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    named = [(name, str(t.dtype), tuple(t.shape)) for name, t in replicated_tensors(model, optimizer)]
    return hashlib.blake2b(repr(named).encode(), digest_size=16).hexdigest()


@dataclass
class _Pending:
    step: int
    differs: torch.Tensor  # bool, in pinned host memory once the copy has run
    copied: torch.cuda.Event | None  # None: the copy was synchronous (CPU)


class ReplicaCheck:
    """The replica check of one run, its verdict read later so that the check does not wait for the device.

    :meth:`start` queues the sums and their all-gather after the work already queued (an overlapped step's update
    included) and a copy of one flag to the host; :meth:`settle` reads the flag of the check before, raising
    :class:`DistributedError` on a mismatch. Each returns the steps whose replicas were found identical."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        self.model, self.optimizer, self.world = model, optimizer, world
        # Where the sums meet for the all-gather: NCCL gathers on this rank's GPU, gloo on the CPU.
        self.device = torch.device("cuda", torch.cuda.current_device()) if world.backend == "nccl" else \
            torch.device("cpu")
        self._layout_checked = False
        self._pending: _Pending | None = None

    def start(self, step: int, wait: bool = False) -> list[int]:
        """Check the replicas after ``step``; with ``wait``, read the verdict now too."""
        confirmed = self.settle()
        if not self.world.distributed or self.world.alone:  # one replica: identical to itself, nothing to read
            return [*confirmed, step]
        if not self._layout_checked:
            if len(set(self.world.all_gather(_layout(self.model, self.optimizer)))) != 1:
                raise DistributedError(f"step {step}: replicas diverged; the ranks hold different sets of "
                                       "trainable tensors")
            self._layout_checked = True
        sums = replica_sums(self.model, self.optimizer, self.device)
        if sums is None:
            return [*confirmed, step]
        gathered = self.world.gather_tensor(sums)
        differs = (gathered != sums).any().reshape(1)
        if self.device.type == "cuda":
            host = torch.empty(1, dtype=torch.bool, pin_memory=True)
            host.copy_(differs, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending = _Pending(step, host, copied)
        else:
            self._pending = _Pending(step, differs, None)
        return confirmed + (self.settle() if wait else [])

    def settle(self) -> list[int]:
        """The verdict of the check in flight, if any: ``[its step]`` when identical; raises when not."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        if pending.copied is not None:
            pending.copied.synchronize()
        if bool(pending.differs.item()):
            _name_the_difference(self.model, self.optimizer, self.world, pending.step)
        return [pending.step]


def _name_the_difference(model: nn.Module, optimizer: torch.optim.Optimizer, world: World, step: int) -> None:
    """Raise :class:`DistributedError` naming ``step`` and the first tensor whose bytes differ between ranks
    (every rank runs this together: it all-gathers each tensor's digest)."""
    per_rank = world.all_gather(tensor_digests(model, optimizer))
    for i, (name, _) in enumerate(per_rank[0]):
        values = [ranked[i][1] if i < len(ranked) else None for ranked in per_rank]
        if len(set(values)) > 1:
            odd = [r for r, v in enumerate(values) if v != values[0]]
            raise DistributedError(f"step {step}: replicas diverged; '{name}' differs on rank(s) "
                                   f"{', '.join(map(str, odd))} from rank 0 (the run stops: its ranks no longer "
                                   "train one model)")
    raise DistributedError(f"step {step}: replicas diverged; the ranks hold different sets of trainable tensors")
