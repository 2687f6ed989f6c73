"""One optimizer step: its micro-batches' forward and backward, the clipped update, and the one read to the host.

Two strategies, chosen by the plan (``training.overlap_steps``):

- :class:`SyncSteps` reads each step's loss and gradient norm at once, checks them (``training.nonfinite``) and
  only then applies the update;
- :class:`OverlappedSteps` launches the update with a non-finite one dropped on the device, and reads the step
  after the next step's micro-batches are queued, so the GPU always has work (:mod:`entrenar.train.overlap`).
  Steps the host acts on at once (evaluation, checkpoint, the last) and those before the optimizer has state
  are read at once, as :class:`SyncSteps` does.

Gradient accumulation divides each micro-batch's summed loss by the targets of the whole global step, so a
step over many micro-batches and processes has the gradient of one large batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from entrenar.data import BatchStream
from entrenar.distributed import steps as dist_steps
from entrenar.distributed import watchdog
from entrenar.distributed.parallelize import Single
from entrenar.distributed.world import World
from entrenar.evaluation.loss import autocast_for
from entrenar.tasks.base import Batch, Task
from entrenar.train.cuda_graph import GraphedMicroStep
from entrenar.train.faults import NonfiniteGuard, optimizer_step
from entrenar.train.moe import MoeTraining
from entrenar.train.overlap import DeferredRead, step_unless_nonfinite


@dataclass
class StepRecord:
    """A step whose results reached the host: what its metrics line, the guard and the console read."""

    step: int  # steps done, counting this one
    lr: float
    started: float  # perf_counter at its start
    loss: float
    grad_norm: float
    tokens: int
    flags: dict[str, Any] = field(default_factory=dict)  # skipped / scaler_skipped
    moe_values: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the task's own (Task.step_metrics), ranks' mean
    peaks: list[float] | None = None  # distributed: each rank's peak memory (GB) up to this step's last backward


class MicroStep:
    """Forward and backward of one micro-batch (replayed from a CUDA graph where the plan says so); its loss is
    normalised over the whole step's targets."""

    def __init__(self, task: Task, step_model: Single, moe: MoeTraining | None, device: torch.device,
                 precision: str, scaler: torch.amp.GradScaler, trainable: list[torch.nn.Parameter],
                 graphs: bool, graphs_strict: bool = True) -> None:
        self.task, self.step_model, self.moe, self.device = task, step_model, moe, device
        self.precision, self.scaler, self.graphs = precision, scaler, graphs
        self.segments: int | None = None  # CUDA graphs' segment capacity, once the data position is known
        self.graphed = GraphedMicroStep(self._forward_backward, trainable, strict=graphs_strict,
                                        capturable=lambda batch: fills_capacity(batch, self.segments)) \
            if graphs else None
        self.run = self.graphed if self.graphed is not None else self._forward_backward
        self._told = False

    def notice(self) -> str | None:
        """Once: why the steps went on eagerly after their capture failed (``training.cuda_graphs: auto``)."""
        if self.graphed is None or self.graphed.eager_why is None or self._told:
            return None
        self._told = True
        return f"training.cuda_graphs: {self.graphed.eager_why}"

    def __call__(self, batch: Batch) -> torch.Tensor:
        out = self.run(batch)
        fixed = self.task.fixed_layout
        if fixed is None or out.ndim == 0:  # the loss alone (no metrics of the task's beside it)
            return out
        fixed.add_micro_stats(out[1:])
        return out[0]

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        with autocast_for(self.device, self.precision, cache=not self.graphs):
            loss = self.task.loss_sum(self.step_model, batch) / batch["step_targets"]
            total = loss + self.moe.router_loss(batch) if self.moe is not None else loss
        self.scaler.scale(total).backward()
        # A task's metrics of this micro-batch computed on the device (a preference task's in its fixed layout)
        # come back beside the loss, [loss, *stats]: a replayed graph runs no Python that could hand them over.
        fixed = self.task.fixed_layout
        stats = fixed.micro_stats() if fixed is not None else None
        if stats is None:
            return loss.detach()
        return torch.cat([loss.detach().float().reshape(1), stats.float().reshape(-1)])



