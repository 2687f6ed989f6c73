"""The LoRA layer: a frozen linear-like layer plus a trainable low-rank update, and what it is built from.

``y = base(x) + B(A(dropout(x))) * scaling`` with ``scaling = alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA);
adapters take the dtype :func:`adapter_dtype` gives (:mod:`entrenar.adapters.lora` explains it, and applies
adapters to a model and reads and writes PEFT's files). Apart from that module so that expert LoRA
(:mod:`entrenar.adapters.experts`), which subclasses the layer, and :mod:`entrenar.adapters.lora`, which applies
both kinds, each import it without importing the other back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
from torch import nn

from entrenar.errors import AdapterError


def check_hparams(r: Any, alpha: Any, dropout: Any, where: str) -> None:
    """Refuse a rank, alpha or dropout no LoRA layer can have, naming ``where``."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or not math.isfinite(alpha):
        raise AdapterError(f"{where}: alpha must be a positive number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"{where}: dropout must be in [0, 1), got {dropout!r}")


class RankError(AdapterError):
    """A rank a layer cannot use: ``r`` above ``min(in_features, out_features)``."""


def check_rank(r: int, in_features: int, out_features: int) -> None:
    """Refuse ``r > min(in_features, out_features)``: ``BA`` has rank at most that, so the rest would be
    parameters that add nothing (and a different model from PEFT's, which accepts them)."""
    if r > min(in_features, out_features):
        raise RankError(f"r={r} is larger than min(in_features, out_features) = {min(in_features, out_features)} "
                        f"of this {out_features}x{in_features} layer (the update BA has rank at most that)")


def lora_scaling(r: int, alpha: float, use_rslora: bool) -> float:
    """``alpha / r``, or ``alpha / sqrt(r)`` for rank-stabilized LoRA (Kalajdzievski, 2023)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters get on a base of ``base_dtype`` (see the module docstring)."""
    if base_dtype.is_floating_point and base_dtype not in (torch.float16, torch.bfloat16):
        return base_dtype
    return torch.float32


def weight_spec(layer: nn.Module) -> torch.Tensor | None:
    """A tensor with the dtype and device of a linear-like layer's weight (None if it has none). For a quantized
    layer (integer or NF4 codes and a compute dtype) an empty tensor beside its codes: its ``weight`` property
    dequantizes the whole matrix (a gather, when sharded), which on a CPU (an FSDP run's rank 0 building a 70B
    NF4 base) took minutes."""
    codes, dtype = getattr(layer, "weight_codes", None), getattr(layer, "dtype", None)
    if isinstance(codes, torch.Tensor) and isinstance(dtype, torch.dtype):
        # NF4 codes kept in CPU memory for a model that streams them to its GPU compute there
        return torch.empty(0, dtype=dtype, device=getattr(layer, "quantize_on", None) or codes.device)
    weight = getattr(layer, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


class _Dequantizable(Protocol):
    """A quantized linear layer (NF4, int) that computes its ``weight``: it dequantizes into a plain layer."""

    def to_linear(self) -> nn.Linear: ...


class LoraLinear(nn.Module):
    """A frozen linear-like ``base_layer`` plus a trainable low-rank update.

    The base may be any module with ``in_features``, ``out_features`` and a
    ``weight`` (an ``nn.Linear``, an NF4 or a fake-quant linear): only
    ``base_layer(x)`` is called in forward and ``base_layer.weight`` is
    touched only to merge.
    """

    linear_like = True  # a target for entrenar.models.surgery, which will not look inside it

    def __init__(
        self, base_layer: nn.Module, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False
    ) -> None:
        super().__init__()
        check_hparams(r, alpha, dropout, "LoraLinear")
        in_features = getattr(base_layer, "in_features", None)
        out_features = getattr(base_layer, "out_features", None)
        weight = weight_spec(base_layer)
        if not isinstance(in_features, int) or not isinstance(out_features, int) or weight is None:
            raise AdapterError(
                f"LoRA needs a linear layer with in_features, out_features and weight; got {type(base_layer).__name__}"
            )
        check_rank(r, in_features, out_features)
        self.base_layer = base_layer
        self.in_features, self.out_features = in_features, out_features
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = lora_scaling(r, alpha, use_rslora)
        self.merged = False
        dtype = adapter_dtype(weight.dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # Built and drawn on the CPU, then moved: a seed gives the same adapters on any device (PEFT's draws on
        # the CPU), and a run that loads on the CPU first (FSDP) starts where a one-GPU run does.
        build = weight.device if weight.is_meta else torch.device("cpu")
        self.lora_A = nn.Linear(in_features, r, bias=False, device=build, dtype=dtype)
        self.lora_B = nn.Linear(r, out_features, bias=False, device=build, dtype=dtype)
        self.reset_lora_parameters()
        self.lora_A.to(weight.device)
        self.lora_B.to(weight.device)
        base_layer.requires_grad_(False)
        self.train(base_layer.training)

    def reset_lora_parameters(self) -> None:
        """A as ``nn.Linear``'s default (Kaiming uniform, a=sqrt(5)), B zero: the update starts at zero.

        A is drawn from the CPU generator whatever its device, so a seed gives the same adapters on the CPU and
        on a GPU, and a run that builds on the CPU first (FSDP) starts where a one-GPU run does."""
        weight = self.lora_A.weight
        if weight.is_meta:  # a rank that receives its weights (FSDP's meta load) draws nothing
            return
        drawn = torch.empty(weight.shape, dtype=weight.dtype)
        nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
        with torch.no_grad():
            weight.copy_(drawn)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged:
            return result
        h = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return (result + self.lora_B(self.lora_A(h)) * self.scaling).to(result.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``B @ A * scaling`` in float32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def _base_weight(self) -> torch.Tensor:
        if not isinstance(self.base_layer.weight, nn.Parameter) and hasattr(self.base_layer, "to_linear"):
            # A quantized base (NF4, int) computes `weight` on the fly, so adding to it would be lost:
            # merging dequantizes the base into a plain frozen Linear first, as a merged export needs.
            self.base_layer = cast(_Dequantizable, self.base_layer).to_linear().requires_grad_(False)
        weight = cast(torch.Tensor, self.base_layer.weight)  # a linear-like base's weight is a tensor
        if not weight.is_floating_point():
            raise AdapterError(
                f"cannot merge LoRA into a {type(self.base_layer).__name__} with {weight.dtype} weights; "
                "dequantize the base first"
            )
        if not isinstance(weight, nn.Parameter):
            raise AdapterError(
                f"cannot merge LoRA into a {type(self.base_layer).__name__}: its weight is computed, not stored"
            )
        return weight

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the base weight; forward then skips the adapter."""
        if not self.merged:
            weight = self._base_weight()
            weight.add_(self.delta_weight().to(weight.device))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take a merged update back out of the base weight."""
        if self.merged:
            weight = self._base_weight()
            weight.sub_(self.delta_weight().to(weight.device))
            self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:.4g}, merged={self.merged}"


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """``(name, layer)`` for every LoRA layer of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


__all__ = ["LoraLinear", "adapter_dtype", "check_hparams", "lora_layers", "lora_scaling", "weight_spec"]
