"""TEMPORARY: the call forms of the old ``train/loop.py``, until the Trainer that calls the Task protocol replaces
it. Delete this module, and its line in ``entrenar.tasks.for_recipe``, with the old loop.

The old loop passes the recipe it built the task from, and ``recipe.model.path`` as the path to load, so each
method here forwards to the protocol method and drops what the task already holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from entrenar.tasks.classification.task import ClassificationTask


class LoopClassificationTask(ClassificationTask):
    """A ClassificationTask answering the old loop's calls (``examples`` and the old ``load``, ``stream``,
    ``evaluate``, ``finish``)."""

    def load(self, path: Any, dtype: str, device: torch.device, quantize: str | None):  # type: ignore[override]
        return super().load(dtype, device, quantize)

    def examples(self, path: str, role: str, recipe: Any, tokenizer: Any, skipped: list | None = None):
        return self.read(path, role, tokenizer, skipped)

    def stream(self, examples: list, recipe: Any):  # type: ignore[override]
        return super().stream(examples, None)

    def evaluate(self, model: torch.nn.Module, validation: list, recipe: Any):  # type: ignore[override]
        return super().evaluate(model, validation, None)  # the loop took the eval_batches subset: a no-op again

    def finish(self, model: Any, validation: list, recipe: Any, run_dir: Path, output: Path):  # type: ignore[override]
        return super().finish(model, None, validation, run_dir, output, None, None)
