"""What the labels of a run are, and a record's label value parsed into a target (errors name file and line).

A label is a name or a class id (single_label), a list of them or one string of names joined by commas
(multi_label), a number or a list of numbers (regression).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from entrenar.data.sources import Record
from entrenar.errors import ConfigError, DataError


@dataclass
class LabelSpec:
    """What labels mean for one run: the problem type, names (or None) and how many."""

    problem_type: str
    names: list[str] | None
    num_labels: int

    def parse(self, value: Any, where: str) -> int | list[float]:
        """A record's label value as a target, or DataError naming ``where``."""
        if self.problem_type == "regression":
            values = value if isinstance(value, list) else [value]
            try:
                out = [float(v) for v in values]
            except (TypeError, ValueError):
                raise DataError(f"{where}: regression target {value!r} is not a number") from None
            if len(out) != self.num_labels or not all(math.isfinite(v) for v in out):
                raise DataError(f"{where}: expected {self.num_labels} finite number(s), got {value!r}")
            return out
        if self.problem_type == "multi_label":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise DataError(f"{where}: a multi-label target is a list of labels, got {value!r}")
            vector = [0.0] * self.num_labels
            for v in value:
                vector[self._class(v, where)] = 1.0
            return vector
        return self._class(value, where)

    def _class(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or value is None:
            raise DataError(f"{where}: label {value!r} is not a label name or class id")
        if self.names is not None and str(value) in self.names:
            return self.names.index(str(value))
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, int):
            if 0 <= value < self.num_labels:
                return value
            raise DataError(f"{where}: class id {value} is out of range 0..{self.num_labels - 1}")
        known = f" (labels: {', '.join(self.names)})" if self.names else ""
        raise DataError(f"{where}: unknown label {value!r}{known}")


def label_spec(task: Any, records: Sequence[Record] | None = None, label_field: str = "label") -> LabelSpec:
    """The labels of a run (``task``: the recipe's task section): named in the recipe, counted there, or (names
    only) collected from the records."""
    names = list(task.labels) if task.labels else None
    num = len(names) if names else task.num_labels
    if num is None and task.problem_type == "regression":
        num = 1
    if num is None and records is not None:
        found = set()
        for r in records:
            v = r.fields.get(label_field)
            for item in (v if isinstance(v, list) else [v]):
                found.add(str(item))
        names = sorted(found)
        num = len(names)
    if not num:
        raise ConfigError("task: name the labels (task.labels) or their number (task.num_labels)")
    return LabelSpec(task.problem_type, names, num)
