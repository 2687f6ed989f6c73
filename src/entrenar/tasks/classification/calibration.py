"""Calibration fitted at the end of a run on the validation logits, saved with the model for prediction."""

from __future__ import annotations

from typing import Any

import numpy as np

from entrenar.evaluation import metrics as M
from entrenar.tasks.classification.evaluation import thresholds_of


def calibrate(problem_type: str, logits: np.ndarray, targets: np.ndarray, threshold_setting: Any = None) -> dict:
    """Temperature (single_label, fitted on these logits) and per-label thresholds (multi_label: tuned on
    these logits unless the recipe sets them)."""
    if problem_type == "single_label":
        return {"temperature": M.fit_temperature(logits, targets)}
    if problem_type == "multi_label":
        if threshold_setting in (None, "tune"):
            thresholds = M.tune_thresholds(targets, M.sigmoid(logits))
        else:
            thresholds = thresholds_of(threshold_setting, logits.shape[1])
        return {"thresholds": [float(t) for t in thresholds]}
    return {}
