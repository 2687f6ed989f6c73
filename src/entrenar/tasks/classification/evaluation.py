"""A classifier's logits on labeled texts, their metrics, and which way each metric is better.

The metrics themselves are in :mod:`entrenar.evaluation.metrics` (numpy); this module runs the model and names
what a run may choose its best checkpoint by (``task.metric``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from entrenar.errors import ConfigError
from entrenar.evaluation import metrics as M
from entrenar.evaluation.loss import autocast_for
from entrenar.models.transformer import compute_device
from entrenar.tasks.classification.data import LabeledText, pad_rows

# The scalar metrics each problem type reports (what task.metric may name, besides loss).
METRICS = {
    "single_label": {"accuracy", "macro_f1", "weighted_f1", "mcc", "kappa", "ece", "mce", "brier", "log_loss",
                     "top2_accuracy", "top3_accuracy", "top5_accuracy"},
    "multi_label": {"micro_f1", "macro_f1", "subset_accuracy", "hamming_loss"},
    "regression": {"rmse", "mae", "r2", "spearman"},
}
HIGHER_IS_BETTER = {"accuracy", "macro_f1", "weighted_f1", "micro_f1", "mcc", "kappa", "r2", "spearman",
                    "subset_accuracy", "top2_accuracy", "top3_accuracy", "top5_accuracy"}
LOWER_IS_BETTER = {"loss", "rmse", "mae", "ece", "mce", "brier", "log_loss", "hamming_loss"}


@dataclass
class ClassificationEval:
    """One evaluation: mean loss and the metrics (what the run logs and chooses the best checkpoint by)."""

    loss: float
    metrics: dict
    examples: int = 0


@torch.no_grad()
def predict_logits(model: torch.nn.Module, examples: list[LabeledText], batch_size: int, pad_id: int,
                   precision: str = "fp32") -> np.ndarray:
    """Logits [N, num_labels] of ``examples`` in order (eval mode, autocast as training's precision)."""
    device = compute_device(model)
    was_training = model.training
    model.eval()
    out = []
    try:
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))  # similar lengths pad little
        for start in range(0, len(order), batch_size):
            chunk = [examples[i] for i in order[start:start + batch_size]]
            input_ids, mask = pad_rows(chunk, pad_id)
            with autocast_for(device, precision):
                logits = model(input_ids.to(device), mask.to(device))
            out.append(logits.float().cpu())
    finally:
        model.train(was_training)
    logits = torch.cat(out).numpy().astype(np.float64)
    result = np.empty_like(logits)
    result[np.array(order)] = logits
    return result


def targets_array(examples: list[LabeledText]) -> np.ndarray:
    """The targets of ``examples``: class ids [N], or [N, num_labels] 0/1 vectors or values."""
    return np.array([e.target for e in examples])


def thresholds_of(setting: Any, num_labels: int) -> np.ndarray:
    """Per-label decision thresholds of ``task.threshold``: a list, one number for all, or 0.5 (unset or tune)."""
    if isinstance(setting, (list, tuple)):
        if len(setting) != num_labels:
            raise ConfigError(f"task.threshold: {len(setting)} thresholds for {num_labels} labels")
        return np.array(setting, dtype=np.float64)
    return np.full(num_labels, 0.5 if setting in (None, "tune") else float(setting))


def score(problem_type: str, logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0,
          thresholds: np.ndarray | None = None) -> dict:
    """The metrics of one set of logits against targets."""
    if problem_type == "single_label":
        return M.single_label(targets, M.softmax(logits, temperature))
    if problem_type == "multi_label":
        thresholds = np.full(logits.shape[1], 0.5) if thresholds is None else thresholds
        return M.multi_label(targets, M.sigmoid(logits, temperature), thresholds)
    return M.regression(targets, logits)


def metric_direction(name: str) -> int:
    """+1 when higher is better, -1 when lower is."""
    if name in HIGHER_IS_BETTER:
        return 1
    if name in LOWER_IS_BETTER:
        return -1
    raise ConfigError(f"task.metric: unknown metric {name!r} (higher is better: {', '.join(sorted(HIGHER_IS_BETTER))}; "
                      f"lower: {', '.join(sorted(LOWER_IS_BETTER))})")
