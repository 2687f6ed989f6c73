"""RoPE scalings beyond linear and llama3, computed as transformers' modeling_rope_utils computes them.

* ``longrope`` (Phi-3 / Phi-4): each rotated frequency is divided by its own factor, one list for contexts up to
  ``original_max_position_embeddings`` (``short_factor``) and one beyond (``long_factor``). As in transformers, a
  batch takes the long factors when its largest position id reaches past the original context, so every row of a
  batch uses the same set.
* ``yarn`` (gpt-oss, DeepSeek-V3, Qwen long-context configs): each frequency blended between the original
  (extrapolated) and the one slowed by ``factor`` (interpolated) by a ramp over the dimensions whose number of
  rotations over ``original_max_position_embeddings`` lies between ``beta_slow`` and ``beta_fast``.
* ``dynamic`` (dynamic NTK): the base grows with the sequence once it passes ``max_position_embeddings``; at or
  below it the frequencies are the unscaled ones. transformers recomputes them in the forward from the batch's
  largest position (``dynamic_rope_update``); the decoder does the same (:meth:`Transformer.rope`).

LongRoPE and YaRN multiply cos and sin by an attention factor, one function for both
(:func:`rope_attention_scaling`). DeepSeek-V3's multi-head latent attention also multiplies its softmax scale by
YaRN's ``mscale(factor, mscale_all_dim)^2`` (:mod:`entrenar.models.mla`, :func:`yarn_mscale`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from entrenar.errors import ModelError

if TYPE_CHECKING:
    from entrenar.models.config import ModelConfig

ROPE_SCALING_TYPES = ("longrope", "yarn", "dynamic")
# The keys yarn and dynamic must give (positive numbers), checked when config.json is read (longrope's:
# check_longrope).
REQUIRED_KEYS = {"yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",)}


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


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``1 / base^(2i / dim)`` for i < dim / 2 (fp32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_inv_freq(config: ModelConfig, long: bool) -> torch.Tensor:
    """LongRoPE's inverse frequencies [rotary_dim / 2]: the short-context set, or the long one (``long``)."""
    scaling = config.rope_scaling or {}
    key = "long_factor" if long else "short_factor"
    dim = config.rotary_dim
    factors = torch.tensor(scaling[key], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ModelError(f"model config: 'rope_scaling.{key}' has {factors.numel()} factors; the {dim} rotated dims "
                         f"of each head need {dim // 2}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * config.rope_theta ** exponent)


def longrope_select(config: ModelConfig, position_ids: torch.Tensor, short: torch.Tensor,
                    long: torch.Tensor) -> torch.Tensor:
    """The frequencies a batch rotates by: ``long`` when its largest position is past the original context.

    A tensor choice (no host sync), as transformers' ``longrope_frequency_update`` makes it."""
    original = (config.rope_scaling or {})["original_max_position_embeddings"]
    return torch.where(position_ids.max() + 1 > original, long, short)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``), as DeepSeek's code
    and transformers (``get_mscale``, ``yarn_get_mscale``) compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] (transformers' ``_compute_yarn_parameters``)."""
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_context
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of each frequency kept as it was
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def dynamic_inv_freq(base: float, dim: int, factor: float, max_positions: int, seq_len: int) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies for a sequence of ``seq_len`` positions (the unscaled ones up to
    ``max_positions``), as transformers' ``_compute_dynamic_ntk_parameters``."""
    seq_len = max(seq_len, max_positions)
    base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim)


def rope_attention_scaling(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (transformers' ``attention_factor``): the config's ``attention_factor``
    when given; else LongRoPE's ``sqrt(1 + ln(factor) / ln(original))`` (``factor = max_position_embeddings /
    original`` unless given), YaRN's ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are
    set (DeepSeek-V3) or ``mscale(factor)``; 1 for the other RoPE types."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = float(scaling["factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        return yarn_mscale(factor)
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
