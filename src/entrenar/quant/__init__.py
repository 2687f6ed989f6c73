"""Quantization applied to a model from outside, through ``entrenar.models.surgery``.

* ``nf4``: QLoRA's 4-bit NormalFloat, bit-compatible with bitsandbytes (frozen bases).
* ``int``: post-training int8/int4 (per channel / group, min-max or percentile) and GGUF Q8_0/Q4_0 blocks.
* ``qat``: fake quantization for training (STE, clipped STE, LSQ, EWGS) and conversion to integer layers.
"""

from entrenar.quant.int import (
    IntQuantTensor,
    LayerError,
    QuantLinear,
    dequantize_int,
    dequantize_q4_0,
    dequantize_q8_0,
    quantize_int,
    quantize_model_int,
    quantize_q4_0,
    quantize_q8_0,
)
from entrenar.quant.nf4.format import NF4Linear, NF4Tensor, dequantize_nf4, quantize_model_nf4, quantize_nf4
from entrenar.quant.qat import FakeQuantLinear, QATConfig, convert_qat, fake_quant, prepare_qat

__all__ = [
    "FakeQuantLinear",
    "IntQuantTensor",
    "LayerError",
    "NF4Linear",
    "NF4Tensor",
    "QATConfig",
    "QuantLinear",
    "convert_qat",
    "dequantize_int",
    "dequantize_nf4",
    "dequantize_q4_0",
    "dequantize_q8_0",
    "fake_quant",
    "prepare_qat",
    "quantize_int",
    "quantize_model_int",
    "quantize_model_nf4",
    "quantize_nf4",
    "quantize_q4_0",
    "quantize_q8_0",
]
