"""Quantization-aware training: fake-quantized weights (and activations) with a choice of backward rule.

Forward rounds to a symmetric ``b``-bit grid and back, ``w_q = clamp(round(w / s), -Qn, Qp) * s``
with ``Qn = 2**(b-1)`` and ``Qp = 2**(b-1) - 1``, so training sees the quantization error.
Rounding has no useful derivative; the backward rule decides what the weight gets instead
(``v = w / s``, ``g`` the gradient of ``w_q``):

* ``ste``: straight-through, ``g`` as it is (Bengio et al. 2013).
* ``clipped_ste``: ``g`` where ``-Qn <= v <= Qp``, zero where the grid clips.
* ``lsq``: learned step size (Esser et al. 2020). ``s`` is a parameter, initialised to
  ``2 * mean(|w|) / sqrt(Qp)``; the weight gets the clipped STE gradient and the step
  ``dw_q/ds = round(v) - v`` inside the grid, ``-Qn`` / ``Qp`` below / above it,
  summed and multiplied by ``1 / sqrt(N * Qp)`` (N: elements sharing the step).
* ``ewgs``: element-wise gradient scaling (Lee et al. 2021), ``g * (1 + delta * sign(g) * (v_n - q_n))``
  inside the grid, where ``v_n - q_n = (v - round(v)) / (Qn + Qp)`` is the rounding error
  on the paper's [0, 1]-normalised scale. The paper sets ``delta`` per layer from a
  Hessian-trace estimate; here it is a fixed hyperparameter.

Except with LSQ, the scale follows the weight: min-max (or a percentile) of each
tensor / channel / group, recomputed every step and treated as a constant.

:func:`prepare_qat` swaps ``nn.Linear`` layers for :class:`FakeQuantLinear` and
:func:`convert_qat` swaps those for :class:`entrenar.quant.int.QuantLinear`
holding the integer codes, which computes exactly what the fake-quantized
model computed. LoRA-QAT: ``prepare_qat`` then ``entrenar.adapters.lora.apply_lora``
wraps the fake-quant layers (frozen) with full-precision adapters; merging adds
the update to the master weight, which is re-quantized on the next forward.

From a recipe's ``qat`` section the training loop calls :func:`apply_qat_recipe`
before LoRA, checkpoints :func:`qat_state_dict` beside the weights (LSQ steps
are learned; the activation step is set once, from the first batch), and at the
end writes the integer model with :func:`entrenar.quant.checkpoint.save_qat_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from entrenar.adapters.lora import LoraConfig, LoraLinear, load_adapter
from entrenar.config import QatSection
from entrenar.errors import AdapterError, QuantError
from entrenar.io import atomic
from entrenar.models.surgery import Patterns, find_linears, replace_module
from entrenar.quant.int import (
    Calibration,
    QuantLinear,
    activation_scale,
    calibrate,
    check_bits,
    check_finite,
    group_view,
    qrange,
    quantize_with_scale,
    round_to_grid,
)

Backward = Literal["ste", "clipped_ste", "lsq", "ewgs"]
Granularity = Literal["tensor", "channel", "group"]
BACKWARDS = ("ste", "clipped_ste", "lsq", "ewgs")
GRANULARITIES = ("tensor", "channel", "group")
MIN_STEP = 1e-8  # keeps a learned step positive; far below any useful step


@dataclass(frozen=True)
class QATConfig(QatSection):
    """What to fake-quantize and how: the recipe's ``qat`` section (one schema for both) plus what only Python
    callers set. ``group_size`` applies to ``granularity="group"``; ``percentile`` (None: min-max) to the scale
    of the non-LSQ rules; ``act_bits`` (the section's ``activations``, spelled as the library always has: None
    is off) turns on per-tensor activation quantization (learned step with LSQ, batch absmax otherwise)."""

    activations: bool | int = field(default=False, init=False)  # from act_bits
    ewgs_delta: float = 1e-3
    percentile: float | None = None
    act_bits: int | None = None
    target_modules: Patterns = "all-linear"  # type: ignore[assignment]  # also a regex or a list, as in PEFT

    def __post_init__(self) -> None:
        check_bits(self.bits, "qat.bits")
        if self.act_bits is not None:
            check_bits(self.act_bits, "qat.act_bits")
        if self.granularity not in GRANULARITIES:
            raise QuantError(f"qat.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.backward not in BACKWARDS:
            raise QuantError(f"qat.backward must be one of {BACKWARDS}, got {self.backward!r}")
        if self.granularity == "group" and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise QuantError(f"qat.group_size must be a positive integer, got {self.group_size!r}")
        if not (isinstance(self.ewgs_delta, (int, float)) and math.isfinite(self.ewgs_delta) and self.ewgs_delta >= 0):
            raise QuantError(f"qat.ewgs_delta must be a finite number >= 0, got {self.ewgs_delta!r}")
        if self.percentile is not None:
            if self.backward == "lsq":
                raise QuantError("qat.percentile sets the scale of ste/clipped_ste/ewgs; lsq learns its step instead")
            if not 0 < self.percentile <= 100:
                raise QuantError(f"qat.percentile must be in (0, 100], got {self.percentile}")
        object.__setattr__(self, "activations", False if self.act_bits is None else self.act_bits)
        super().__post_init__()  # the section's rules: a QATConfig is a valid qat section

    def _refusal(self, key: str, message: str) -> QuantError:
        return QuantError(message)


class _FakeQuant(torch.autograd.Function):
    """``clamp(round(x / s), qmin, qmax) * s`` with the selected backward rule."""

    @staticmethod
    def forward(
        ctx, x: Tensor, scale: Tensor, qmin: int, qmax: int, rule: str, delta: float, grad_scale: float
    ) -> Tensor:
        ctx.save_for_backward(x, scale)
        ctx.qmin, ctx.qmax, ctx.rule, ctx.delta, ctx.grad_scale = qmin, qmax, rule, delta, grad_scale
        return round_to_grid(x, scale, qmin, qmax) * scale

    @staticmethod
    def backward(ctx, g: Tensor):
        x, scale = ctx.saved_tensors
        qmin, qmax, rule = ctx.qmin, ctx.qmax, ctx.rule
        v = x / scale
        inside = (v >= qmin) & (v <= qmax)
        if rule == "ste":
            grad_x = g
        elif rule == "ewgs":
            err = (v - torch.round(v)) / (qmax - qmin)
            grad_x = torch.where(inside, g * (1 + ctx.delta * torch.sign(g) * err), 0.0)
        else:  # clipped_ste, lsq
            grad_x = torch.where(inside, g, 0.0)
        grad_scale = None
        if ctx.needs_input_grad[1]:
            dq_ds = torch.where(v <= qmin, float(qmin), torch.where(v >= qmax, float(qmax), torch.round(v) - v))
            grad_scale = _sum_to(g * dq_ds, scale.shape) * ctx.grad_scale
        return grad_x, grad_scale, None, None, None, None, None


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``t`` over the dimensions that ``shape`` broadcasts (size 1 or missing)."""
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1]
    return t.sum(dims, keepdim=True).reshape(shape) if dims else t


