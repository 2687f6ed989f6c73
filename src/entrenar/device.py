"""Which device and dtype a run or a load uses: one table of dtype names, one of safetensors' dtype codes, one
rule for ``auto``."""

from __future__ import annotations

import torch

from entrenar.errors import ConfigError

__all__ = ["DTYPES", "SAFETENSORS_DTYPES", "resolve_device", "resolve_dtype"]

# The weight dtypes a user may name (library and CLI), each to its torch dtype's name; "auto" is handled apart.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}

# safetensors' dtype codes, those this PyTorch has (the float8 and wide unsigned types are recent); every reader
# and writer of safetensors headers goes through this one table.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"),
    ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")) if hasattr(torch, name)}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None/'auto' means bf16 on a CUDA device that supports it, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (allowed: auto, {', '.join(DTYPES)})")
    return getattr(torch, DTYPES[dtype])


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device '{device}' (use auto, cpu, cuda or cuda:N): {e}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device '{device}' was asked for, but CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"device '{device}': this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved
