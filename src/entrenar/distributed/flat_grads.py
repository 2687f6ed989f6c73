"""Data parallelism over a small trainable set without DistributedDataParallel: one flat all-reduce a step.

torch's DistributedDataParallel reduces gradients from hooks that fire during backward, bucket by bucket, so the
all-reduce of the last layers overlaps the backward of the first. That pays when gradients are large (full
fine-tuning); for LoRA/QLoRA adapters (tens of MB) it costs more than it saves: its hooks and reducer run on the
host every backward, and they cannot be captured in a CUDA graph, so the plan used to turn graphs and step
overlap off on several processes (docs/DISTRIBUTED.md).

:class:`FlatReplicated` keeps the model unwrapped instead:

- every trainable parameter's ``.grad`` is a view into one flat buffer per dtype, allocated here (before any
  graph is captured) and put back whenever something set the gradients to ``None``, so a captured backward adds
  into memory that stays put;
- forward and backward (eager, or replayed from a graph) run with no hooks;
- when the last micro-batch of an optimizer step leaves :meth:`sync`, each flat buffer is divided by the world
  size and summed over the ranks with one ``all_reduce``, outside any graph, on the current stream (NCCL orders
  its stream after the current one and the current one after it), so what reads the gradients next (clipping,
  the optimizer, overlap's deferred read) sees them in order without a host wait;
- trainable parameters are broadcast from rank 0 once at the start, as DDP does;
- the fp32 buffer has a few spare elements after the gradients, where the step's loss, the task's metrics and
  each rank's peak memory ride the same all-reduce (:meth:`FlatReplicated.carry`), instead of an all-reduce of
  the loss every step and an all-gather of the peaks on logged lines: besides the token counts before the
  forward (:func:`~entrenar.distributed.steps.step_counts`), a step communicates its gradients only.

Dividing before summing is what DDP's default hook does, so both paths compute the same average.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch import nn

from entrenar.distributed.parallelize import Single
from entrenar.distributed.world import World

# Elements after the gradients in the fp32 buffer, beyond one per rank (the peaks): the loss and a task's metrics.
CARRY_SLOTS = 32


class FlatGradients:
    """The trainable parameters' gradients as views into one flat buffer per dtype; ``spare`` more elements after
    them in the (first) fp32 buffer, which no gradient uses (:attr:`spare`, None without an fp32 buffer)."""

    def __init__(self, params: list[nn.Parameter], spare: int = 0) -> None:
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        self.groups: list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]] = []
        self.spare: torch.Tensor | None = None
        for (dtype, device), group in by_dtype.items():
            size = sum(p.numel() for p in group)
            extra = spare if spare and dtype == torch.float32 and self.spare is None else 0
            flat = torch.zeros(size + extra, dtype=dtype, device=device)
            views, offset = [], 0
            for p in group:
                views.append((p, flat[offset:offset + p.numel()].view_as(p)))
                offset += p.numel()
            if extra:
                self.spare = flat[size:]
            self.groups.append((flat, views))
        self.attach()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [flat for flat, _ in self.groups]

    def attach(self) -> None:
        """Make every ``.grad`` its view again: a gradient set to ``None`` (``zero_grad``) comes back as zeros, one
        that is its own tensor (a checkpoint's, a test's) is copied in."""
        for flat, views in self.groups:
            attached = [p.grad is not None and p.grad.data_ptr() == v.data_ptr() for p, v in views]
            if all(attached):
                continue
            if not any(attached) and all(p.grad is None for p, _ in views):
                flat.zero_()  # the usual case (zero_grad(set_to_none=True)): one kernel, not one a parameter
            for (p, view), ok in zip(views, attached, strict=True):
                if ok:
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view


class FlatReplicated(Single):
    """DDP's contract (identical replicas, gradients averaged over the ranks once a step) with the model
    unwrapped: a CUDA graph may capture its forward and backward, and steps may overlap."""

    mode = "ddp"

    def __init__(self, model: nn.Module, world: World) -> None:
        super().__init__(model)
        self.world = world
        params = [p for p in model.parameters() if p.requires_grad]
        self._broadcast(params)
        self.grads = FlatGradients(params, spare=CARRY_SLOTS + world.size)
        self.reductions = 0  # all-reduces of the gradients so far (one per optimizer step)

    def _broadcast(self, params: list[nn.Parameter]) -> None:
        """Rank 0's trainable weights on every rank (the frozen base is read from the same files everywhere)."""
        if not self.world.distributed or self.world.alone or not params:
            return
        with torch.no_grad():
            by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            for group in by_dtype.values():
                flat = torch.cat([p.detach().reshape(-1) for p in group])
                dist.broadcast(flat, src=0)
                offset = 0
                for p in group:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def sync(self, last: bool) -> AbstractContextManager:
        """Gradients in the flat buffers for this micro-batch; averaged over the ranks after the last one."""
        return self._micro_batch(last)

    @contextmanager
    def _micro_batch(self, last: bool) -> Iterator[None]:
        self.grads.attach()
        yield
        if last:
            self.reduce()

    def carry(self, values: torch.Tensor) -> torch.Tensor | None:
        """``values`` copied into the fp32 buffer's spare elements, so the all-reduce of the gradients that ends
        this step's last micro-batch averages them too (each buffer is divided by the world size, then summed);
        the view returned holds that mean once :meth:`sync`'s context has ended, and is overwritten by the next
        step's. None when there is no room (no fp32 gradients, or more values than spare elements: the caller then
        reduces them itself) or no process group."""
        spare = self.grads.spare
        if not self.world.distributed or spare is None or values.numel() > spare.numel() \
                or values.device != spare.device:
            return None
        carried = spare[:values.numel()]
        carried.copy_(values)
        return carried

    def reduce(self) -> None:
        """Each flat buffer averaged over the ranks: divided by the world size, then one all-reduce sum (nothing
        to do on a group of one)."""
        if self.world.distributed and not self.world.alone:
            for flat in self.grads.buffers:
                flat.div_(self.world.size)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        self.reductions += 1


__all__ = ["FlatGradients", "FlatReplicated"]
