"""NF4's lookup tables: the 16 NF4 values and the signed 8-bit dynamic map of double quantization.

Apart from :mod:`entrenar.quant.nf4.format` (the specification that uses them) so that the fused kernel
(:mod:`entrenar.quant.nf4.kernel`), which the format dispatches to on CUDA, reads the same tables without importing
the format back.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# QLoRA's NF4 table (bitsandbytes ``get_4bit_type("nf4")``), sorted ascending.
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)

ABSMAX_BLOCKSIZE = 256  # double quantization: one fp32 scale per this many absmax values


@functools.cache
def dynamic_map() -> Tensor:
    """The signed 8-bit dynamic quantization map (Dettmers 2015; bitsandbytes ``create_dynamic_map()``).

    With 7 exponent levels, level ``i`` holds ``2**i`` evenly spaced magnitudes in
    ``10**(i-6) * [0.1, 1]`` (midpoints of a linspace), mirrored for negatives;
    0 and 1 complete the 256 values.
    """
    values: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        decade = 10 ** (i - 6)
        values += (decade * mids).tolist() + (-decade * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)
