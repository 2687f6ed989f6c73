"""How a data file is read and scored for held-out loss: as the run that made the model trained.

``entrenar eval`` and ``entrenar quantize --data`` both take their rules from here, so the perplexity one prints
is the other's: the flags given, else the run's recipe (data.seq_len, data.train_on, data.add_eos, its format
and field names), else :data:`DEFAULTS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from entrenar.config import Recipe

DEFAULTS: dict[str, Any] = {"seq_len": 512, "train_on": "all", "add_eos": True}  # without a run's recipe


@dataclass(frozen=True)
class EvalRules:
    """What :func:`entrenar.evaluation.loss.evaluate_file` takes besides the model and the file."""

    seq_len: int = DEFAULTS["seq_len"]
    train_on: str = DEFAULTS["train_on"]
    add_eos: bool = DEFAULTS["add_eos"]
    fmt: str = "auto"
    columns: Mapping[str, str] | None = None
    from_recipe: bool = False  # a run's recipe supplied what the flags did not

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``evaluate_file``."""
        return {"seq_len": self.seq_len, "train_on": self.train_on, "add_eos": self.add_eos, "fmt": self.fmt,
                "columns": self.columns}

    def describe(self) -> str:
        """One line: ``seq_len 32, train_on completion, add_eos false``."""
        return f"seq_len {self.seq_len}, train_on {self.train_on}, add_eos {str(self.add_eos).lower()}"


def eval_rules(
    recipe: Recipe | None, seq_len: int | None = None, train_on: str | None = None, add_eos: bool | None = None
) -> EvalRules:
    """The rules for scoring a data file: each setting given (not None), else the run's ``recipe``, else
    :data:`DEFAULTS`; a recipe also brings its data.format and field names (the file is read as training read it)."""
    if recipe is None:
        return EvalRules(seq_len=DEFAULTS["seq_len"] if seq_len is None else seq_len,
                         train_on=DEFAULTS["train_on"] if train_on is None else train_on,
                         add_eos=DEFAULTS["add_eos"] if add_eos is None else add_eos)
    d = recipe.data
    columns = {"text": d.text_field, "prompt": d.prompt_field, "completion": d.completion_field,
               "messages": d.messages_field}
    return EvalRules(seq_len=d.seq_len if seq_len is None else seq_len,
                     train_on=d.train_on if train_on is None else train_on,
                     add_eos=d.add_eos if add_eos is None else add_eos,
                     fmt=d.format, columns=columns, from_recipe=True)
