"""Reading a step's results while the GPU runs the next step (``training.overlap_steps``).

The loop reads each step's loss and gradient norm to the host: the non-finite guard and the metrics line need
them. Read at once, the read waits for the GPU to finish the step, and the GPU then waits while the host checks,
logs, builds the next batches and launches the next step: 8-11 ms of a 110-118 ms step at the Llama-1B and
Qwen3-MoE shapes on an H100 (docs/PERFORMANCE.md). Overlapped, the loop launches step N's update, copies its
values to pinned host memory behind it, launches step N+1's forward and backward, and only then reads step N:
the GPU always has queued work.

What keeps that exact:

* a non-finite step's update is dropped on the device: the fused optimizer skips its kernel while its
  ``found_inf`` flag is set (the flag GradScaler uses), computed from the same loss and norm the guard reads
  later, so the guard's verdict (skip, or stop before the next update is launched) is what the device did;
* steps whose results the host acts on at once (evaluation, checkpoint, the last step) are read at once, and so
  is every step until the optimizer has state: a fused optimizer builds its state lazily in its first ``step()``
  (SGD's momentum buffers as uninitialised memory its kernel fills), which a dropped first update would leave
  as it was built.
"""

from __future__ import annotations

import torch


class DeferredRead:
    """A device vector copied to host memory behind the work queued so far; :meth:`values` waits for that work
    only, not for what was queued after it."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))  # the copy's stream, on any cuda:N
        else:  # a CPU has finished the work already
            self._host, self._event = values.detach().clone(), None

    def values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor
                          ) -> torch.Tensor:
    """``optimizer.step()`` with its update dropped on the device when ``loss`` or ``grad_norm`` is not finite
    (moments, step count and weights untouched, as if the step were not taken); returns that decision as a
    float flag on the device (1.0: dropped)."""
    found = (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).to(torch.float32)
    # What GradScaler sets on a fused optimizer for its step; torch's stubs do not declare the attribute.
    optimizer.found_inf = found  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]  # a later eager step must not inherit the flag
    return found


__all__ = ["DeferredRead", "step_unless_nonfinite"]
