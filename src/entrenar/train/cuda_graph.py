"""Forward and backward of a micro-batch replayed from a CUDA graph: one launch instead of thousands.

An eager LoRA step on a GPU launches two to three thousand kernels (every
adapter product, cast and norm of every layer, forward and backward); at
1B-parameter scale the host spends about as long launching them as the GPU
spends running them. A CUDA graph records the launches of one micro-step
once and replays them with one call (docs/PERFORMANCE.md has the numbers).

What replaying needs, and :class:`GraphedMicroStep` sees to or the loop
keeps:

* the same shapes every call: inputs are copied into the graph's own tensors;
  a micro-batch of another shape runs eagerly;
* gradients that exist before capture and are zeroed in place, never set to
  ``None``: the graph adds each micro-batch's gradients into those tensors;
* no host synchronisation inside (no ``.item()``, no data-dependent shapes):
  padding-free batches are refused with graphs, since their layout changes
  with every batch; packed rows keep their shape and hand their documents to
  the varlen kernel in a fixed number of segments (empty ones at the end);
* a few eager calls first, on a side stream, so Triton compiles, cuBLAS picks
  its kernels and the autograd engine warms up before capture.

A capture that fails (an operation no check foresaw) stops the run where graphs were asked for
(``training.cuda_graphs: true``); under ``auto`` the micro-steps go on eagerly and :attr:`GraphedMicroStep.eager_why`
says why, once, for the log. Nothing of the failed capture ran: the recording does not run the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from entrenar.errors import ConfigError

WARMUP_CALLS = 3


class GraphedMicroStep:
    """``fn(inputs)`` (forward and backward of one micro-batch, returning the detached loss) replayed from a
    CUDA graph after ``warmup`` eager calls. ``params`` are the trained parameters, whose gradients the graph
    accumulates into."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], params: Sequence[torch.Tensor],
                 warmup: int = WARMUP_CALLS, capturable: Callable[[dict], bool] | None = None,
                 strict: bool = True) -> None:
        self.fn = fn
        self.strict = strict  # training.cuda_graphs: true (a failed capture stops the run) rather than auto
        self.eager_why: str | None = None  # set when a failed capture left this run eager
        self.capturable = capturable  # which inputs may set the graph's layout (others run eagerly until one does)
        self.params = list(params)
        self.warmup = warmup
        self.eager_calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.loss: torch.Tensor | None = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.eager_why is not None:
            return self.fn(inputs)
        if self.graph is None and self.eager_calls < self.warmup:
            self.eager_calls += 1
            return self._on_side_stream(inputs)
        if self.graph is None:
            if self.capturable is not None and not self.capturable(inputs):
                return self.fn(inputs)
            try:
                self._capture(inputs)
            except RuntimeError as e:  # an operation capture refuses, which no check above foresaw
                first = str(e).splitlines()[0] if str(e) else repr(e)
                if self.strict:
                    raise ConfigError(f"training.cuda_graphs: true, but capturing the micro-step failed: {first} "
                                      "(training.cuda_graphs: auto goes on eagerly instead)") from e
                self.eager_why = f"capturing the micro-step failed ({first}); the steps run eagerly"
                self.graph, self.inputs, self.loss = None, {}, None
                return self.fn(inputs)
        elif not self._same_layout(inputs):
            return self.fn(inputs)
        for name, tensor in inputs.items():
            if isinstance(tensor, torch.Tensor):
                self.inputs[name].copy_(tensor)
        graph, loss = self.graph, self.loss
        assert graph is not None and loss is not None  # captured above or by an earlier call
        graph.replay()
        return loss.clone()  # the next replay overwrites the graph's own

    def _same_layout(self, inputs: dict[str, torch.Tensor]) -> bool:
        def same(t, mine) -> bool:  # a Python number (a kernel's launch size) is baked into the graph
            if isinstance(t, torch.Tensor):
                return isinstance(mine, torch.Tensor) and t.shape == mine.shape and t.dtype == mine.dtype
            return t == mine

        return inputs.keys() == self.inputs.keys() and all(same(t, self.inputs[k]) for k, t in inputs.items())

    def _on_side_stream(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.fn(inputs)
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def _capture(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs = {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        # Under torchrun the NCCL watchdog thread queries its events while this thread captures; "global" mode
        # would count those calls against the capture (as Megatron and Transformer Engine capture, thread_local).
        mode = "thread_local" if dist.is_available() and dist.is_initialized() else "global"
        with torch.cuda.graph(graph, capture_error_mode=mode):
            self.loss = self.fn(self.inputs)  # recorded, not run: the replay that follows runs it
        self.graph = graph
