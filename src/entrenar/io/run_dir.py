"""A training run's folder: the one place its names are written down.

    run/
      recipe.yaml          the resolved recipe (a resume checks against it)
      metrics.jsonl        a line per step and per evaluation
      arch.json            architecture, parameter counts, fingerprint
      skipped.jsonl        records data.on_error=skip left out
      checkpoints/         step-N/ folders, the latest and best pointers (:mod:`entrenar.train.checkpoint`)
      adapter/ | model/    the result: a LoRA adapter (PEFT format) or a model folder
      best/                the same at the best evaluation
      quantized/           the integer model of a QAT run
      loss_curve.png, expert_load.png, report.json, report.md, tensorboard/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
ARCH_FILE = "arch.json"
SKIPPED_FILE = "skipped.jsonl"
CHECKPOINTS_DIR = "checkpoints"
ADAPTER_DIR, MODEL_DIR, BEST_DIR, QUANTIZED_DIR = "adapter", "model", "best", "quantized"
LOSS_CURVE, EXPERT_LOAD = "loss_curve.png", "expert_load.png"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run folder."""

    root: Path

    @property
    def recipe(self) -> Path:
        return self.root / RECIPE_FILE

    @property
    def best(self) -> Path:
        return self.root / BEST_DIR

    @property
    def quantized(self) -> Path:
        return self.root / QUANTIZED_DIR

    @property
    def loss_curve(self) -> Path:
        return self.root / LOSS_CURVE

    @property
    def expert_load(self) -> Path:
        return self.root / EXPERT_LOAD


__all__ = ["ADAPTER_DIR", "ARCH_FILE", "BEST_DIR", "CHECKPOINTS_DIR", "METRICS_FILE", "MODEL_DIR", "QUANTIZED_DIR",
           "RECIPE_FILE", "RunDir", "SKIPPED_FILE"]
