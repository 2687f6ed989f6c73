"""The process group a training run belongs to: who this process is, and the few collectives the loop needs.

A run started by torchrun (``entrenar train --nproc-per-node N`` or ``torchrun -m entrenar train``) finds
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in its environment; :func:`join` then opens the default process group
(NCCL on CUDA, gloo on the CPU) with the recipe's collective timeout, and pins one device per process. A plain
run gets :data:`SOLO`, whose collectives are no-ops, so the loop reads the same either way.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from entrenar.errors import ConfigError, DistributedError, EntrenarError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``size`` processes, ``local_rank`` on its host."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (a single process)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes what is replicated (checkpoints, metrics, outputs) and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def alone(self) -> bool:
        """Whether this process is the only rank (no process group, or a group of one: ``parallel: ddp`` or
        ``fsdp`` on one process). Its collectives are identities then and are not issued: on CUDA each would
        still cost an NCCL launch and two cross-stream waits a step."""
        return self.size == 1

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over all ranks, in place (on its own device: no host copy)."""
        if self.distributed and not self.alone:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable, small), in rank order."""
        if not self.distributed or self.alone:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each) stacked in rank order, ``[size, *shape]``, on its own
        device: no host copy."""
        if not self.distributed or self.alone:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous())
        return torch.stack(out)

    def barrier(self) -> None:
        if self.distributed and not self.alone:
            dist.barrier()

    def main_only(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on rank 0 only and give every rank its result (or its error).

        Rank 0's result is broadcast, so every rank goes on with the same value; an ``EntrenarError`` raised on
        rank 0 is raised on every rank with the same message, so a failed save stops the run once, cleanly,
        instead of leaving the others waiting at the next collective until the timeout.
        """
        if not self.distributed or self.alone:
            return fn(*args, **kwargs)
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn(*args, **kwargs))
            except EntrenarError as e:
                box[0] = ("error", e if _picklable(e) else RankError(str(e)))
            except BaseException as e:  # still tell the others, then fail here with the real traceback
                dist.broadcast_object_list([("error", RankError(f"rank 0 failed: {type(e).__name__}: {e}"))], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value


SOLO = World()


def _picklable(error: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True


class RankError(DistributedError):
    """Another rank failed; this one stops with its message."""


def launched() -> bool:
    """Whether torchrun (or a launcher that sets its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


# The collective backend of each device type a job may train on (ROCm's is NCCL's API, as RCCL).
BACKENDS = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}


def join(device: torch.device, timeout_s: float, group_for_one: bool = False) -> tuple[World, torch.device]:
    """Open the default process group when torchrun started this process; the world and this rank's device.

    On CUDA (and ROCm) each process takes ``cuda:LOCAL_RANK`` and NCCL, on an Intel GPU ``xpu:LOCAL_RANK`` and
    XCCL, on the CPU gloo; MPS has no collective backend. Every rank must have resolved the same device type:
    the ranks compare theirs over the rendezvous store before any process group opens, and a mixed job is one
    ConfigError naming each rank's. ``timeout_s`` bounds every collective: a rank that died or hangs stops the
    others after that long (torchrun then restarts the job, with ``--max-restarts``), instead of after PyTorch's
    default ten minutes.
    A job of one process opens no group (unless ``group_for_one``: DDP or FSDP asked for by name): it runs as a
    plain process does, CUDA graphs and overlapped steps included, with torchrun's restarts around it.
    """
    if not launched():
        return SOLO, device
    rank, size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if size == 1 and not group_for_one and not dist.is_initialized():
        if device.type in ("cuda", "xpu"):
            device = torch.device(device.type, local_rank)
            getattr(torch, device.type).set_device(device)
        return World(rank=0, size=1, local_rank=local_rank), device
    timeout = timedelta(seconds=timeout_s)
    store = None
    if not dist.is_initialized():
        store = _store(size, timeout)
        same_device_type(store, rank, size, device)
    backend = BACKENDS.get(device.type)
    if backend is None:
        raise ConfigError(f"model.device: distributed training runs on CUDA or ROCm (NCCL), Intel GPUs (XCCL) or "
                          f"the CPU (gloo); PyTorch has no collective backend for {device.type}")
    if device.type in ("cuda", "xpu"):
        module = getattr(torch, device.type)
        if local_rank >= module.device_count():
            raise ConfigError(f"LOCAL_RANK {local_rank} but this host has {module.device_count()} {device.type} "
                              "device(s); start at most one process per device (--nproc-per-node)")
        device = torch.device(device.type, local_rank)
        module.set_device(device)
    if store is not None:
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=size,
                                device_id=device if backend != "gloo" else None)
        _opened.append(True)
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise ConfigError(f"the process group ({dist.get_rank()} of {dist.get_world_size()}) does not match "
                          f"RANK={rank} WORLD_SIZE={size}")
    return World(rank=rank, size=size, local_rank=local_rank, backend=backend), device


def same_device_type(store: dist.Store, rank: int, size: int, device: torch.device) -> None:
    """Every rank's device type through ``store`` (before any process group: mismatched backends would open
    groups that cannot talk); a ConfigError on every rank when they differ."""
    store.set(f"device_type/{rank}", device.type)
    types = [store.get(f"device_type/{r}").decode() for r in range(size)]
    if len(set(types)) > 1:
        ranks = ", ".join(f"rank {r} {kind}" for r, kind in enumerate(types))
        raise ConfigError(f"model.device: the ranks of this job resolved to different device types ({ranks}); "
                          "every rank must train on the same kind of device (one collective backend): set "
                          "model.device to it (cuda, xpu or cpu) rather than auto on mixed hosts")


def _store(size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store for this attempt's process group.

    Under torchrun's agent the workers share the agent's TCPStore, which (torch 2.13, c10d rendezvous) outlives
    a restart: the restarted workers' gloo could read the dead ones' addresses from it and fail to connect
    (seen here). Keys under a prefix per attempt keep the attempts apart.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(host, port, size, is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"entrenar/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


_opened: list[bool] = []  # whether join() opened the default group (one a caller opened is the caller's to close)


def leave() -> None:
    """Close the process group :func:`join` opened, if it did."""
    if _opened and dist.is_initialized():
        dist.destroy_process_group()
    _opened.clear()


def restarted() -> bool:
    """Whether torchrun restarted this job after a failure (its workers then resume from the last checkpoint)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
