"""What a run tells the person watching it: the resolved recipe, what it is doing, evaluations, log lines.

Lines go through ``tqdm.write``, so they print above a progress bar instead of
breaking it. A silent Console (``enabled=False``, the library's default)
prints nothing: only ``entrenar train`` turns it on.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

import yaml
from tqdm import autonotebook
from tqdm.auto import tqdm
from tqdm.std import tqdm as terminal_tqdm

from entrenar.config import Recipe


def compact_yaml(recipe: Recipe) -> str:
    """The whole recipe as YAML, one flow mapping per section (a few lines instead of a hundred)."""
    lines = []
    for section, values in recipe.to_dict().items():
        text = yaml.safe_dump({section: values}, default_flow_style=True, sort_keys=False, width=110).strip()
        lines.append(text[1:-1] if text.startswith("{") else text)  # drop the outer braces: a block of sections
    return "\n".join(lines)


def interactive(stream: TextIO | None = None) -> bool:
    """Whether progress may be drawn in place: ``stream`` (default stderr) is a terminal, or tqdm draws notebook
    widgets. Elsewhere (a log file, a pipe, CI) a bar's carriage returns run its updates into one line, so
    progress is told in whole lines instead."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty()) or autonotebook.tqdm is not terminal_tqdm


class Console:
    """Prints run messages when enabled; ``log_lines`` adds a line per ``log_every`` steps (no progress bar)."""

    def __init__(self, enabled: bool, log_lines: bool = False) -> None:
        self.enabled = enabled
        self.log_lines = enabled and log_lines

    def say(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text)

    def recipe(self, recipe: Recipe) -> None:
        self.say("recipe (resolved):\n" + "\n".join("  " + line for line in compact_yaml(recipe).splitlines()))

    def step(self, record: Mapping[str, Any], max_steps: int) -> None:
        """One log line from a metrics.jsonl record, in place of the progress bar."""
        if not (self.log_lines or self.enabled and "skipped" in record):  # a dropped update is always told
            return
        loss = record.get("loss")
        parts = [f"step {record['step']:,}/{max_steps:,}", f"loss {loss:.4f}" if loss is not None else "loss nan",
                 f"lr {record['lr']:.2e}"]
        if record.get("grad_norm") is not None:
            parts.append(f"grad_norm {record['grad_norm']:.3g}")
        if record.get("train_accuracy") is not None:
            parts.append(f"train_accuracy {record['train_accuracy']:.3f}")
        if record.get("tokens_per_s") is not None:
            parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
        if "skipped" in record:
            parts.append(f"update skipped: {record['skipped']}")
        if record.get("scaler_skipped"):
            parts.append("update skipped by the fp16 scaler")
        self.say("  ".join(parts))

    def evaluation(self, step: int, scalars: Mapping[str, float | None], best: bool, note: str = "") -> None:
        """One line per evaluation (a task's eval scalars: eval_loss first), with or without a progress bar."""
        shown = [f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}"
                 for name, value in list(scalars.items())[:6]]
        text = f"step {step:,}: " + "  ".join(shown) + ("  (best so far)" if best else "")
        self.say(text + (f"  {note}" if note else ""))


__all__ = ["Console", "compact_yaml", "interactive"]
