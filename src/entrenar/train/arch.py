"""``arch.json``: what a run's model is, and a fingerprint that is the same for the same architecture anywhere.

The architecture is every :class:`ModelConfig` field that changes the function the model computes (sizes,
family flags, RoPE, MoE routing); not the initialisation scale, the special token ids, dtype, device or paths.
The fingerprint is the SHA-256 of its canonical JSON: keys sorted, no whitespace (``,`` and ``:``
separators), ASCII only, tuples as lists, and numbers normalised (a float with an integral value is written as
that integer, ``10000.0`` as ``10000``; other floats in Python's shortest round-trip form, ``1e-06``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from entrenar.io import atomic
from entrenar.io.run_dir import ARCH_FILE
from entrenar.models.config import ModelConfig

# Fields that do not define the function: how weights were first drawn, which ids the data uses, loose extras.
_NOT_ARCHITECTURE = ("initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "extra")


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"architecture value {value!r} is not finite")
        return int(value) if value.is_integer() else value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    raise TypeError(f"architecture value {value!r} of type {type(value).__name__} has no canonical JSON form")


def architecture(config: ModelConfig) -> dict[str, Any]:
    """The canonical architecture of ``config`` (plain JSON values, numbers normalised)."""
    return {f.name: _canonical(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in _NOT_ARCHITECTURE}


def canonical_json(config: ModelConfig) -> str:
    """The exact text the fingerprint hashes."""
    return json.dumps(architecture(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def fingerprint(config: ModelConfig) -> str:
    """SHA-256 (hex) of :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(config).encode("ascii")).hexdigest()


def arch_record(config: ModelConfig) -> dict[str, Any]:
    """What ``arch.json`` holds."""
    return {"fingerprint": fingerprint(config), "parameters": config.num_parameters,
            "active_parameters": config.num_active_parameters, "moe": config.is_moe,
            "architecture": architecture(config)}


def write_arch(run_dir: str | Path, config: ModelConfig) -> Path:
    """Write ``run_dir/arch.json`` atomically."""
    text = json.dumps(arch_record(config), indent=2, sort_keys=True) + "\n"
    return atomic.write_text(Path(run_dir) / ARCH_FILE, text)


__all__ = ["ARCH_FILE", "arch_record", "architecture", "canonical_json", "fingerprint", "write_arch"]
