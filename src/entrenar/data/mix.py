"""Several training files in one set of examples, each weighted: ``data.train: [{path, weight, format}, ...]``.

A file's ``weight`` is how many times its examples come in one epoch of the mix: ``2`` repeats each twice,
``1`` takes each once, ``0.5`` takes half of them. The whole part repeats every example; the fraction takes that
share of the file's examples (rounded), drawn without repetition by a generator seeded by ``(seed, file index)``
and kept in file order. The mix is the files' parts in the recipe's order; the batch stream shuffles it (when
``data.shuffle`` is on), so the same recipe and seed give the same examples in the same order, and a resumed run
finds the stream where it left it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def weighted(examples: Sequence[T], weight: float, seed: int, index: int) -> list[T]:
    """``examples`` repeated ``weight`` times: whole copies, then a seeded share for the fraction."""
    whole = math.floor(weight)
    share = round((weight - whole) * len(examples))
    rng = np.random.default_rng([seed, index])
    chosen = sorted(int(i) for i in rng.choice(len(examples), size=share, replace=False)) if share else []
    return [*examples] * whole + [examples[i] for i in chosen]


def mix(parts: Sequence[tuple[Sequence[T], float]], seed: int) -> list[T]:
    """The examples of each ``(examples, weight)`` part, weighted, in the parts' order."""
    return [example for index, (examples, weight) in enumerate(parts)
            for example in weighted(examples, weight, seed, index)]


__all__ = ["mix", "weighted"]
