"""NF4 dequantization in one pass (Triton), bit-identical to :func:`entrenar.quant.nf4.format.dequantize_nf4_reference`.

QLoRA rebuilds every frozen weight from its 4-bit codes in each forward and
backward, so this is pure memory traffic: read half a byte (plus about 1/64 of
a byte of statistics) per weight, write 2 bytes (bf16). The PyTorch
specification makes several passes with fp32 and int64 intermediates; the
kernel reads each code byte once and writes its two output values once.

One program handles ``ROWS`` quantization blocks, each ``blocksize / 2`` code
bytes wide. Per block it rebuilds the fp32 absmax (double quantization:
``dynamic_map[code] * scale[block // 256] + offset``), then per byte looks
both nibbles up in the 16-entry NF4 table, multiplies by the absmax in fp32
and rounds once to the output dtype, exactly the specification's operation
order. Two things keep it bit-exact:

* floating-point contraction is off (``enable_fp_fusion=False``), so
  ``map * scale + offset`` is a rounded multiply then a rounded add, not an FMA;
* the two values of a byte are stored as one 32-bit (64-bit for fp32) word,
  first value in the low half (little-endian), which is also the widest store.

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose fp32 -> bf16
conversion truncates, bf16 is rounded to nearest-even by integer arithmetic
instead; on the GPU the hardware conversion (round to nearest-even) is used.

The QLoRA layer as one autograd node is :func:`entrenar.kernels.lora_linear.lora_projections`
with NF4 weights: it calls this kernel in forward and again in backward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from entrenar.device import interpreting, use_triton
from entrenar.quant.nf4.tables import ABSMAX_BLOCKSIZE, NF4_CODE, dynamic_map

if TYPE_CHECKING:
    from entrenar.quant.nf4.format import NF4Tensor

_BYTES_PER_PROGRAM = 4096  # 8192 weights; with 4 warps, 32 code bytes per thread (fastest of a sweep on an H200)
_NUM_WARPS = 4
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The output is written in pairs: one word holds the two values of a code byte.
_PAIR_DTYPE = {torch.float32: torch.int64, torch.bfloat16: torch.int32, torch.float16: torch.int32}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize(
        codes_ptr, absmax_ptr, dmap_ptr, scale_ptr, offset_ptr, nf4_ptr, out_ptr, n_bytes, n_blocks,
        HALF: tl.constexpr, ROWS: tl.constexpr, SCALE_GROUP: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
        OUT_KIND: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
    ):
        blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # quantization blocks of this program
        block_ok = blocks < n_blocks
        if DOUBLE_QUANT:
            code = tl.load(absmax_ptr + blocks, mask=block_ok, other=0).to(tl.int32)
            scale = tl.load(scale_ptr + blocks // SCALE_GROUP, mask=block_ok, other=0.0)
            absmax = tl.load(dmap_ptr + code) * scale
            absmax = absmax + tl.load(offset_ptr)
        else:
            absmax = tl.load(absmax_ptr + blocks, mask=block_ok, other=0.0)
        byte = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
        mask = byte < n_bytes
        packed = tl.load(codes_ptr + byte, mask=mask, other=0).to(tl.int32)
        first = tl.load(nf4_ptr + (packed >> 4)) * absmax[:, None]  # high nibble: the earlier element
        second = tl.load(nf4_ptr + (packed & 15)) * absmax[:, None]
        if OUT_KIND == 0:
            lo = first.to(tl.uint32, bitcast=True).to(tl.uint64)
            hi = second.to(tl.uint32, bitcast=True).to(tl.uint64)
            pair = (lo | (hi << 32)).to(tl.int64, bitcast=True)
        else:
            if ROUND_BY_BITS:  # bf16 round-to-nearest-even on the fp32 bits (finite inputs)
                a = first.to(tl.uint32, bitcast=True)
                b = second.to(tl.uint32, bitcast=True)
                lo = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
                hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            elif OUT_KIND == 1:
                lo = first.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
                hi = second.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
            else:
                lo = first.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
                hi = second.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            pair = (lo | (hi << 16)).to(tl.int32, bitcast=True)
        tl.store(out_ptr + byte, pair, mask=mask)

    return dequantize


@functools.cache
def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """The NF4 table and the 8-bit dynamic map, on ``device`` (looked up by the kernel, cached in L1)."""
    return NF4_CODE.to(device), dynamic_map().to(device)


def launch(
    codes: Tensor, absmax: Tensor, absmax_scale: Tensor | None, absmax_offset: Tensor | None, blocksize: int,
    out: Tensor, bytes_per_program: int | None = None, num_warps: int | None = None,
):
    """Run the kernel into ``out`` (``2 * codes.numel()`` values); returns Triton's compiled-kernel handle.

    ``bytes_per_program`` and ``num_warps`` override the tuned defaults (for benchmarks).
    """
    n_bytes = codes.numel()
    half = blocksize // 2
    rows = max(1, (bytes_per_program or _BYTES_PER_PROGRAM) // half)
    n_blocks = -(-n_bytes // half)
    nf4, dmap = _tables(codes.device)
    double_quant = absmax_scale is not None
    # Unused pointers (no double quantization) get a harmless stand-in; the kernel never reads them.
    scale = absmax_scale if double_quant else absmax
    offset = absmax_offset if double_quant else absmax
    round_by_bits = out.dtype == torch.bfloat16 and interpreting() and not codes.is_cuda
    return _kernel()[(-(-n_blocks // rows),)](
        codes, absmax, dmap, scale, offset, nf4, out.view(_PAIR_DTYPE[out.dtype]), n_bytes, n_blocks,
        HALF=half, ROWS=rows, SCALE_GROUP=ABSMAX_BLOCKSIZE, DOUBLE_QUANT=double_quant, OUT_KIND=_OUT_KIND[out.dtype],
        ROUND_BY_BITS=round_by_bits, num_warps=num_warps or _NUM_WARPS, enable_fp_fusion=False,
    )


@torch.library.custom_op("entrenar::nf4_dequantize", mutates_args=())
def _nf4_dequantize(
    codes: Tensor, absmax: Tensor, absmax_scale: Tensor | None, absmax_offset: Tensor | None, blocksize: int,
    dtype: torch.dtype,
) -> Tensor:
    out = torch.empty(2 * codes.numel(), dtype=dtype, device=codes.device)
    launch(codes, absmax, absmax_scale, absmax_offset, blocksize, out)
    return out


@_nf4_dequantize.register_fake
def _(codes, absmax, absmax_scale, absmax_offset, blocksize, dtype):
    return codes.new_empty(2 * codes.numel(), dtype=dtype)


def can_dequantize(q: NF4Tensor) -> bool:
    """True if the kernel can run on ``q``'s tensors (CUDA, or any under the interpreter) and they are contiguous."""
    tensors = [t for t in (q.codes, q.absmax, q.absmax_scale, q.absmax_offset) if t is not None]
    return use_triton(*tensors) and all(t.is_contiguous() for t in tensors)


def dequantize_nf4_triton(q: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The weight ``q`` stands for, in ``dtype`` (default: its original dtype), computed by the Triton kernel.

    Equal bit for bit to :func:`entrenar.quant.nf4.format.dequantize_nf4_reference`.
    The result is a view of a buffer one element longer when the weight has an
    odd number of elements (the pad nibble's value is written there).
    """
    dtype = dtype or q.dtype
    if torch.compiler.is_compiling():  # the graph needs the op; eager skips its dispatch (QLoRA runs hundreds a step)
        flat = _nf4_dequantize(q.codes, q.absmax, q.absmax_scale, q.absmax_offset, q.blocksize, dtype)
    else:
        flat = torch.empty(2 * q.codes.numel(), dtype=dtype, device=q.codes.device)
        launch(q.codes, q.absmax, q.absmax_scale, q.absmax_offset, q.blocksize, flat)
    return flat[: q.numel].view(q.shape)

