"""safetensors' dtype codes, as this PyTorch has them: the one table every reader and writer of headers uses."""

from __future__ import annotations

import torch

# The float8 and wide unsigned types are recent: only those this PyTorch has.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"),
    ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")) if hasattr(torch, name)}

__all__ = ["SAFETENSORS_DTYPES"]
