"""Causal language modelling: today's token loss, as the training loop has always scored it.

The loop keeps its own data reading, packing and fused loss for this task;
this object answers only the questions a classification run answers
differently (which model, what counts as a target, which evaluation is best).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from entrenar.data import num_target_tokens
from entrenar.loading import load


@dataclass
class CausalLMTask:
    recipe: Any
    name: str = "causal_lm"

    def load(self, path, dtype, device, quantize):
        import entrenar
        from entrenar.models import random_init as scratch

        if scratch.is_random(self.recipe):  # model.init random: built from model.config, seeded
            if quantize is not None:
                from entrenar.errors import ConfigError

                raise ConfigError("lora.quantize_base: a random-init model has no pretrained base to quantize")
            return scratch.build(self.recipe, dtype, device)
        return load(path, dtype=dtype, device=device, quantize=quantize)

    def prepare(self, model) -> None:
        """Nothing beyond what the adapters froze or left trainable."""

    def num_targets(self, batch) -> int:
        return num_target_tokens(batch)

    def log_eval(self, metrics_log, step: int, result) -> bool:
        """Log the held-out loss; True when it is the lowest so far."""
        return metrics_log.log_eval(step, result.loss)

    def eval_scalars(self, result) -> dict[str, float]:
        """What early stopping and the console read of an evaluation."""
        return {"eval_loss": result.loss, "eval_ppl": result.perplexity}

    def finish(self, model, validation, recipe, run_dir: Path, output: Path) -> list[tuple[str, str]]:
        return []
