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


def peak_memory(world: World, device: torch.device) -> dict[str, Any]:
    """``{"peak_mem_gb_ranks": [...]}`` for the metrics line of a distributed run (``{}`` on one process): each
    rank's peak (CUDA: allocated by torch; CPU: the process's peak resident memory), gathered as one tensor."""
    if not world.distributed:
        return {}
    return {"peak_mem_gb_ranks": [round(float(p) / 1e9, 3) for p in gathered_peaks(world, device).tolist()]}


def gathered_peaks(world: World, device: torch.device) -> torch.Tensor:
    """Each rank's peak memory in bytes (as :func:`peak_memory`), gathered on ``device`` and not read: a caller
    that must not wait for the work queued before the gather reads it later."""
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # kilobytes on Linux
    mine = torch.tensor([peak], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    torch.distributed.all_gather(every, mine)  # a tensor collective: no pickling on the step's path
    return torch.cat(every)
