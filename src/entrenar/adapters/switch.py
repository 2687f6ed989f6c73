"""Adapters switched off for a while: the base model's outputs from the model being trained, without a copy.

Preference optimisation under LoRA needs the reference model's log-probabilities, and the reference is the base:
:func:`adapters_off` makes every LoRA layer (plain, fused, expert or router) compute its base layer only, as PEFT's
``disable_adapter()`` does, and turns them back on when the block ends, however it ends. Every LoRA forward path
already skips the update of a merged layer, so the switch is that flag, set on layers whose update is not folded
into their weight; nothing is folded or moved, so the base outputs are bit for bit the base's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from entrenar.adapters.layer import lora_layers
from entrenar.errors import AdapterError


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its base (every LoRA update off); refuses a model without LoRA and
    one whose adapters are merged (the base weights then hold the update: no base left to compute)."""
    layers = [layer for _, layer in lora_layers(model)]
    if not layers:
        raise AdapterError("adapters_off: the model has no LoRA layers (the reference would be the model itself)")
    if any(layer.merged for layer in layers):
        raise AdapterError("adapters_off: the adapters are merged into the base weights; unmerge them first")
    for layer in layers:
        layer.merged = True  # forward's base-only path; the weights are untouched
    try:
        yield
    finally:
        for layer in layers:
            layer.merged = False


__all__ = ["adapters_off"]