def fake_quant(
    x: Tensor, scale: Tensor, bits: int, backward: Backward = "ste", delta: float = 1e-3, grad_scale: float = 1.0
) -> Tensor:
    """Fake-quantize ``x`` to a symmetric ``bits``-bit grid with ``scale`` broadcastable to ``x``.

    ``scale`` gets a gradient (LSQ's, times ``grad_scale``) when it requires one.
    """
    if backward not in BACKWARDS:
        raise QuantError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    qmin, qmax = qrange(bits, True)
    return _FakeQuant.apply(x, scale, qmin, qmax, backward, delta, grad_scale)


class FakeQuantLinear(nn.Module):
    """A linear layer that trains its full-precision weight through fake quantization.

    ``weight`` and ``bias`` are the wrapped ``nn.Linear``'s own parameters (so an
    optimizer built before :func:`prepare_qat` still updates them). With LSQ,
    ``weight_step`` [rows, groups] (and ``act_step``) are learned too.
    """

    linear_like = True
    act_step_initialized: Tensor

    def __init__(self, linear: nn.Linear, cfg: QATConfig, name: str = "weight"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.cfg = cfg
        self.weight = linear.weight
        self.bias = linear.bias
        check_finite(self.weight.detach(), name)
        if cfg.granularity == "group" and self.in_features % cfg.group_size:
            raise QuantError(f"{name}: qat.group_size {cfg.group_size} does not divide in_features {self.in_features}")
        if cfg.granularity == "tensor":
            self.scale_shape = (1, 1)
        elif cfg.granularity == "channel":
            self.scale_shape = (self.out_features, 1)
        else:
            self.scale_shape = (self.out_features, self.in_features // cfg.group_size)
        qmax = qrange(cfg.bits, True)[1]
        self.weight_grad_scale = 1.0
        self.no_weight_decay = ("weight_step", "act_step")  # step sizes, not weights (read by build_param_groups)
        self.learned_steps = ("weight_step", "act_step")  # their own optimizer group, at qat.scale_lr
        if cfg.backward == "lsq":
            groups = group_view(self.weight.detach().float(), *self.scale_shape)
            step = 2 * groups.abs().mean(-1) / math.sqrt(qmax)
            self.weight_step = nn.Parameter(step.clamp(min=MIN_STEP).to(self.weight.dtype))
            elements_per_step = self.weight.numel() // step.numel()
            self.weight_grad_scale = 1.0 / math.sqrt(elements_per_step * qmax)
        if cfg.act_bits is not None and cfg.backward == "lsq":
            self.act_step = nn.Parameter(torch.ones((), dtype=self.weight.dtype, device=self.weight.device))
            self.register_buffer("act_step_initialized", torch.zeros((), dtype=torch.bool, device=self.weight.device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: QATConfig, name: str = "weight") -> FakeQuantLinear:
        return cls(linear, cfg, name)

    def weight_scale(self, weight: Tensor | None = None) -> Tensor:
        """The scale [rows, groups] the weight (or ``weight``, e.g. ``W + BA``) is quantized with now."""
        if self.cfg.backward == "lsq":
            return self.weight_step.clamp(min=MIN_STEP)
        groups = group_view((self.weight if weight is None else weight).detach(), *self.scale_shape)
        calibration: Calibration = "minmax" if self.cfg.percentile is None else "percentile"
        scale, _ = calibrate(groups, self.cfg.bits, True, calibration, self.cfg.percentile or 100.0)
        return scale.to(self.weight.dtype)

    def fake_weight(self, weight: Tensor | None = None) -> Tensor:
        """The weight (or ``weight`` in its place) rounded to the grid and back, with the backward rule."""
        weight = self.weight if weight is None else weight
        groups = group_view(weight, *self.scale_shape)
        c = self.cfg
        rule = cast(Backward, c.backward)  # QATConfig refuses any other
        scale = self.weight_scale(weight).unsqueeze(-1)
        w_q = fake_quant(groups, scale, c.bits, rule, c.ewgs_delta, self.weight_grad_scale)
        return w_q.reshape(weight.shape)

    def activation_scale(self, x: Tensor) -> Tensor:
        bits = self.cfg.act_bits
        assert bits is not None  # called only when activations are quantized
        if self.cfg.backward != "lsq":
            return activation_scale(x, bits)
        if not self.act_step_initialized:
            with torch.no_grad():  # LSQ's init from the first batch the layer sees
                self.act_step.fill_(2 * x.abs().mean().item() / math.sqrt(qrange(bits, True)[1]))
                self.act_step_initialized.fill_(True)
        return self.act_step.clamp(min=MIN_STEP)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with(x, None)

    def forward_with(self, x: Tensor, weight: Tensor | None) -> Tensor:
        """The layer's output with ``weight`` (e.g. ``W + BA``) fake-quantized in place of its own."""
        if self.cfg.act_bits is not None:
            scale = self.activation_scale(x)
            grad_scale = 1.0 / math.sqrt(x.shape[-1] * qrange(self.cfg.act_bits, True)[1])  # N: features per token
            rule = cast(Backward, self.cfg.backward)  # QATConfig refuses any other
            x = fake_quant(x, scale, self.cfg.act_bits, rule, self.cfg.ewgs_delta, grad_scale)
        return F.linear(x, self.fake_weight(weight), self.bias)

    @torch.no_grad()
    def to_quant_linear(self, weight: Tensor | None = None) -> QuantLinear:
        """The integer layer that computes what this layer computes now (with ``weight`` in place of its own)."""
        weight = self.weight if weight is None else weight
        q = quantize_with_scale(weight, self.weight_scale(weight), None, self.cfg.bits)
        act_scale = None
        if self.cfg.act_bits is not None and self.cfg.backward == "lsq":
            act_scale = self.act_step.clamp(min=MIN_STEP)
        return QuantLinear(q, self.bias, act_bits=self.cfg.act_bits, act_scale=act_scale)

    def extra_repr(self) -> str:
        c = self.cfg
        group = f", group_size={c.group_size}" if c.granularity == "group" else ""
        act = f", act_bits={c.act_bits}" if c.act_bits else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={c.bits}, "
            f"{c.granularity}{group}, backward={c.backward}{act}"
        )


class QuantizedLoraLinear(LoraLinear):
    """LoRA-QAT with ``qat.quantize_lora``: ``y = x Q(W + s BA)^T + b`` over a :class:`FakeQuantLinear` base.

    The adapter's product joins the base weight before the quantizer (the base's: LSQ's learned step, or the
    min-max of ``W + s BA``), so training sees, and the merged integer model holds, one weight on one grid:
    merging (``merge_lora``) then converting gives exactly what was trained. Same parameters and state dict as
    a :class:`LoraLinear`; adapter dropout has no merged form and is refused.
    """

    def forward(self, x: Tensor) -> Tensor:
        base = cast(FakeQuantLinear, self.base_layer)
        return base(x) if self.merged else base.forward_with(x, merged_lora_weight(self))


def merged_lora_weight(layer: LoraLinear) -> Tensor:
    """``W + s BA`` of an unmerged LoRA layer, in the base weight's dtype (differentiable in A and B)."""
    weight = cast(Tensor, layer.base_layer.weight)
    delta = (layer.lora_B.weight @ layer.lora_A.weight) * layer.scaling
    return weight + delta.to(weight.dtype)


def quantize_lora_layers(model: nn.Module) -> list[str]:
    """Make every LoRA layer over a fake-quant layer a :class:`QuantizedLoraLinear` (in place); return names."""
    names = []
    for name, module in model.named_modules():
        if type(module) is LoraLinear and isinstance(module.base_layer, FakeQuantLinear):
            if not isinstance(module.lora_dropout, nn.Identity):
                raise QuantError(f"{name}: qat.quantize_lora quantizes W + BA as one weight, and adapter dropout "
                                 "has no such form (set lora.dropout: 0)")
            module.__class__ = QuantizedLoraLinear
            names.append(name)
    return names


def lora_qat_layers(model: nn.Module, section: QatSection) -> list[str]:
    """What LoRA-QAT needs after ``apply_lora``: LSQ's steps trainable again (:func:`train_quantizer_steps`) and,
    with ``quantize_lora``, the adapters quantized with their base (:func:`quantize_lora_layers`). Returns the
    trainable step names."""
    steps = train_quantizer_steps(model)
    if qat_config(section).quantize_lora:
        quantize_lora_layers(model)
    return steps


def merged_quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """For each LoRA layer over a fake-quant layer, the integer layer of ``W + s BA`` quantized by that layer's
    quantizer (its learned step, or min-max of the merged weight): the merged integer export, by module name.
    With ``quantize_lora`` that is what was trained; otherwise a re-quantization, whose cost
    :func:`entrenar.train.trainer` reports as held-out loss."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear) and isinstance(module.base_layer, FakeQuantLinear):
            with torch.no_grad():
                weight = None if module.merged else merged_lora_weight(module)
            layers[name] = module.base_layer.to_quant_linear(weight)
    return layers


def prepare_qat(model: nn.Module, cfg: QATConfig) -> list[str]:
    """Replace the ``nn.Linear`` layers ``cfg.target_modules`` selects by :class:`FakeQuantLinear`; return names."""
    names = find_linears(model, cfg.target_modules)
    layers = {}
    for name in names:  # build all before swapping any, so an error leaves the model as it was
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            found = type(linear).__name__
            raise QuantError(
                f"{name}: QAT wraps nn.Linear layers, found {found} (LoRA-QAT: prepare_qat, then apply_lora)"
            )
        layers[name] = FakeQuantLinear.from_linear(linear, cfg, name=f"{name}.weight")
    for name, layer in layers.items():
        replace_module(model, name, layer)
    return names


def convert_qat(model: nn.Module) -> list[str]:
    """Replace every :class:`FakeQuantLinear` (also inside LoRA wrappers) by its :class:`QuantLinear`."""
    names = [name for name, module in model.named_modules() if isinstance(module, FakeQuantLinear)]
    if not names:
        raise QuantError(f"{type(model).__name__} has no fake-quantized layers; call prepare_qat first")
    for name in names:
        replace_module(model, name, cast(FakeQuantLinear, model.get_submodule(name)).to_quant_linear())
    return names


# ---------------------------------------------------------------- recipes and the training loop


def qat_config(section: QatSection) -> QATConfig:
    """The :class:`QATConfig` a recipe's ``qat`` section describes: its values, the library's defaults for the
    rest."""
    if isinstance(section, QATConfig):
        return section
    shared = {f.name: getattr(section, f.name) for f in fields(QatSection) if f.name != "activations"}
    return QATConfig(**shared, act_bits=None if section.activations is False else section.activations)


def apply_qat_recipe(model: nn.Module, section: QatSection, lora_targets: Patterns | None = None) -> list[str]:
    """Fake-quantize the linear layers a recipe's ``qat`` section selects (``target_modules``: every one but the
    output head by default; ``lora``: the ones ``lora_targets``, the recipe's ``lora.target_modules``, adapts).

    Call it before ``apply_lora``: LoRA then wraps the fake-quantized layers (LoRA-QAT).
    """
    cfg = qat_config(section)
    if cfg.target_modules == "lora":
        if lora_targets is None:
            raise QuantError("qat.target_modules: 'lora' selects the layers LoRA adapts, and the recipe has no lora")
        cfg = dataclasses.replace(cfg, target_modules=lora_targets)
    try:
        return prepare_qat(model, cfg)
    except AdapterError as e:  # a name that matches no linear layer (find_linears' error)
        raise QuantError(f"qat.target_modules: {e}") from None


def train_quantizer_steps(model: nn.Module) -> list[str]:
    """Make every fake-quant layer's learned step sizes (LSQ) trainable again; return their names.

    ``apply_lora`` freezes everything that is not an adapter, the steps included; LoRA-QAT trains them beside the
    adapters (in their own optimizer group, at ``qat.scale_lr``), so call this after it.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantLinear):
            for local, param in module.named_parameters(recurse=False):
                if local in module.learned_steps:
                    param.requires_grad_(True)
                    names.append(f"{name}.{local}")
    return names


def _quantizer_state(module: FakeQuantLinear) -> dict[str, Tensor]:
    """A fake-quant layer's own state besides its weight and bias: LSQ steps and the activation-init flag."""
    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    return {k: v for k, v in own.items() if k not in ("weight", "bias")}


def qat_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every fake-quant layer's quantizer state under the model's names (empty without QAT), detached.

    Training checkpoints need it beside the weights: LSQ's steps are learned, and the
    activation step is set from the first batch a layer sees, which a resumed run must not redo.
    """
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantLinear):
            state.update({f"{name}.{k}": v.detach() for k, v in _quantizer_state(module).items()})
    return state


@torch.no_grad()
def load_qat_state_dict(model: nn.Module, state: dict[str, Tensor], source: str = "state dict") -> dict[str, Tensor]:
    """Copy the entries :func:`qat_state_dict` names into the model; return the rest of ``state``."""
    expected = qat_state_dict(model)
    for key, target in expected.items():
        if key not in state:
            raise QuantError(f"{source}: quantizer tensor {key!r} is missing (a QAT run's checkpoint holds it)")
        if state[key].shape != target.shape:
            raise QuantError(
                f"{source}: quantizer tensor {key!r} has shape {tuple(state[key].shape)}, "
                f"the model has {tuple(target.shape)}"
            )
        target.copy_(state[key])
    return {k: v for k, v in state.items() if k not in expected}


@contextmanager
def swapped(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[nn.Module]:
    """``model`` with the named submodules replaced for the duration of the block, then put back."""
    originals = {}
    try:
        for name, module in replacements.items():
            originals[name] = replace_module(model, name, module)
        yield model
    finally:
        for name, module in originals.items():
            replace_module(model, name, module)


def _plain_linear(layer: FakeQuantLinear) -> nn.Linear:
    """An ``nn.Linear`` sharing ``layer``'s master weight and bias (no copy)."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight, linear.bias = layer.weight, layer.bias
    return linear


def master_weights(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """``model`` with plain linear layers holding the full-precision master weights in place of the
    fake-quantized ones, for the duration of the block: what a full fine-tune saves as its ``model/``."""
    layers = {n: _plain_linear(m) for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    return swapped(model, layers)


# ---------------------------------------------------------------- the quantizer state beside a LoRA-QAT adapter

QAT_STATE_FILE = "qat_state.safetensors"
_LAYOUT = ("bits", "granularity", "group_size", "backward", "act_bits", "quantize_lora")


def _layout(model: nn.Module) -> dict[str, object] | None:
    cfg = next((m.cfg for m in model.modules() if isinstance(m, FakeQuantLinear)), None)
    return None if cfg is None else {k: getattr(cfg, k) for k in _LAYOUT}


def save_quantizer_state(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write the fake-quant layers' state (LSQ's learned steps, the activation-init flags) to
    ``folder/qat_state.safetensors`` beside a LoRA-QAT run's adapter, with the quantizer's layout in the metadata;
    return the file (None when the model has no such state). The adapter alone does not reproduce the trained
    model: its base was quantized with these steps."""
    state = {k: v.contiguous() for k, v in qat_state_dict(model).items()}
    if not state:
        return None
    path = Path(folder) / QAT_STATE_FILE
    metadata = {"format": "pt", "qat": json.dumps(_layout(model), sort_keys=True)}
    tmp = atomic.temp_file(path, lambda p: save_file(state, p, metadata=metadata))
    os.replace(tmp, path)
    atomic.fsync_dir(path.parent)
    return path


def _read_quantizer_state(model: nn.Module, folder: str | os.PathLike) -> tuple[Path, dict[str, Tensor]] | None:
    """:func:`save_quantizer_state`'s file in ``folder``, read and its layout checked against ``model``'s (None when
    the model has no quantizer state to load)."""
    expected = qat_state_dict(model)
    if not expected:
        return None
    path = Path(folder) / QAT_STATE_FILE
    if not path.is_file():
        raise QuantError(f"{folder}: no {QAT_STATE_FILE}; the model learns its quantizer steps "
                         f"({next(iter(expected))}, ...) and this adapter was not saved with them")
    try:
        with safe_open(str(path), "pt") as f:
            saved_layout = json.loads((f.metadata() or {}).get("qat", "null"))
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise QuantError(f"{path}: cannot read safetensors file: {e}") from None
    if saved_layout != _layout(model):
        raise QuantError(f"{path}: the steps were learned for qat {saved_layout}, the model is prepared with "
                         f"{_layout(model)}")
    return path, state


def _load_read_state(model: nn.Module, read: tuple[Path, dict[str, Tensor]] | None) -> Path | None:
    if read is None:
        return None
    path, state = read
    rest = load_qat_state_dict(model, state, str(path))
    if rest:
        raise QuantError(f"{path}: tensor {next(iter(rest))!r} belongs to no fake-quant layer of the model")
    return path


def load_quantizer_state(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Read :func:`save_quantizer_state`'s file from ``folder`` into ``model``'s fake-quant layers; return it (None
    when the model has no quantizer state). Its layout must be the model's, and every tensor must fit."""
    return _load_read_state(model, _read_quantizer_state(model, folder))


def load_qat_adapter(model: nn.Module, folder: str | os.PathLike) -> LoraConfig:
    """Apply a LoRA-QAT run's adapter to a model :func:`prepare_qat` made (as the run did), with its learned
    quantizer steps: the model then computes what the run trained."""
    read = _read_quantizer_state(model, folder)  # checked before the model is touched
    cfg = load_adapter(model, folder)
    _load_read_state(model, read)
    layout = _layout(model)
    if layout is not None and layout["quantize_lora"]:
        quantize_lora_layers(model)
    return cfg
