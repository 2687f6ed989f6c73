"""Synthetic data from a seed, the same bytes on any machine: ``synth:mixture:N[:SEED]`` and
``synth:regression:N[:SEED]`` (see docs/EXPERIMENTS.md for the rules).

Record ``i`` is drawn from its own generator, seeded with the SHA-256 of ``(kind, seed, i)``, so the first
100 records of ``synth:mixture:1000`` are ``synth:mixture:100``, and nothing depends on Python's hash
randomisation or on the platform. Python's Mersenne Twister with an integer seed and ``randrange`` give the
same numbers on every platform and every Python 3 since 3.2.

- ``mixture``: K=4 hidden sub-tasks over the alphabet ``a``..``h``, on sequences of 3 to 8 symbols: copy
  (``abc=abc``), reverse (``abc~cba``), sort (``cab^abc``) and modular add of two sequences (``abc+bcd:bdf``,
  symbol i + symbol i mod 8). Each record is ``prompt`` (up to and including the operator) and
  ``completion``, with the hidden ``task`` (0..3) and ``task_name`` beside them (not in the text).
- ``regression``: 4 features in [-1, 1] with two decimals, written ``x1=0.25 x2=-0.50 x3=0.10 x4=0.75``;
  ``label`` = 2*x1 - x2 + 0.5*x3*x4 + sin(3*x2), rounded to 6 decimals, computed from the written values.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from entrenar.errors import ConfigError

KINDS = ("mixture", "regression")
ALPHABET = "abcdefgh"
TASKS = ("copy", "reverse", "sort", "add")
_OPERATORS = {"copy": "=", "reverse": "~", "sort": "^", "add": "+"}
MIN_LEN, MAX_LEN = 3, 8
NUM_FEATURES = 4
MAX_RECORDS = 10_000_000
_SPEC = re.compile(r"synth:([a-z]+):(\d+)(?::(\d+))?")


@dataclass(frozen=True)
class SynthSpec:
    kind: str
    count: int
    seed: int | None  # None: the run's training.seed


def is_synth(source: Any) -> bool:
    """True for a ``synth:`` data source name."""
    return str(source).startswith("synth:")


def parse(source: str) -> SynthSpec:
    """``synth:KIND:N[:SEED]``, or a ConfigError saying what is allowed."""
    found = _SPEC.fullmatch(str(source))
    if not found or found.group(1) not in KINDS:
        raise ConfigError(f"{source}: a synthetic source is synth:KIND:N or synth:KIND:N:SEED with KIND one of "
                          f"{', '.join(KINDS)} and N, SEED non-negative integers")
    count = int(found.group(2))
    if not 1 <= count <= MAX_RECORDS:
        raise ConfigError(f"{source}: N must be in [1, {MAX_RECORDS:,}], got {count}")
    return SynthSpec(found.group(1), count, None if found.group(3) is None else int(found.group(3)))


def _rng(kind: str, seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"entrenar-synth:{kind}:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _symbols(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(len(ALPHABET)) for _ in range(length)]


def _text(values: list[int]) -> str:
    return "".join(ALPHABET[v] for v in values)


def mixture_record(seed: int, index: int) -> dict[str, Any]:
    """Record ``index`` of the mixture for ``seed``."""
    rng = _rng("mixture", seed, index)
    task = rng.randrange(len(TASKS))
    name = TASKS[task]
    xs = _symbols(rng, rng.randrange(MIN_LEN, MAX_LEN + 1))
    if name == "copy":
        prompt, answer = _text(xs), xs
    elif name == "reverse":
        prompt, answer = _text(xs), xs[::-1]
    elif name == "sort":
        prompt, answer = _text(xs), sorted(xs)
    else:
        ys = _symbols(rng, len(xs))
        prompt, answer = _text(xs) + "+" + _text(ys), [(x + y) % len(ALPHABET) for x, y in zip(xs, ys, strict=True)]
    prompt += ":" if name == "add" else _OPERATORS[name]
    completion = _text(answer)
    return {"prompt": prompt, "completion": completion, "task": task, "task_name": name}


def regression_target(features: list[float]) -> float:
    """The regression rule (documented in docs/EXPERIMENTS.md)."""
    x1, x2, x3, x4 = features
    return round(2 * x1 - x2 + 0.5 * x3 * x4 + math.sin(3 * x2), 6)


def regression_record(seed: int, index: int) -> dict[str, Any]:
    """Record ``index`` of the regression set for ``seed``."""
    rng = _rng("regression", seed, index)
    features = [rng.randrange(-100, 101) / 100 for _ in range(NUM_FEATURES)]
    text = " ".join(f"x{i + 1}={x:.2f}" for i, x in enumerate(features))
    return {"text": text, "label": regression_target(features), "features": features}


def records(spec: SynthSpec, default_seed: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, fields) of every record of ``spec``; ``default_seed`` when the spec names none."""
    seed = default_seed if spec.seed is None else spec.seed
    make = mixture_record if spec.kind == "mixture" else regression_record
    for index in range(spec.count):
        yield index, make(seed, index)


__all__ = ["ALPHABET", "KINDS", "TASKS", "SynthSpec", "is_synth", "mixture_record", "parse", "records",
           "regression_record", "regression_target"]
