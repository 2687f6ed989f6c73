"""What one optimizer step is on N processes: the global batch, each rank's share of it, its token counts.

The data order is a property of the global step, not of the world size: every rank reads the same
deterministic :class:`~entrenar.data.BatchStream`, and of the ``world.size * accumulation`` micro-batches of a
step rank r takes the r-th run of ``accumulation`` (skipping the rest unbuilt). A run on one process with
``world.size`` times the accumulation sees the same micro-batches in the same step, and the stream's position
after a step is the same on any number of processes, so a checkpoint taken on N resumes on M exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from entrenar.data import BatchStream, num_target_tokens
from entrenar.data.batching import Batch
from entrenar.distributed.world import World
from entrenar.errors import CheckpointError, ConfigError


def accumulation(batch_size: int, grad_accum: int, global_batch_size: int | None, world_size: int) -> int:
    """Micro-batches per rank and step: ``training.grad_accum``, or derived from ``training.global_batch_size``.

    ``training.batch_size`` is per device; the global batch (rows per optimizer step) is
    ``batch_size x accumulation x world_size``.
    """
    if global_batch_size is None:
        return grad_accum
    per_pass = batch_size * world_size
    if global_batch_size % per_pass:
        raise ConfigError(f"training.global_batch_size ({global_batch_size}) must be a multiple of "
                          f"training.batch_size x processes ({batch_size} x {world_size} = {per_pass})")
    derived = global_batch_size // per_pass
    if grad_accum not in (1, derived):
        raise ConfigError(f"training.grad_accum ({grad_accum}) contradicts training.global_batch_size "
                          f"({global_batch_size} = {batch_size} x {derived} x {world_size} processes); "
                          "set only one of them")
    return derived


def step_batches(stream: BatchStream, accumulation: int, world: World) -> list[Batch]:
    """This rank's micro-batches of the next global step; the stream moves past the whole step."""
    stream.skip(world.rank * accumulation)
    mine = [next(stream) for _ in range(accumulation)]
    stream.skip((world.size - 1 - world.rank) * accumulation)
    return mine


def step_counts(micro_batches: list[Batch], world: World, device: torch.device,
                count_targets: Callable[[Batch], float] = num_target_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The global step's targets (the loss divisor, at least 1; what ``count_targets`` counts in a batch: target
    tokens, or a classification task's weighted rows) and real tokens, as device tensors.

    One all-reduce for both, with no host copy: the divisor is used on the device; the token count is read when
    the step is logged.
    """
    targets = sum(count_targets(b) for b in micro_batches)
    tokens = sum(int((b["document_ids"] >= 0).sum()) for b in micro_batches)
    counts = world.all_sum(torch.tensor([targets, tokens], dtype=torch.float64).to(device, non_blocking=True))
    return counts[0].clamp(min=1).float(), counts[1]


def check_resume(trainer_state: dict, checkpoint: Any, global_batch: int) -> None:
    """Refuse to resume with another global batch: the same data position would then mean another optimisation.

    The world size may change (N -> M processes); keep the rows per step with ``training.global_batch_size``.
    """
    saved = trainer_state.get("global_batch")
    if saved is not None and saved != global_batch:
        was = trainer_state.get("world_size", "?")
        raise CheckpointError(f"{checkpoint}: saved with a global batch of {saved} rows per step ({was} "
                              f"process(es)), this run has {global_batch}; set training.global_batch_size={saved} "
                              "to resume it on this many processes")


def describe(mode: str, world: World, batch_size: int, accumulation: int, seq_len: int) -> str:
    """The line a distributed run prints at its start."""
    rows = batch_size * accumulation * world.size
    return (f"{mode} on {world.size} processes ({world.backend}): global batch {rows} rows = {batch_size} per "
            f"device x {accumulation} accumulation x {world.size} processes (up to {rows * seq_len:,} tokens a step)")


def step_scalars(loss: torch.Tensor, metrics: dict[str, torch.Tensor], world: World,
                 device: torch.device) -> torch.Tensor:
    """This rank's share of what a step averages over the ranks beside its gradients, as one fp32 vector on
    ``device``: ``[loss, *metrics, *peaks]``. Its mean over the ranks is the global step's loss, the task's metrics
    averaged, and (a distributed run) each rank's peak memory in GB at its rank's slot: each rank writes its own
    times the world size there and zeros elsewhere. Built on the device with no host read, so it can ride the
    gradients' all-reduce (:meth:`~entrenar.distributed.parallelize.Single.carry`) instead of a collective of its
    own, on every step, logged or not."""
    parts = [loss.detach().float().reshape(1), *[v.detach().float().reshape(1) for v in metrics.values()]]
    if world.distributed:
        peaks = torch.zeros(world.size, device=device)
        peaks.narrow(0, world.rank, 1).fill_(peak_bytes(device) / 1e9 * world.size)  # a kernel's argument: no copy
        parts.append(peaks)
    return torch.cat(parts)


def split_scalars(means: Any, names: tuple[str, ...], world: World) -> tuple[Any, dict[str, Any], Any]:
    """(loss, the task's metrics by name, each rank's peak memory in GB or None on one process) of a
    :func:`step_scalars` vector averaged over the ranks (a device tensor, or the list read to the host)."""
    k = 1 + len(names)
    return means[0], dict(zip(names, means[1:k], strict=True)), means[k:k + world.size] if world.distributed else None


def peak_bytes(device: torch.device) -> float:
    """This process's peak memory in bytes (CUDA: allocated by torch; otherwise the process's peak resident
    memory). A host call: no device read."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # kilobytes on Linux


def peak_memory(world: World, device: torch.device) -> dict[str, Any]:
    """``{"peak_mem_gb_ranks": [...]}``, each rank's peak so far (:func:`peak_bytes`) gathered as one tensor, for
    the summary of a distributed run (``{}`` on one process): one all-gather and a host read, at the end of the
    run only (the step's lines carry theirs in :func:`step_scalars`)."""
    if not world.distributed:
        return {}
    mine = torch.tensor([peak_bytes(device)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    if world.alone:
        every = [mine]
    else:
        torch.distributed.all_gather(every, mine)  # a tensor collective: no pickling
    return {"peak_mem_gb_ranks": [round(float(p) / 1e9, 3) for p in torch.cat(every).tolist()]}
