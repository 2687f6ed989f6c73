"""The loss of a classification batch, summed: the training step divides it by the step's targets.

The targets are rows, weighted by their class weight, for single_label and label entries otherwise, so a step's
loss is the mean that transformers' ``*ForSequenceClassification`` computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, problem_type: str, weights: torch.Tensor | None = None,
             label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed loss of a batch: CE (weights, label smoothing), BCE with logits, or MSE."""
    logits = logits.float()
    if problem_type == "single_label":
        return F.cross_entropy(logits, labels, weight=weights, label_smoothing=label_smoothing, reduction="sum")
    if problem_type == "multi_label":
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return F.mse_loss(logits, labels.to(logits.dtype), reduction="sum")
