"""Reward functions: Python callables named in the recipe, with TRL's signature, and built-ins for common cases.

The contract (TRL's): ``fn(prompts: list[str], completions: list[str], **columns) -> list[float]``, one number per
completion; ``columns`` are the dataset's other columns, one value per completion (a prompt's value repeated for
each of its generations). Unlike TRL, ``None`` (unscorable) is refused: a reward that cannot score a completion
should say what it is worth. A function that raises, returns something other than a list of finite numbers, or the
wrong number of them, is a :class:`~entrenar.errors.ConfigError` naming it (the CLI exits 2).

A recipe names functions as ``module:function`` (imported) or by a built-in's name: ``exact_answer`` (1.0 when the
text after the last ``answer_marker`` in the completion, stripped, equals the ``answer`` column), ``format`` (1.0 when
the completion matches ``format_regex`` in full), ``length`` (``-|len(completion) - target_length| /
target_length``, characters).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from entrenar.errors import ConfigError

RewardFn = Callable[..., Sequence[float]]


def exact_answer(prompts: list[str], completions: list[str], *, answer: Sequence[Any], marker: str = "=",
                 **_: Any) -> list[float]:
    """1.0 where the completion's text after its last ``marker`` (the whole completion if it has none), stripped,
    equals ``str(answer)`` stripped, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        final = completion.rsplit(marker, 1)[-1] if marker else completion
        out.append(1.0 if final.strip() == str(expected).strip() else 0.0)
    return out


def format_match(prompts: list[str], completions: list[str], *, pattern: str, **_: Any) -> list[float]:
    """1.0 where the whole completion matches the regular expression ``pattern`` (DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(c) else 0.0 for c in completions]


def length_penalty(prompts: list[str], completions: list[str], *, target: int, **_: Any) -> list[float]:
    """``-|len - target| / target`` per completion (characters): 0 at the target length, negative either side."""
    return [-abs(len(c) - target) / target for c in completions]


@dataclass(frozen=True)
class Reward:
    """One named reward function and its weight in the total."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def resolve(name: str, *, answer_marker: str = "=", format_regex: str | None = None,
            target_length: int | None = None) -> RewardFn:
    """The callable a recipe's ``reward.functions`` entry names: ``module:function`` or a built-in's name."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"reward.functions: cannot import module {module_name!r} of {name!r}: {exc}") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"reward.functions: {name!r}: module {module_name!r} has no callable {attr!r}")
        return fn
    if name == "exact_answer":
        return lambda prompts, completions, **cols: exact_answer(prompts, completions, marker=answer_marker,
                                                                 **_need(cols, "answer", name))
    if name == "format":
        if not format_regex:
            raise ConfigError("reward.functions: 'format' needs reward.format_regex")
        try:
            re.compile(format_regex)
        except re.error as exc:
            raise ConfigError(f"reward.format_regex: {format_regex!r} is not a regular expression: {exc}") from exc
        return lambda prompts, completions, **cols: format_match(prompts, completions, pattern=format_regex)
    if name == "length":
        if not target_length or target_length <= 0:
            raise ConfigError("reward.functions: 'length' needs reward.target_length > 0")
        return lambda prompts, completions, **cols: length_penalty(prompts, completions, target=target_length)
    raise ConfigError(f"reward.functions: {name!r} is neither module:function nor a built-in "
                      f"(exact_answer, format, length)")


def _need(columns: dict[str, Any], key: str, who: str) -> dict[str, Any]:
    if key not in columns:
        raise ConfigError(f"reward {who!r} needs a dataset column {key!r}; the data has: "
                          f"{', '.join(sorted(columns)) or 'none'}")
    return {key: columns[key]}


def score(rewards: Sequence[Reward], prompts: list[str], completions: list[str],
          columns: dict[str, list[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total [N], per_function [N, F])``: each function's rewards and their weighted sum, fp32."""
    n = len(completions)
    per = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=prompts, completions=completions, **columns)
        except ConfigError:
            raise
        except Exception as exc:  # a user's function: any failure is reported with its name
            raise ConfigError(f"reward function {reward.name!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(values, (list, tuple)) and not (isinstance(values, torch.Tensor) and values.ndim == 1):
            raise ConfigError(f"reward function {reward.name!r} returned {type(values).__name__}; it must return a "
                              f"list of {n} numbers")
        if len(values) != n:
            raise ConfigError(f"reward function {reward.name!r} returned {len(values)} values for {n} completions")
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"reward function {reward.name!r} returned {value!r} for completion {i}; "
                                  f"rewards must be finite numbers")
            per[i, j] = float(value)
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float32)
    return per @ weights, per


__all__ = ["Reward", "RewardFn", "exact_answer", "format_match", "length_penalty", "resolve", "score"]
