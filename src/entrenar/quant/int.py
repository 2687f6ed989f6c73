"""Post-training integer quantization of linear weights, and GGUF's Q8_0 / Q4_0 blocks.

Integer weights: a weight [out, in] is split along ``in`` into groups that
share one fp32 scale (and, asymmetric, one integer zero point):

* per channel (``group_size=None``): one scale per output row;
* per group (``group_size=g``): one scale per ``g`` consecutive inputs of a row;
* per tensor (``per_tensor=True``): one scale for the whole weight.

``w ≈ (q - zero) * scale`` with ``q`` in ``[-2**(b-1), 2**(b-1) - 1]``
(symmetric, zero = 0) or ``[0, 2**b - 1]`` (asymmetric). The scale comes from
the range of each group (min-max) or from a percentile of it (clipping rare
outliers trades their error for finer steps everywhere else).

Training's fake quantization (``entrenar.quant.qat``) rounds with the same
:func:`round_to_grid`, so a converted :class:`QuantLinear` reproduces the
trained model's outputs exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from entrenar.errors import QuantError
from entrenar.models.surgery import Patterns, find_linears, replace_module

Calibration = Literal["minmax", "percentile"]
MIN_BITS, MAX_BITS = 2, 8


# ---------------------------------------------------------------- integer grid


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The smallest and largest integer code of a ``bits``-wide grid."""
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def check_bits(bits: int, name: str) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not MIN_BITS <= bits <= MAX_BITS:
        raise QuantError(f"{name}: integer quantization supports {MIN_BITS} to {MAX_BITS} bits, got {bits!r}")


def check_finite(w: Tensor, name: str) -> None:
    if not w.is_floating_point():
        raise QuantError(f"{name}: expected a floating-point tensor, got {w.dtype}")
    bad = (~torch.isfinite(w)).sum().item()
    if bad:
        raise QuantError(f"{name}: tensor of shape {tuple(w.shape)} has {bad} NaN/inf value(s); cannot quantize")


def group_view(w: Tensor, n_rows: int, n_groups: int) -> Tensor:
    """``w`` [out, in] as [rows, groups, elements per group], matching a scale of shape [rows, groups]."""
    return w.reshape(n_rows, n_groups, -1)


def round_to_grid(x: Tensor, scale: Tensor, qmin: int, qmax: int, zero: Tensor | None = None) -> Tensor:
    """``clamp(round(x / scale) + zero, qmin, qmax)`` as floats: the one definition of rounding to codes."""
    q = torch.round(x / scale)
    if zero is not None:
        q = q + zero.to(q.dtype)
    return q.clamp(qmin, qmax)


def _quantile(x: Tensor, q: float) -> Tensor:
    """Quantile along the last dim with linear interpolation (``torch.quantile`` caps input size)."""
    s = x.sort(dim=-1).values
    pos = q * (s.shape[-1] - 1)
    lo = int(pos)
    hi = min(lo + 1, s.shape[-1] - 1)
    return s[..., lo] + (s[..., hi] - s[..., lo]) * (pos - lo)


def calibrate(
    groups: Tensor, bits: int, symmetric: bool, calibration: Calibration = "minmax", percentile: float = 99.9
) -> tuple[Tensor, Tensor | None]:
    """Scale (fp32 [rows, groups]) and zero point (uint8, asymmetric only) for ``groups`` [rows, groups, n].

    Min-max uses each group's extremes; percentile clips them at the given
    percentile (of ``|w|`` when symmetric, of ``w`` at both ends otherwise).
    The range always contains 0, so zero is exactly representable.
    """
    g = groups.detach().float()
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        a = g.abs()
        amax = a.amax(-1) if calibration == "minmax" else _quantile(a, percentile / 100)
        scale = amax / qmax
        zero = None
    else:
        if calibration == "minmax":
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            lo, hi = _quantile(g, 1 - percentile / 100), _quantile(g, percentile / 100)
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group quantizes to 0 with any scale
    if not symmetric:
        zero = torch.round(-lo / scale).clamp(qmin, qmax).to(torch.uint8)
    return scale, zero


# ---------------------------------------------------------------- storage


@dataclass
class IntQuantTensor:
    """Integer codes of a weight [out, in] plus their scales.

    ``codes`` holds one code per byte at 5 to 8 bits (int8 symmetric, uint8 asymmetric); at 4 bits two per byte
    (uint8 [out, in/2], even column in the low nibble); at 2 and 3 bits each row is one bit stream (uint8
    [out, ceil(in * bits / 8)]: column j in bits ``j*bits`` to ``j*bits + bits - 1``, least significant first, the
    row's last byte padded with zeros), so a 3-bit weight takes 3/4 of a 4-bit one. Codes below 8 bits are
    two's complement in their width when symmetric.
    """

    codes: Tensor
    scale: Tensor  # float32 [rows, groups]; rows = out (per channel/group) or 1 (per tensor)
    zero: Tensor | None  # uint8 [rows, groups] when asymmetric
    bits: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scale, self.zero)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


