"""NF4 weight quantization (QLoRA), bit-compatible with bitsandbytes.

A weight is cut into blocks of ``blocksize`` consecutive elements (row-major).
Each block is scaled by its absolute maximum into [-1, 1] and every element is
replaced by the index of the nearest of the 16 NF4 values (quantiles of a
normal distribution, QLoRA appendix E). Two 4-bit indices share a byte, the
first element in the high nibble.

With double quantization (bitsandbytes' ``compress_statistics=True``) the fp32
absmax scales are themselves compressed: their mean is subtracted and the
centred values are quantized to 8 bits with the signed dynamic map, in blocks
of 256 with one fp32 scale per block. That costs about 8.1 instead of 32 bits
per 64 weights.

This file is the specification: bitsandbytes' CPU path gives the same bytes
(``tests/quant/test_nf4.py``), and a fused GPU kernel must match it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from entrenar.device import cpu_products_in_fp32
from entrenar.errors import QuantError
from entrenar.models.surgery import Patterns, find_linears, replace_module
from entrenar.quant.nf4 import kernel as nf4_kernel
from entrenar.quant.nf4.tables import ABSMAX_BLOCKSIZE, NF4_CODE, dynamic_map

# Values above bound[i-1] and up to bound[i] take code i (ties go to the lower code).
_NF4_BOUNDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LUT_SIZE = 65536  # grid points of bitsandbytes' CPU 8-bit quantizer


@dataclass
class NF4Tensor:
    """A quantized weight: packed NF4 codes plus the per-block absmax scales.

    ``absmax`` is uint8 when double-quantized (then ``absmax_scale`` holds one fp32
    scale per 256 absmax values and ``absmax_offset`` the subtracted mean), fp32 otherwise.
    """

    codes: Tensor  # uint8 [ceil(numel / 2)]
    absmax: Tensor  # uint8 or float32 [ceil(numel / blocksize)]
    absmax_scale: Tensor | None  # float32 [ceil(n_blocks / 256)]
    absmax_offset: Tensor | None  # float32 []
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int = 64

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held by the quantized representation."""
        tensors = (self.codes, self.absmax, self.absmax_scale, self.absmax_offset)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_weight(w: Tensor, name: str) -> None:
    if not isinstance(w, Tensor):
        raise QuantError(f"{name}: expected a tensor, got {type(w).__name__}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise QuantError(f"{name}: NF4 quantizes float32/bfloat16/float16 weights, got {w.dtype}")
    if w.numel() == 0:
        raise QuantError(f"{name}: cannot quantize an empty tensor of shape {tuple(w.shape)}")
    bad = (~torch.isfinite(w)).sum().item()
    if bad:
        raise QuantError(f"{name}: weight of shape {tuple(w.shape)} has {bad} NaN/inf value(s); cannot quantize")


def _blocks(flat: Tensor, blocksize: int) -> Tensor:
    """``flat`` zero-padded to whole blocks, as [n_blocks, blocksize]. Zeros never raise an absmax."""
    pad = -flat.numel() % blocksize
    return F.pad(flat, (0, pad)).view(-1, blocksize)


def _quantize_4bit_codes(flat: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    """NF4 codes (uint8, one per element) and fp32 absmax per block of an fp32 vector."""
    n = flat.numel()
    blocks = _blocks(flat, blocksize)
    absmax = blocks.abs().amax(dim=1)
    # bitsandbytes multiplies full blocks by the reciprocal but divides the
    # partial last block; the two can differ in the last bit, so do the same.
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)
    rem = n % blocksize
    if rem:
        scaled[-1] = blocks[-1] / absmax[-1].clamp(min=1e-38)
    scaled = scaled.clamp(-1, 1).reshape(-1)[:n]
    codes = torch.bucketize(scaled, _NF4_BOUNDS.to(flat.device)).to(torch.uint8)
    return codes, absmax


def _pack(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte, first in the high nibble; an odd tail is padded with the code of 0.0."""
    if codes.numel() % 2:
        zero_code = torch.bucketize(torch.zeros(1), _NF4_BOUNDS).to(torch.uint8).to(codes.device)
        codes = torch.cat([codes, zero_code])
    return (codes[0::2] << 4) | codes[1::2]


def _unpack(packed: Tensor, n: int) -> Tensor:
    return torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1)[:n]


@functools.cache
def _dynamic_lut() -> Tensor:
    """Code index for each of 65536 evenly spaced points of [-1, 1] (bitsandbytes' CPU lookup table).

    Point ``i`` is ``-1 + 2i/65535`` and takes the code whose midpoint interval
    holds it (ties to the lower code).
    """
    code = dynamic_map()
    mids = 0.5 * (code[:-1] + code[1:])
    points = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32)) / (_LUT_SIZE - 1)
    return torch.searchsorted(mids, points, side="left").to(torch.uint8)


def quantize_blockwise_8bit(x: Tensor, blocksize: int = ABSMAX_BLOCKSIZE) -> tuple[Tensor, Tensor]:
    """8-bit blockwise quantization with the dynamic map: (uint8 codes, fp32 absmax per block).

    Follows bitsandbytes' CPU kernel rather than an exact nearest-code search:
    each value times the reciprocal of its block's absmax is rounded to one of
    65536 grid points of [-1, 1], and the grid point's nearest code is taken.
    This differs from the exact nearest code only within half a grid step
    (1.5e-5) of a midpoint between codes; an all-zero block gets code 0.
    """
    n = x.numel()
    blocks = _blocks(x.float().reshape(-1), blocksize)
    absmax = blocks.abs().amax(dim=1)
    normed = (blocks * (1.0 / absmax).unsqueeze(1)).clamp(-1.0, 1.0)
    # Same float32 operation sequence as the C kernel: ((v + 1) * 0.5) * 65535 + 0.5, truncated.
    grid = ((normed + 1.0) * 0.5 * (_LUT_SIZE - 1) + 0.5).to(torch.int64)
    codes = _dynamic_lut().to(x.device)[grid.clamp(0, _LUT_SIZE - 1)]
    codes = torch.where((absmax == 0).unsqueeze(1), 0, codes)
    return codes.reshape(-1)[:n].to(torch.uint8), absmax


def dequantize_blockwise_8bit(codes: Tensor, absmax: Tensor, blocksize: int = ABSMAX_BLOCKSIZE) -> Tensor:
    """Inverse of :func:`quantize_blockwise_8bit`, in fp32."""
    values = dynamic_map().to(codes.device)[codes.long()]
    n = values.numel()
    return (_blocks(values, blocksize) * absmax.unsqueeze(1)).reshape(-1)[:n]


def quantize_nf4(w: Tensor, blocksize: int = 64, double_quant: bool = True, name: str = "weight") -> NF4Tensor:
    """Quantize ``w`` to NF4 in blocks of ``blocksize`` (bitsandbytes' ``quantize_4bit(..., quant_type="nf4")``).

    A last block shorter than ``blocksize`` is scaled by its own absmax, as in
    bitsandbytes. ``name`` labels the tensor in error messages.
    """
    if blocksize not in BLOCKSIZES:
        raise QuantError(f"{name}: NF4 blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    _check_weight(w, name)
    codes, absmax = _quantize_4bit_codes(w.detach().reshape(-1).float(), blocksize)
    scale = offset = None
    if double_quant:
        offset = absmax.mean()
        absmax, scale = quantize_blockwise_8bit(absmax - offset)
    return NF4Tensor(_pack(codes), absmax, scale, offset, w.shape, w.dtype, blocksize)


def nf4_absmax(q: NF4Tensor) -> Tensor:
    """The fp32 absmax of every block (decompressed when double-quantized)."""
    if not q.double_quant:
        return q.absmax
    assert q.absmax_scale is not None and q.absmax_offset is not None  # both set when double-quantized
    return dequantize_blockwise_8bit(q.absmax, q.absmax_scale) + q.absmax_offset


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The weight ``q`` stands for, in ``dtype`` (default: the dtype it was quantized from).

    On CUDA with Triton installed a fused kernel (:mod:`entrenar.quant.nf4.kernel`)
    computes the same bits as :func:`dequantize_nf4_reference`, which runs everywhere else.
    """
    if q.codes.is_cuda and nf4_kernel.can_dequantize(q):
        return nf4_kernel.dequantize_nf4_triton(q, dtype)
    if q.numel % q.blocksize == 0:
        return dequantize_nf4_by_bytes(q, dtype)
    return dequantize_nf4_reference(q, dtype)


def dequantize_nf4_into(q: NF4Tensor, out: Tensor) -> Tensor:
    """:func:`dequantize_nf4` of ``q`` written into ``out`` (contiguous, ``q``'s shape, in the dtype wanted), such as
    one expert's slice of a stack of expert weights: on CUDA the kernel writes there directly, with no tensor of
    its own to allocate and copy; elsewhere (and under ``torch.compile``) the dequantized weight is copied in."""
    if tuple(out.shape) != tuple(q.shape) or not out.is_contiguous():
        raise QuantError(f"dequantize into a contiguous tensor of shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if q.codes.is_cuda and out.is_cuda and q.numel % 2 == 0 and nf4_kernel.can_dequantize(q) \
            and not torch.compiler.is_compiling():
        nf4_kernel.launch(q.codes, q.absmax, q.absmax_scale, q.absmax_offset, q.blocksize, out.view(-1))
    else:
        out.copy_(dequantize_nf4(q, out.dtype))
    return out


def _byte_values(device: torch.device) -> Tensor:
    """Both NF4 values of each of the 256 code bytes, the high nibble's first, as one 8-byte word per byte
    (built per call, as the reference moves its table: 2 KiB, microseconds; no cache for torch.compile to trace)."""
    pairs = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=1)  # code[b >> 4], code[b & 15]
    return pairs.contiguous().view(torch.int64).view(-1).to(device)


def dequantize_nf4_by_bytes(q: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """:func:`dequantize_nf4_reference`'s bits in fewer passes (the path off CUDA): one gather of a byte's two
    values as one word, one multiply by the block's absmax in fp32 written in place, one rounding to ``dtype``.

    The reference unpacks the nibbles into an int64 tensor and gathers fp32 values one by one: about 3x the time
    on a CPU (docs/QUANTIZATION.md). For whole blocks only (``numel`` a multiple of ``blocksize``).
    """
    words = torch.index_select(_byte_values(q.codes.device), 0, q.codes.int())
    values = words.view(torch.float32).view(-1, q.blocksize).mul_(nf4_absmax(q).unsqueeze(1))
    return values.to(dtype or q.dtype).view(q.shape)


def dequantize_nf4_reference(q: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The specification of :func:`dequantize_nf4`, in plain PyTorch.

    Values are formed in fp32 (code times block absmax) and rounded once to ``dtype``.
    """
    n = q.numel
    values = NF4_CODE.to(q.codes.device)[_unpack(q.codes, n).long()]
    values = (_blocks(values, q.blocksize) * nf4_absmax(q).unsqueeze(1)).reshape(-1)[:n]
    return values.to(dtype or q.dtype).view(q.shape)


class _NF4LinearFn(torch.autograd.Function):
    """``x @ W.T + b`` with W dequantized on the fly, in forward and again in backward.

    Nothing weight-sized is saved for backward: the frozen weight gets no
    gradient, and grad_input needs W, which is rebuilt from the packed codes
    (saved as tensors, so that activation checkpointing drops them until a rerun).
    """

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, q: NF4Tensor) -> Tensor:
        ctx.format = (q.shape, q.dtype, q.blocksize)
        ctx.save_for_backward(q.codes, q.absmax, q.absmax_scale, q.absmax_offset)
        ctx.has_bias = bias is not None
        if cpu_products_in_fp32(x.device, x.dtype):  # emulated 16-bit product: in fp32, the output rounded once
            weight = dequantize_nf4(q, x.dtype).float()  # rounded as the 16-bit product would use it
            return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
        return F.linear(x, dequantize_nf4(q, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            q = NF4Tensor(*ctx.saved_tensors, *ctx.format)
            if cpu_products_in_fp32(grad_out.device, grad_out.dtype):
                grad_x = (grad_out.float() @ dequantize_nf4(q, grad_out.dtype).float()).to(grad_out.dtype)
            else:
                grad_x = grad_out @ dequantize_nf4(q, grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4.

    State dict keys (all plain tensors, safetensors-friendly): ``weight_codes``,
    ``weight_absmax`` and, when double-quantized, ``weight_absmax_scale`` and
    ``weight_absmax_offset``; plus ``bias`` if any. ``weight`` returns the
    dequantized weight. Casting the module (``.to(torch.bfloat16)``) casts the
    bias but leaves the fp32 scales as they are: they are part of the format.
    """

    linear_like = True
    weight_codes: Tensor
    weight_absmax: Tensor
    weight_absmax_scale: Tensor | None
    weight_absmax_offset: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        blocksize: int = 64,
        double_quant: bool = True,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if blocksize not in BLOCKSIZES:
            raise QuantError(f"NF4 blocksize must be one of {BLOCKSIZES}, got {blocksize}")
        if dtype not in SUPPORTED_DTYPES:
            raise QuantError(f"NF4Linear dtype must be float32/bfloat16/float16, got {dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.blocksize = dtype, blocksize
        self.quantize_on: torch.device | None = None  # set by keep_in_host_memory
        numel = in_features * out_features
        n_blocks = -(-numel // blocksize)
        self.register_buffer("weight_codes", torch.zeros(-(-numel // 2), dtype=torch.uint8, device=device))
        if double_quant:
            self.register_buffer("weight_absmax", torch.zeros(n_blocks, dtype=torch.uint8, device=device))
            n_scales = -(-n_blocks // ABSMAX_BLOCKSIZE)
            self.register_buffer("weight_absmax_scale", torch.zeros(n_scales, dtype=torch.float32, device=device))
            self.register_buffer("weight_absmax_offset", torch.zeros((), dtype=torch.float32, device=device))
        else:
            self.register_buffer("weight_absmax", torch.zeros(n_blocks, dtype=torch.float32, device=device))
            self.register_buffer("weight_absmax_scale", None)
            self.register_buffer("weight_absmax_offset", None)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, blocksize: int = 64, double_quant: bool = True, name: str = "weight"
    ) -> NF4Linear:
        """Quantize ``linear``'s weight; the bias is kept as it is (frozen)."""
        w = linear.weight
        q = quantize_nf4(w, blocksize, double_quant, name=name)
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            w.dtype,
            blocksize,
            double_quant,
            device="meta",
        )
        layer.weight_codes, layer.weight_absmax = q.codes, q.absmax
        if double_quant:
            layer.weight_absmax_scale, layer.weight_absmax_offset = q.absmax_scale, q.absmax_offset
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def keep_in_host_memory(self, quantize_on: torch.device | str) -> None:
        """Keep the NF4 buffers in CPU memory through device moves (``.to``, ``to_empty``); weights loaded into
        them are quantized on ``quantize_on``. For a model whose blocks stream their weights to the GPU
        (:mod:`entrenar.quant.nf4.streaming`), loaded without ever holding them all there."""
        for name, t in list(self._buffers.items()):
            if name.startswith("weight_") and t is not None and t.device.type != "cpu":
                self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        self.quantize_on = torch.device(quantize_on)

    def _apply(self, fn, recurse=True):
        if self.quantize_on is not None:  # buffers in host memory: only the bias follows
            held = {k: self._buffers.pop(k) for k in list(self._buffers) if k.startswith("weight_")}
            try:
                return super()._apply(fn, recurse)
            finally:
                self._buffers.update(held)
        scales = {k: self._buffers.get(k) for k in ("weight_absmax", "weight_absmax_scale", "weight_absmax_offset")}
        super()._apply(fn, recurse)
        for k, old in scales.items():
            if old is not None and old.is_floating_point():
                self._buffers[k] = old.to(self._buffers[k].device)  # follow device moves, never dtype casts
        return self

    @torch.no_grad()
    def load_full_weight(self, w: Tensor, name: str = "weight") -> None:
        """Quantize a full-precision weight into this layer's buffers (streamed loading: one tensor at a time)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise QuantError(f"{name}: shape {tuple(w.shape)} does not fit "
                             f"NF4Linear({self.in_features} -> {self.out_features})")
        if w.is_meta or self.weight_codes.is_meta:
            return  # a model built on the meta device: the shape is all there is to check
        device = self.quantize_on or self.weight_codes.device
        q = quantize_nf4(w.to(device, self.dtype), self.blocksize, self.weight_absmax_scale is not None, name=name)
        self.weight_codes.copy_(q.codes)
        self.weight_absmax.copy_(q.absmax)
        if q.double_quant:
            # quantized with double_quant because this layer holds the scale and offset buffers
            assert self.weight_absmax_scale is not None and self.weight_absmax_offset is not None
            assert q.absmax_scale is not None and q.absmax_offset is not None
            self.weight_absmax_scale.copy_(q.absmax_scale)
            self.weight_absmax_offset.copy_(q.absmax_offset)

    @property
    def quantized(self) -> NF4Tensor:
        shape = torch.Size((self.out_features, self.in_features))
        return NF4Tensor(
            self.weight_codes,
            self.weight_absmax,
            self.weight_absmax_scale,
            self.weight_absmax_offset,
            shape,
            self.dtype,
            self.blocksize,
        )

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out_features, in_features], rebuilt on every access.

        A fresh tensor: writing into it changes nothing. To change the weight
        (e.g. merge LoRA), take :meth:`to_linear`, edit it and quantize again.
        """
        return dequantize_nf4(self.quantized)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (and the bias), in ``dtype`` (default: the original)."""
        dtype = dtype or self.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype)
        linear.weight = nn.Parameter(dequantize_nf4(self.quantized, dtype))
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype).clone())
        return linear

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NF4LinearFn.apply(x, bias, self.quantized)

    def extra_repr(self) -> str:
        dq = "double_quant" if self.weight_absmax_scale is not None else "fp32 absmax"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"blocksize={self.blocksize}, {dq}"
        )


def quantize_model_nf4(
    model: nn.Module, patterns: Patterns = "all-linear", blocksize: int = 64, double_quant: bool = True
) -> list[str]:
    """Replace the selected ``nn.Linear`` layers of ``model`` by :class:`NF4Linear`; returns their names."""
    names = find_linears(model, patterns)
    layers = {}
    for name in names:  # build all before swapping any, so an error leaves the model whole
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise QuantError(f"{name}: NF4 replaces nn.Linear layers, found {type(linear).__name__}")
        layers[name] = NF4Linear.from_linear(linear, blocksize, double_quant, name=f"{name}.weight")
    for name, layer in layers.items():
        replace_module(model, name, layer)
    return names
