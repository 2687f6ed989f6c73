"""TRL's preference metrics: summed on the device over micro-batches, held-out evaluations, and the best one.

Metrics carry TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``; ``kl`` for KTO, ``nll_loss`` for ORPO), per step in metrics.jsonl and per
evaluation with the ``eval_`` prefix; the held-out ``rewards/accuracies`` picks the best checkpoint (KTO, whose
examples are unpaired: the held-out loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from entrenar.io.run_dir import METRICS_FILE
from entrenar.tasks.base import SummaryRow
from entrenar.train.metrics import read_metrics

ACCURACY = "rewards/accuracies"  # the held-out metric that picks the best checkpoint (higher is better)


@dataclass
class PreferenceEval:
    """A held-out evaluation: the mean loss per pair (or KTO example) and TRL's metrics (without ``eval_``)."""

    loss: float
    metrics: dict[str, float]
    examples: int

    @property
    def accuracy(self) -> float:
        return self.metrics.get(ACCURACY, float("nan"))


class MetricSums:
    """Sums and counts of each metric over micro-batches, kept on the device (no read until asked)."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, name: str, values: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add ``values``, each counted once, or ``weight`` times (0: a padded pair of the fixed layout)."""
        values = values.detach().float().reshape(-1)
        total, count = self.sums.get(name, (values.new_zeros(()), values.new_zeros(())))
        if weight is None:
            self.sums[name] = (total + values.sum(), count + values.numel())
        else:
            weight = weight.detach().float().reshape(-1)
            self.sums[name] = (total + (values * weight).sum(), count + weight.sum())

    def packed(self) -> tuple[list[str], torch.Tensor]:
        """The names, and their (sum, count) one after the other in one tensor (what a CUDA graph hands back)."""
        names = list(self.sums)
        return names, torch.stack([x for name in names for x in self.sums[name]])

    def merge(self, names: list[str], packed: torch.Tensor) -> None:
        """Add sums and counts as :meth:`packed` gave them."""
        for i, name in enumerate(names):
            total, count = self.sums.get(name, (packed.new_zeros(()), packed.new_zeros(())))
            self.sums[name] = (total + packed[2 * i], count + packed[2 * i + 1])

    def means(self) -> dict[str, torch.Tensor]:
        # NaN where nothing was counted (a KTO micro-batch without undesirable examples): left out when logged
        means = {name: total / count for name, (total, count) in self.sums.items()}
        if "rewards/chosen" in means and "rewards/rejected" in means and "rewards/margins" not in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]  # KTO's, as TRL's
        return means


def score(result: PreferenceEval, by_loss: bool) -> tuple[float, float]:
    """What picks the best evaluation, higher better: the preference accuracy, then the lower loss (``by_loss``,
    KTO, whose examples are unpaired: the lower loss)."""
    if by_loss:
        return -result.loss, 0.0
    return result.accuracy, -result.loss


def best_logged(path: Path, by_loss: bool) -> tuple[float, float] | None:
    """The :func:`score` of the best evaluation a run's metrics.jsonl logged (None: none yet)."""
    records = read_metrics(path) if path.is_file() else []
    losses = {r["step"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None}
    if by_loss:
        return max(((-loss, 0.0) for loss in losses.values()), default=None)
    scores = [(r[f"eval_{ACCURACY}"], -losses.get(r["step"], 0.0)) for r in records
              if r.get(f"eval_{ACCURACY}") is not None]
    return max(scores) if scores else None


def _logged_start(run_dir: Path) -> tuple[float, float] | None:
    """The held-out (accuracy, margin) a run logged at step 0 (None: not logged)."""
    path = run_dir / METRICS_FILE
    records = read_metrics(path) if path.is_file() else []
    for r in records:
        if r.get("step") == 0 and r.get(f"eval_{ACCURACY}") is not None:
            return r[f"eval_{ACCURACY}"], r.get("eval_rewards/margins") or 0.0
    return None


def accuracy_rows(run_dir: Path, before: PreferenceEval | None, after: PreferenceEval | None,
                  by_loss: bool) -> list[SummaryRow]:
    """The summary's held-out preference accuracy and margin before and after training (``by_loss``, KTO: the
    held-out loss); before: this run's evaluation, or the one a resumed run logged at step 0."""
    if after is None:
        return []
    if by_loss:
        return [("held-out KTO loss", (f"{before.loss:.4f} -> " if before is not None else "") + f"{after.loss:.4f}"
                 + f" (margin {after.metrics.get('rewards/margins', 0.0):+.4f})")]
    start = (before.accuracy, before.metrics.get("rewards/margins", 0.0)) if before is not None \
        else _logged_start(run_dir)
    now = f"{after.accuracy:.3f} (margin {after.metrics.get('rewards/margins', 0.0):+.4f})"
    if start is None:
        return [("held-out preference accuracy", now)]
    return [("held-out preference accuracy", f"{start[0]:.3f} (margin {start[1]:+.4f}) -> {now}")]


__all__ = ["ACCURACY", "MetricSums", "PreferenceEval", "accuracy_rows", "best_logged", "score"]