BITSTREAM_BITS = (2, 3)  # widths stored as one bit stream per row; 4 bits as nibbles, more as bytes


def codes_per_row_bytes(in_features: int, bits: int) -> int:
    """Bytes one row of ``in_features`` codes takes at ``bits`` bits (see :class:`IntQuantTensor`)."""
    if bits in BITSTREAM_BITS:
        return (in_features * bits + 7) // 8
    return in_features // 2 if bits == 4 else in_features


def _pack_codes(q: Tensor, bits: int, symmetric: bool) -> Tensor:
    if bits > 4:
        return q.to(torch.int8 if symmetric else torch.uint8)
    if bits == 4:
        nibbles = q.to(torch.int16).bitwise_and(0x0F).to(torch.uint8)
        return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    rows, cols = q.shape
    codes = q.to(torch.int32).bitwise_and((1 << bits) - 1)
    shifts = torch.arange(bits, dtype=torch.int32, device=q.device)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(rows, cols * bits)
    stream = F.pad(stream, (0, codes_per_row_bytes(cols, bits) * 8 - cols * bits))
    weights = (1 << torch.arange(8, dtype=torch.int32, device=q.device))
    return (stream.reshape(rows, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _unpack_codes(codes: Tensor, bits: int, symmetric: bool, in_features: int | None = None) -> Tensor:
    """Integer codes as int32 [out, in] (``in_features`` is needed at 2 and 3 bits: rows are padded)."""
    if bits > 4:
        return codes.to(torch.int32)
    if bits == 4:
        q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
    else:
        if in_features is None:
            raise QuantError(f"unpacking {bits}-bit codes needs the row width")
        shifts = torch.arange(8, dtype=torch.int32, device=codes.device)
        stream = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(codes.shape[0], -1)
        stream = stream[:, : in_features * bits].reshape(codes.shape[0], in_features, bits)
        q = (stream << torch.arange(bits, dtype=torch.int32, device=codes.device)).sum(-1, dtype=torch.int32)
    half = 1 << (bits - 1)
    return torch.where(q >= half, q - 2 * half, q) if symmetric else q


def _unpack_nibbles(codes: Tensor, bits: int, symmetric: bool) -> Tensor:
    """Codes of a format-1 folder (before 2- and 3-bit codes had their own width: two per byte) as int32."""
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
    return torch.where(q >= 8, q - 16, q) if symmetric else q


def _check_weight(w: Tensor, name: str) -> None:
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise QuantError(
            f"{name}: expected a 2-D weight [out_features, in_features], got {getattr(w, 'shape', type(w).__name__)}"
        )
    check_finite(w, name)


def quantize_int(
    w: Tensor,
    bits: int = 8,
    group_size: int | None = None,
    symmetric: bool = True,
    calibration: Calibration = "minmax",
    percentile: float = 99.9,
    per_tensor: bool = False,
    name: str = "weight",
) -> IntQuantTensor:
    """Quantize a linear weight [out, in] to ``bits``-bit integers (see the module docstring)."""
    check_bits(bits, name)
    _check_weight(w, name)
    out_f, in_f = w.shape
    if calibration not in ("minmax", "percentile"):
        raise QuantError(f"{name}: calibration must be 'minmax' or 'percentile', got {calibration!r}")
    if calibration == "percentile" and not 0 < percentile <= 100:
        raise QuantError(f"{name}: percentile must be in (0, 100], got {percentile}")
    if per_tensor and group_size is not None:
        raise QuantError(f"{name}: choose per_tensor or a group_size, not both")
    if group_size is not None and (group_size <= 0 or in_f % group_size):
        raise QuantError(f"{name}: group_size {group_size} does not divide in_features {in_f}")
    if bits == 4 and in_f % 2:
        raise QuantError(f"{name}: {bits}-bit codes are packed two per byte and need an even in_features, got {in_f}")
    rows = 1 if per_tensor else out_f
    n_groups = in_f // group_size if group_size else 1
    scale, zero = calibrate(group_view(w, rows, n_groups), bits, symmetric, calibration, percentile)
    return quantize_with_scale(w, scale, zero, bits)


def quantize_with_scale(w: Tensor, scale: Tensor, zero: Tensor | None, bits: int) -> IntQuantTensor:
    """Codes of ``w`` for a given scale [rows, groups] and zero point (None = symmetric)."""
    symmetric = zero is None
    qmin, qmax = qrange(bits, symmetric)
    g = group_view(w.detach(), *scale.shape)
    q = round_to_grid(g, scale.unsqueeze(-1), qmin, qmax, None if zero is None else zero.unsqueeze(-1))
    q = q.reshape(w.shape)
    return IntQuantTensor(_pack_codes(q, bits, symmetric), scale.detach().float(), zero, bits, w.shape, w.dtype)


def dequantize_int(q: IntQuantTensor, dtype: torch.dtype | None = None) -> Tensor:
    """``(codes - zero) * scale`` in fp32, rounded once to ``dtype`` (default: the original dtype)."""
    codes = group_view(_unpack_codes(q.codes, q.bits, q.symmetric, q.shape[1]).float(), *q.scale.shape)
    if q.zero is not None:
        codes = codes - q.zero.unsqueeze(-1).float()
    return (codes * q.scale.unsqueeze(-1)).reshape(q.shape).to(dtype or q.dtype)


# ---------------------------------------------------------------- error report


@dataclass
class LayerError:
    """How far a quantized weight is from the original."""

    name: str
    rel_frobenius: float  # ||W - W_q||_F / ||W||_F
    max_abs: float  # max |W - W_q|

    def __str__(self) -> str:
        return f"{self.name}: relative Frobenius error {self.rel_frobenius:.3e}, max abs error {self.max_abs:.3e}"


def weight_error(w: Tensor, w_hat: Tensor, name: str = "weight") -> LayerError:
    diff = (w_hat.float() - w.float()).detach()
    norm = w.float().norm()
    rel = (diff.norm() / norm).item() if norm > 0 else diff.norm().item()
    return LayerError(name, rel, diff.abs().max().item())


# ---------------------------------------------------------------- module


def activation_scale(x: Tensor, bits: int) -> Tensor:
    """Per-tensor symmetric scale from this batch's absmax (never zero)."""
    return (x.detach().abs().amax().float() / qrange(bits, True)[1]).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_activation(x: Tensor, bits: int, scale: Tensor | None) -> Tensor:
    """Symmetric per-tensor fake quantization of activations; ``scale=None`` takes it from the batch."""
    if scale is None:
        scale = activation_scale(x, bits)
    return round_to_grid(x, scale, *qrange(bits, True)) * scale


class QuantLinear(nn.Module):
    """An inference linear layer with integer weights, dequantized on the fly.

    Buffers: ``weight_codes``, ``weight_scale`` and, asymmetric, ``weight_zero``;
    with activation quantization ``act_scale`` (absent when the scale is taken
    per batch). ``weight`` returns the dequantized weight. The fp32 scales stay
    fp32 when the module is cast to another dtype.
    """

    linear_like = True
    weight_codes: Tensor
    weight_scale: Tensor
    weight_zero: Tensor | None
    act_scale: Tensor | None

    def __init__(
        self,
        q: IntQuantTensor,
        bias: Tensor | None = None,
        act_bits: int | None = None,
        act_scale: Tensor | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits, self.dtype = q.bits, q.dtype
        self.register_buffer("weight_codes", q.codes)
        self.register_buffer("weight_scale", q.scale)
        self.register_buffer("weight_zero", q.zero)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        if act_bits is not None:
            check_bits(act_bits, "activation")
        self.act_bits = act_bits
        self.register_buffer("act_scale", None if act_scale is None else act_scale.detach().float().reshape(()))

    def _apply(self, fn, recurse=True):
        scales = {k: self._buffers.get(k) for k in ("weight_scale", "act_scale")}
        super()._apply(fn, recurse)
        for k, old in scales.items():
            if old is not None:
                self._buffers[k] = old.to(self._buffers[k].device)  # follow device moves, never dtype casts
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "weight", **kwargs) -> QuantLinear:
        """Quantize ``linear``'s weight with :func:`quantize_int` (``kwargs`` are its options)."""
        return cls(quantize_int(linear.weight, name=name, **kwargs), linear.bias)

    @property
    def quantized(self) -> IntQuantTensor:
        shape = torch.Size((self.out_features, self.in_features))
        return IntQuantTensor(self.weight_codes, self.weight_scale, self.weight_zero, self.bits, shape, self.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight, rebuilt on every access (writing into it changes nothing)."""
        return dequantize_int(self.quantized)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (and the bias); activation quantization is dropped."""
        dtype = dtype or self.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype)
        linear.weight = nn.Parameter(dequantize_int(self.quantized, dtype))
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype).clone())
        return linear

    def forward(self, x: Tensor) -> Tensor:
        if self.act_bits is not None:
            x = quantize_activation(x, self.act_bits, self.act_scale)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dequantize_int(self.quantized, x.dtype), bias)

    def extra_repr(self) -> str:
        q = self.quantized
        kind = "symmetric" if q.symmetric else "asymmetric"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, group_size={q.group_size}, {kind}"
            + (f", act_bits={self.act_bits}" if self.act_bits else "")
        )


def quantize_model_int(
    model: nn.Module,
    patterns: Patterns = "all-linear",
    bits: int = 8,
    group_size: int | None = None,
    symmetric: bool = True,
    calibration: Calibration = "minmax",
    percentile: float = 99.9,
) -> list[LayerError]:
    """Replace the selected ``nn.Linear`` layers by :class:`QuantLinear`; returns each layer's weight error."""
    layers, report = {}, []
    for name in find_linears(model, patterns):  # build all before swapping any, so an error leaves the model whole
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise QuantError(f"{name}: integer quantization replaces nn.Linear layers, found {type(linear).__name__}")
        layers[name] = QuantLinear.from_linear(
            linear,
            name=f"{name}.weight",
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            calibration=calibration,
            percentile=percentile,
        )
        report.append(weight_error(linear.weight, layers[name].weight, name))
    for name, layer in layers.items():
        replace_module(model, name, layer)
    return report


# ---------------------------------------------------------------- GGUF blocks
# ggml's reference layouts (ggml-quants.c), row by row over the last dimension:
#   Q8_0: 34 bytes per 32 values: fp16 d, then 32 int8 q;       x = d * q
#   Q4_0: 18 bytes per 32 values: fp16 d, then 16 bytes where byte j holds
#         value j in its low nibble and value j + 16 in its high nibble; x = d * (q - 8)

GGUF_BLOCK = 32
_FP16_MAX = torch.finfo(torch.float16).max


def _gguf_blocks(w: Tensor, name: str, kind: str) -> Tensor:
    if w.dim() == 0 or w.shape[-1] % GGUF_BLOCK:
        raise QuantError(f"{name}: {kind} needs a last dimension divisible by {GGUF_BLOCK}, got shape {tuple(w.shape)}")
    check_finite(w, name)
    return w.detach().float().reshape(*w.shape[:-1], -1, GGUF_BLOCK)


def _fp16_bytes(d: Tensor, name: str, kind: str) -> Tensor:
    if (d.abs() > _FP16_MAX).any():
        raise QuantError(f"{name}: a {kind} block scale exceeds the float16 range (|w| too large)")
    return d.to(torch.float16).view(torch.uint8)  # little-endian, as GGUF stores it


def _round_half_away(x: Tensor) -> Tensor:
    """C ``roundf``. ``floor(|x| + 0.5)`` would round 0.49999997 up, so split off the fraction first."""
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))


def quantize_q8_0(w: Tensor, name: str = "weight") -> np.ndarray:
    """GGUF Q8_0 bytes of ``w``: uint8 [..., in / 32 * 34], row by row over the last dimension."""
    blocks = _gguf_blocks(w, name, "Q8_0")
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    q = _round_half_away(blocks * inv).to(torch.int8).view(torch.uint8)
    out = torch.cat([_fp16_bytes(d, name, "Q8_0"), q], dim=-1)
    return out.reshape(*w.shape[:-1], -1).numpy()


def quantize_q4_0(w: Tensor, name: str = "weight") -> np.ndarray:
    """GGUF Q4_0 bytes of ``w``: uint8 [..., in / 32 * 18].

    The scale maps the block's largest-magnitude value (signed, first if tied)
    to -8, so that value is exact and the others round into [-8, 7].
    """
    blocks = _gguf_blocks(w, name, "Q4_0")
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = extreme / -8
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)  # values are >= 0.5, so trunc is floor
    half = GGUF_BLOCK // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    out = torch.cat([_fp16_bytes(d, name, "Q4_0"), packed], dim=-1)
    return out.reshape(*w.shape[:-1], -1).numpy()


def _gguf_rows(data: np.ndarray, block_bytes: int, kind: str) -> Tensor:
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % block_bytes:
        raise QuantError(
            f"{kind} data must be uint8 with rows of whole {block_bytes}-byte blocks, got {data.dtype} {data.shape}"
        )
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.reshape(*t.shape[:-1], -1, block_bytes)


def dequantize_q8_0(data: np.ndarray) -> Tensor:
    """Values of Q8_0 bytes (see :func:`quantize_q8_0`) as fp32 [..., blocks * 32]."""
    blocks = _gguf_rows(data, 2 + GGUF_BLOCK, "Q8_0")
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*blocks.shape[:-2], -1)


def dequantize_q4_0(data: np.ndarray) -> Tensor:
    """Values of Q4_0 bytes (see :func:`quantize_q4_0`) as fp32 [..., blocks * 32]."""
    blocks = _gguf_rows(data, 2 + GGUF_BLOCK // 2, "Q4_0")
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    packed = blocks[..., 2:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int8) - 8
    return (d * q.float()).reshape(*blocks.shape[:-2], -1)
