"""RoPE scaling types beyond linear and llama3: YaRN and dynamic NTK, as transformers' modeling_rope_utils has them.

Each function takes plain numbers (the rotary dimension, the base, the config.json's ``rope_scaling`` dict), so
:func:`entrenar.models.config.rope_inv_freq` calls them where it computes the linear and llama3 types.

* ``yarn`` (gpt-oss, Qwen long-context configs): each frequency blended between the original (extrapolated) and
  the one slowed by ``factor`` (interpolated) by a ramp over the dimensions whose number of rotations over
  ``original_max_position_embeddings`` lies between ``beta_slow`` and ``beta_fast``; cos and sin are multiplied
  by an attention factor (``0.1 ln(factor) + 1`` unless the config gives one or ``mscale``/``mscale_all_dim``).
* ``dynamic`` (dynamic NTK): the base grows with the sequence once it passes ``max_position_embeddings``; at or
  below it the frequencies are the unscaled ones. transformers recomputes them in the forward from the batch's
  largest position (``dynamic_rope_update``); the decoder does the same (:meth:`Transformer.rope`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_SCALING_TYPES = ("yarn", "dynamic")
# The keys each type must give (positive numbers), checked when config.json is read.
REQUIRED_KEYS = {"yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",)}


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``1 / base^(2i / dim)`` for i < dim / 2 (fp32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' ``attention_factor``)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


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


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by for this scaling (1 but for YaRN)."""
    if scaling and scaling.get("rope_type") == "yarn":
        return yarn_attention_factor(scaling)
    return 1.0