class SyncSteps:
    """Each step read to the host, checked, then applied."""

    def __init__(self, *, world: World, task: Task, stream: BatchStream, accumulation: int,
                 layout: Callable[[Batch], Batch], micro_step: MicroStep, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, guard: NonfiniteGuard, moe: MoeTraining | None,
                 trainable: list[torch.nn.Parameter], max_grad_norm: float, device: torch.device,
                 log: Callable[[StepRecord], None], data_world: World | None = None) -> None:
        self.world, self.task, self.stream, self.accumulation = world, task, stream, accumulation
        # Who reads which micro-batches and counts them: the world, or its data-parallel groups (context parallel)
        self.data_world = data_world or world
        self.layout, self.micro_step, self.optimizer, self.scaler = layout, micro_step, optimizer, scaler
        self.guard, self.moe, self.trainable, self.device, self.log = guard, moe, trainable, device, log
        self.max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        self.keep_grads = micro_step.graphs  # a graph adds into gradients it holds: zeroed in place
        self.metrics: dict[str, torch.Tensor] = {}  # the task's metrics of the step being applied
        self.peaks: torch.Tensor | None = None  # and each rank's peak memory (a distributed run)

    def run(self, step: int, lr: float, acts: bool) -> StepRecord | None:
        """Step ``step`` (0-based) at learning rate ``lr``; its record when its results were read now (always,
        here), None when they come later. ``acts``: the host acts on this step (evaluation, checkpoint)."""
        started = time.perf_counter()
        watchdog.beat("data", step + 1)  # what this rank is doing, for the launcher's watchdog (hung ranks)
        means, names, tokens = self._accumulate(step + 1)
        self._read_earlier()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_norm)  # the pre-clip norm
        watchdog.beat("collective", step + 1)
        loss, self.metrics, self.peaks = dist_steps.split_scalars(means, names, self.world)
        return self._apply(step + 1, lr, started, loss, grad_norm, tokens, acts)

    def finish(self) -> None:
        """Read whatever is still on its way (nothing, here)."""

    def _accumulate(self, done: int) -> tuple[torch.Tensor, tuple[str, ...], torch.Tensor]:
        """This rank's micro-batches of step ``done``, forward and backward: (the step's scalars averaged over the
        ranks, :func:`~entrenar.distributed.steps.step_scalars`; the task's metric names; real tokens).

        The global step's loss reaches every rank, so every rank takes the same decision on a non-finite one;
        the task's metrics of the step (means over this rank's micro-batches: a classifier's accuracy, TRL's
        preference metrics) are averaged over the ranks (each holds as many rows), and each rank's peak memory
        comes with them, all on the device. Under flat DDP they ride the gradients' all-reduce; otherwise one
        all-reduce of their own (none on one process)."""
        micro_batches = dist_steps.step_batches(self.stream, self.accumulation, self.data_world)
        targets, tokens = dist_steps.step_counts(micro_batches, self.data_world, self.device,
                                                 count_targets=self.task.num_targets)
        watchdog.beat("forward/backward", done)
        step_model = self.micro_step.step_model
        loss = torch.zeros((), device=self.device)
        metrics: dict[str, torch.Tensor] = {}
        scalars, carried = loss, None
        for i, micro_batch in enumerate(micro_batches):
            batch = {k: _to(v, self.device) for k, v in self.layout(micro_batch).items()}
            # Over world.size: DDP and FSDP average the ranks' gradients, and the step needs their sum.
            batch["step_targets"] = targets / self.world.size
            last = i == len(micro_batches) - 1
            with step_model.sync(last=last):  # all-reduce once a step
                loss += self.micro_step(batch)
                if last:
                    metrics = self.task.step_metrics()
                    scalars = dist_steps.step_scalars(loss, metrics, self.world, self.device)
                    carried = step_model.carry(scalars)
        if carried is not None:  # averaged with the gradients; a copy: the next step's writes over it
            return carried.clone(), tuple(metrics), tokens
        return self.world.all_sum(scalars) / self.world.size, tuple(metrics), tokens

    def _read_earlier(self) -> None:
        """Read a step launched before this one (overlap)."""

    def _apply(self, done: int, lr: float, started: float, loss: torch.Tensor, grad_norm: torch.Tensor,
               tokens: torch.Tensor, acts: bool) -> StepRecord | None:
        # The step's one host read; a NaN/inf loss or gradient norm then stops the run, or drops this step's
        # update (training.nonfinite), before the optimizer applies it.
        values = self._values(loss, grad_norm, tokens).tolist()
        flags = self.guard.check(done, values[0], values[1])
        flags |= optimizer_step(self.scaler, self.optimizer, skip=bool(flags))  # fp16: the scaler's own skips
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        # Router biases move only with an applied update (a skipped step leaves them too).
        moe_values = self.moe.close_step(update="skipped" not in flags).tolist() if self.moe is not None else None
        record = self._record(done, lr, started, values, tuple(self.metrics), flags)
        record.moe_values = moe_values
        self.log(record)
        return record

    def _values(self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What the host reads of a step, as one float64 vector on the device: loss, gradient norm, tokens, the
        task's metrics, each rank's peak memory."""
        peaks = [self.peaks.double()] if self.peaks is not None else []
        full = getattr(grad_norm, "full_tensor", None)  # FSDP: a DTensor norm, reduced over the ranks here
        grad_norm = full() if full is not None else grad_norm
        return torch.cat([loss.double().reshape(1), grad_norm.double().reshape(1), tokens.double().reshape(1),
                          *[v.double().reshape(1) for v in self.metrics.values()], *peaks])

    def _record(self, done: int, lr: float, started: float, values: list[float], names: tuple[str, ...],
                flags: dict[str, Any]) -> StepRecord:
        """The record of step ``done`` from its :meth:`_values` as read (MoE's values after them, if any)."""
        k = 3 + len(names)
        peaks = values[k:k + self.world.size] if self.world.distributed else None
        return StepRecord(done, lr, started, values[0], values[1], int(values[2]), flags,
                          values[k + len(peaks or []):] if self.moe is not None else None,
                          _finite(dict(zip(names, values[3:k], strict=True))), peaks)


@dataclass
class _Launched:
    """An overlapped step whose update is launched and whose results are on their way to the host."""

    step: int
    lr: float
    started: float
    read: DeferredRead
    metrics: tuple[str, ...] = ()  # the task's metric names, read after loss, norm and tokens (then the peaks)


class OverlappedSteps(SyncSteps):
    """Steps the host need not act on are read after the next step's micro-batches are queued."""

    pending: _Launched | None = None

    def finish(self) -> None:
        self._read_earlier()

    def _read_earlier(self) -> None:
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        values = p.read.values()
        # Its update was already dropped on the device if non-finite; stop mode raises here, before this step's
        # update is launched.
        flags = self.guard.check(p.step, values[0], values[1])
        self.log(self._record(p.step, p.lr, p.started, values, p.metrics, flags))

    def _apply(self, done: int, lr: float, started: float, loss: torch.Tensor, grad_norm: torch.Tensor,
               tokens: torch.Tensor, acts: bool) -> StepRecord | None:
        if acts or not self.optimizer.state:  # read now: the optimizer builds its state in its first step
            return super()._apply(done, lr, started, loss, grad_norm, tokens, acts)
        found = step_unless_nonfinite(self.optimizer, loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        values = self._values(loss, grad_norm, tokens)
        if self.moe is not None:  # router biases move only with an applied update
            values = torch.cat([values, self.moe.close_step(update=1.0 - found).double()])
        self.pending = _Launched(done, lr, started, DeferredRead(values), tuple(self.metrics))
        return None


def fills_capacity(batch: Batch, segments: int | None) -> bool:
    """Whether a micro-batch has the layout a CUDA graph may be captured with (packed rows padded to the segment
    capacity, not a batch over it that kept its own)."""
    cu = batch.get("cu_seqlens")
    return cu is None or segments is None or len(cu) == segments + 1


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """A task's step metrics as numbers, without those that are not finite (nothing counted in the step)."""
    return {k: x for k, x in ((k, float(v)) for k, v in metrics.items()) if math.isfinite(x)}


def _to(value: torch.Tensor | int, device: torch.device) -> torch.Tensor | int:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


__all__ = ["MicroStep", "OverlappedSteps", "StepRecord", "SyncSteps", "fills_capacity"]
