"""RoPE scalings beyond linear and llama3, computed as transformers computes them.

LongRoPE (Phi-3 / Phi-4, ``rope_type: longrope``): each rotated frequency is divided by its own factor, one list
for contexts up to ``original_max_position_embeddings`` (``short_factor``) and one beyond (``long_factor``); cos
and sin are multiplied by ``attention_factor`` (by default ``sqrt(1 + ln(factor) / ln(original))``, with
``factor = max_position_embeddings / original`` unless given). As in transformers, a batch takes the long factors
when its largest position id reaches past the original context, so every row of a batch uses the same set.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from entrenar.errors import ModelError

if TYPE_CHECKING:
    from entrenar.models.config import ModelConfig


def check_longrope(scaling: dict[str, Any], source: str) -> None:
    """LongRoPE's keys checked before use: two lists of positive factors and the original context."""
    def bad(key: str, expected: str) -> ModelError:
        return ModelError(f"{source}: 'rope_scaling.{key}' must be {expected}, got {scaling.get(key)!r}"[:400])

    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list) or not value or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in value):
            raise bad(key, "a non-empty list of positive numbers")
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise bad("original_max_position_embeddings", "a positive integer")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value <= 0):
            raise bad(key, "a positive number or null")


def _rotary_dim(config: ModelConfig) -> int:
    assert config.head_dim is not None  # ModelConfig.__post_init__ filled it in
    return int(config.head_dim * config.partial_rotary_factor)


def longrope_inv_freq(config: ModelConfig, long: bool) -> torch.Tensor:
    """LongRoPE's inverse frequencies [rotary_dim / 2]: the short-context set, or the long one (``long``)."""
    scaling = config.rope_scaling or {}
    key = "long_factor" if long else "short_factor"
    dim = _rotary_dim(config)
    factors = torch.tensor(scaling[key], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ModelError(f"model config: 'rope_scaling.{key}' has {factors.numel()} factors; the {dim} rotated dims "
                         f"of each head need {dim // 2}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * config.rope_theta ** exponent)


def rope_attention_scaling(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor, 1 for the other RoPE types."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_select(config: ModelConfig, position_ids: torch.Tensor, short: torch.Tensor,
                    long: torch.Tensor) -> torch.Tensor:
    """The frequencies a batch rotates by: ``long`` when its largest position is past the original context.

    A tensor choice (no host sync), as transformers' ``longrope_frequency_update`` makes it."""
    original = (config.rope_scaling or {})["original_max_position_embeddings"]
    return torch.where(position_ids.max() + 1 > original, long, short)
