"""NF4 sinks: the empty NF4 layers a QLoRA base's weights stream into, quantized as they arrive.

    model = load_hf(folder, torch.bfloat16, "cuda", sinks=nf4_sinks)   # linear layers and experts held as NF4

The loaders (:func:`entrenar.models.hf.load_hf`, :func:`entrenar.models.gguf.load_gguf`) build the model on the meta
device and call ``sinks(model, dtype, device)`` before any weight is read; the model knows nothing of NF4.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from entrenar.errors import ModelError
from entrenar.models.hf import Sinks
from entrenar.models.moe import Experts
from entrenar.models.surgery import find_linears, replace_module
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.experts import NF4Experts
from entrenar.quant.nf4.format import NF4Linear
from entrenar.quant.nf4.streaming import nf4_host_memory_requested

BASE_QUANTIZATIONS = ("nf4",)


def nf4_sinks(model: Transformer, dtype: torch.dtype, device: str | torch.device) -> None:
    """Replace every linear layer but the output head, and every expert stack, of ``model`` (on the meta device)
    by an empty NF4 layer on ``device``. Inside :func:`entrenar.quant.nf4.streaming.nf4_in_host_memory`, the layers
    keep their buffers in CPU memory and quantize on ``device``."""
    host = nf4_host_memory_requested() and torch.device(device).type == "cuda"
    for name in find_linears(model, "all-linear"):
        linear = cast(nn.Linear, model.get_submodule(name))  # the loader's model: plain linear layers
        layer = NF4Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype=dtype,
                          device="meta" if host else device)
        if host:
            layer.keep_in_host_memory(quantize_on=device)
        replace_module(model, name, layer)
    for name in [n for n, m in model.named_modules() if type(m) is Experts]:
        # gpt-oss's biases stay in the load dtype, frozen; its weights stream in per expert (gpt_oss_layout)
        replace_module(model, name, NF4Experts.like(cast(Experts, model.get_submodule(name)), dtype, device))


def base_sinks(quantize: str | None) -> Sinks | None:
    """The sinks of a base quantization by name (``load(..., quantize=)``, ``lora.quantize_base``): None for
    none, :func:`nf4_sinks` for "nf4"."""
    if quantize is None:
        return None
    if quantize == "nf4":
        return nf4_sinks
    raise ModelError(f"unknown base quantization '{quantize}' (supported: {', '.join(BASE_QUANTIZATIONS)})")


__all__ = ["BASE_QUANTIZATIONS", "base_sinks", "nf4_sinks"]
