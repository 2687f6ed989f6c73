"""The elementwise steps of the grouped MoE path, fused (Triton), beside their specification in ``models/moe.py``.

Between and around its two grouped products, an MoE layer runs (tokens sorted by expert, M = tokens x k rows):

* the activation with the routing weight folded in, ``h = silu(gate) * up * w`` on ``gate_up`` [M, 2I]: one read
  of ``gate_up`` and one write of ``h`` instead of the chunk, the sigmoid product and the weight product one after
  another, each through memory; backward rebuilds ``silu`` from ``gate_up`` and returns each row's ``dw`` too;
* the combine, ``out[n] = sum_j ys[inverse[n * k + j]]``, which sums a token's k expert rows as it gathers them
  (fp32 sums): one read of ``ys`` [M, H] and one write of [N, H], where the plain path writes and reads the
  gathered [N, k, H] in between. The dispatch's backward is the same gather-sum.

On the Qwen3-30B-A3B layer (bench/bench_moe.py) these steps were about half of the time outside the grouped
products. :data:`FUSED_ROUTING_OPS` falls back to the specification where Triton cannot run (CPU tensors,
torch.compile tracing), so a model with it set works everywhere.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from entrenar.kernels._common import cdiv, next_power_of_2, use_triton
from entrenar.models.moe import RoutingOps, gather_sum_reference, routed_swiglu_reference

_BLOCK = 1024  # columns per program


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_forward(GU, S, H, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        g = tl.load(GU + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(S + row).to(tl.float32)
        tl.store(H + row * width + cols, (g * tl.sigmoid(g) * u * s).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_backward(DH, GU, S, DGU, DS_PARTS, width, parts, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        dh = tl.load(DH + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GU + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(S + row).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(DGU + row * 2 * width + cols, (dh * s * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty),
                 mask=mask)
        tl.store(DGU + row * 2 * width + width + cols, (dh * s * silu).to(DGU.dtype.element_ty), mask=mask)
        tl.store(DS_PARTS + row * parts + part, tl.sum(dh * silu * u, axis=0))

    @triton.jit
    def gather_sum(ROWS, INDEX, OUT, width, K: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            src = tl.load(INDEX + n * K + j).to(tl.int64)
            acc += tl.load(ROWS + src * width + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + n * width + cols, acc.to(OUT.dtype.element_ty), mask=mask)

    return SimpleNamespace(swiglu_forward=swiglu_forward, swiglu_backward=swiglu_backward, gather_sum=gather_sum)


def _block(width: int) -> int:
    return min(_BLOCK, next_power_of_2(width))


class _RoutedSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        gate_up, scale = gate_up.contiguous(), scale.contiguous()
        m, width = gate_up.shape[0], gate_up.shape[1] // 2
        h = gate_up.new_empty(m, width)
        if m:
            block = _block(width)
            _kernels().swiglu_forward[(m, cdiv(width, block))](gate_up, scale, h, width, BLOCK=block, num_warps=4)
        ctx.save_for_backward(gate_up, scale)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate_up, scale = ctx.saved_tensors
        dh = dh.contiguous()
        m, width = gate_up.shape[0], gate_up.shape[1] // 2
        block = _block(width)
        parts = cdiv(width, block)
        d_gate_up = torch.empty_like(gate_up)
        d_scale_parts = torch.empty(m, parts, device=gate_up.device, dtype=torch.float32)
        if m:
            _kernels().swiglu_backward[(m, parts)](dh, gate_up, scale, d_gate_up, d_scale_parts, width, parts,
                                                   BLOCK=block, num_warps=4)
        return d_gate_up, d_scale_parts.sum(dim=1).to(scale.dtype)


def routed_swiglu(gate_up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`entrenar.models.moe.routed_swiglu_reference`, in one pass forward and one backward (fp32 math)."""
    if torch.compiler.is_compiling() or not use_triton(gate_up, scale) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return routed_swiglu_reference(gate_up, scale)
    return _RoutedSwiglu.apply(gate_up, scale)


def gather_sum(rows: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`entrenar.models.moe.gather_sum_reference` in one pass, summing in fp32 (no autograd: the MoE
    dispatch and combine call it inside their own backward and forward)."""
    if torch.compiler.is_compiling() or not use_triton(rows, index) or rows.dim() != 2:
        return gather_sum_reference(rows, index, k)
    rows, index = rows.contiguous(), index.contiguous()
    n, width = index.numel() // k, rows.shape[1]
    out = rows.new_empty(n, width)
    if n:
        block = _block(width)
        _kernels().gather_sum[(n, cdiv(width, block))](rows, index, out, width, K=k, BLOCK=block, num_warps=4)
    return out


FUSED_ROUTING_OPS = RoutingOps(routed_swiglu, gather_sum)
