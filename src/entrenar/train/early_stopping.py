"""Early stopping: end a run once an evaluation metric has stopped improving.

``training.early_stopping: {metric: eval_loss, patience: 3, min_delta: 0.0}``
stops after ``patience`` evaluations in a row that did not beat the best value
by more than ``min_delta`` (lower is better for ``mode: min``, higher for
``max``; the recipe fills in the mode from the metric's name). The evaluation
before training counts as the first value to beat. The counter and best value
travel in the checkpoint, so a resumed run stops where the uninterrupted one
would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from entrenar.errors import ConfigError


class EarlyStopping:
    """Tracks one metric across evaluations; :meth:`update` says when to stop. ``config=None`` never stops."""

    def __init__(self, config: Mapping[str, Any] | None) -> None:
        self.config = dict(config) if config is not None else None
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0  # evaluations in a row without improvement
        self.reason: str | None = None  # why the run stopped, once it has

    def update(self, step: int, metrics: Mapping[str, float | None]) -> bool:
        """Record the evaluation at ``step``; True when the run should stop now."""
        if self.config is None:
            return False
        name = self.config["metric"]
        if name not in metrics and f"eval_{name}" in metrics:  # macro_f1 means eval_macro_f1
            name = f"eval_{name}"
        if name not in metrics:
            raise ConfigError(f"training.early_stopping.metric: {name!r} is not a metric this run evaluates "
                              f"(it has: {', '.join(sorted(metrics))})")
        value = metrics[name]
        if value is not None and math.isfinite(value) and self._improves(value, self.config):
            self.best, self.best_step, self.bad_evals = value, step, 0
            return False
        self.bad_evals += 1
        if self.bad_evals < self.config["patience"]:
            return False
        delta = self.config["min_delta"]
        by = f" by more than {delta:g}" if delta else ""
        self.reason = (f"{name} did not improve{by} for {self.bad_evals} evaluation(s) "
                       f"(best {self.best:.4f} at step {self.best_step:,})" if self.best is not None else
                       f"{name} was not finite for {self.bad_evals} evaluation(s)")
        return True

    def _improves(self, value: float, config: dict[str, Any]) -> bool:
        if self.best is None:
            return True
        delta = config["min_delta"]
        return value < self.best - delta if config["mode"] == "min" else value > self.best + delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """The counter of a checkpoint (absent in checkpoints of runs without early stopping: a fresh start)."""
        state = state if isinstance(state, Mapping) else {}
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.bad_evals = int(state.get("bad_evals", 0))


__all__ = ["EarlyStopping"]
