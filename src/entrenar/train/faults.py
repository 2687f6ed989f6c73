"""Numerical faults of a step, decided before the optimizer applies it.

A gradient can turn NaN or inf while the loss is still finite (an overflow in
one layer's backward); applied, it makes every weight NaN and every later
checkpoint useless. The loop hands each step's loss and pre-clip gradient norm
to :class:`NonfiniteGuard` before ``optimizer.step``:

- ``training.nonfinite: stop`` raises a DataError naming the step and the last
  checkpoint, which is good: no non-finite update was ever applied, and no
  checkpoint holds a non-finite tensor (the save-time check of entrenar.io.finite);
- ``skip`` drops that step's update (no optimizer step, so Adam's moments and
  step count stay as they were; the data and the schedule move on), marks it in
  metrics.jsonl, and stops after ``training.max_skipped_steps`` skips in a row.

fp16 training keeps the GradScaler's own semantics for gradients: it skips an
overflowed step and lowers the scale, which is normal there and logged as
``"scaler_skipped": true``. Its loss is still checked here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from entrenar.errors import DataError
from entrenar.train.checkpoint import latest_checkpoint


class NonfiniteGuard:
    """Decides whether a step's update may be applied; counts the skipped ones (saved in the checkpoint)."""

    def __init__(self, policy: str, max_skipped: int, run_dir: str | os.PathLike, scaler_handles_grads: bool) -> None:
        self.policy = policy
        self.max_skipped = max_skipped
        self.run_dir = Path(run_dir)
        self.scaler_handles_grads = scaler_handles_grads
        self.in_a_row = 0  # consecutive skipped steps
        self.total = 0

    def check(self, step: int, loss_value: float, norm_value: float) -> dict[str, Any]:
        """``{}`` when step ``step`` may be applied; ``{"skipped": reason}`` when its update must be dropped.

        Raises DataError in stop mode, or after too many skips in a row. Takes
        the step's loss and pre-clip gradient norm as read to the host: the one
        read the loop makes per step, which the metrics line reuses.
        """
        if not math.isfinite(loss_value):
            reason = f"non-finite loss ({loss_value})"
        elif not math.isfinite(norm_value) and not self.scaler_handles_grads:
            reason = f"non-finite gradient norm ({norm_value})"
        else:
            self.in_a_row = 0
            return {}
        if self.policy == "stop":
            raise DataError(f"step {step}: {reason}; its update was not applied. Lower optimizer.lr, check the data, "
                            f"or set training.nonfinite: skip (last good checkpoint: {self._last_good()})")
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row > self.max_skipped:
            raise DataError(f"step {step}: {self.in_a_row} steps in a row skipped ({reason}), more than "
                            f"training.max_skipped_steps={self.max_skipped}; the run is not recovering. Lower "
                            f"optimizer.lr or check the data (last good checkpoint: {self._last_good()})")
        return {"skipped": reason}

    def _last_good(self) -> str:
        ckpt = latest_checkpoint(self.run_dir)
        return str(ckpt) if ckpt is not None else "none yet"

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Counters of a checkpoint (absent in checkpoints of earlier versions: zero)."""
        state = state if isinstance(state, dict) else {}
        self.in_a_row = int(state.get("in_a_row", 0))
        self.total = int(state.get("total", 0))


def optimizer_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, skip: bool) -> dict[str, Any]:
    """Step the optimizer through the scaler, unless ``skip``; ``{"scaler_skipped": True}`` when fp16's scaler
    dropped the step itself (an overflow: it lowers its scale and tries again at the next step)."""
    if not scaler.is_enabled():
        if not skip:
            optimizer.step()
        return {}
    if skip:
        scaler.update()  # closes the step unscale_ opened (and lowers the scale if it saw an overflow)
        return {}
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return {"scaler_skipped": True} if scaler.get_scale() < scale else {}


__all__ = ["NonfiniteGuard", "optimizer_step"]
