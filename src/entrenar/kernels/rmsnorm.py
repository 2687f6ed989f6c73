"""RMSNorm in one pass forward and one pass backward (Triton), with its PyTorch specification.

The plain path (:class:`entrenar.models.transformer.RMSNorm`) upcasts to fp32,
keeps an fp32 copy of the input for backward and launches several kernels.
The fused kernel reads each row once, saves only the input (in its own dtype)
and one fp32 ``1/rms`` per row, and rounds exactly where the plain path does:
``weight * (x * rstd).to(x.dtype)``.

Gemma's norm (:class:`entrenar.models.transformer.OffsetRMSNorm`) runs the same kernels with ``offset``: the
product is ``x * rstd * (1 + weight)`` all in fp32, rounded once to the input's dtype, as that module computes it
(its plain path keeps an fp32 copy of the input and launches about eight kernels forward, more backward).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from entrenar.kernels._common import call_op, cdiv, next_power_of_2, use_triton
from entrenar.models.transformer import OffsetRMSNorm, RMSNorm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The specification: exactly what ``RMSNorm.forward`` computes."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def offset_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The specification of Gemma's norm: exactly what ``OffsetRMSNorm.forward`` computes."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def forward(X, W, Y, RSTD, stride_x, stride_y, n_rows, n_cols, eps,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OFFSET: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        rmask, cmask = rows < n_rows, cols < n_cols
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if OFFSET:  # Gemma: all in fp32, one rounding
            y = x * rstd[:, None] * (1.0 + w[None, :])
        else:
            y = w[None, :] * (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # the plain path's rounding
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def backward(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, n_rows, n_cols,
                 ROWS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 OFFSET: tl.constexpr):
        # Each program owns a contiguous run of rows and writes one partial sum of dW;
        # the partials are added up outside (no atomics, so results are deterministic).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < n_cols
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if OFFSET:
            w = 1.0 + w
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        first = pid * ROWS_PER_PROGRAM
        for offset in range(0, ROWS_PER_PROGRAM, BLOCK_R):
            rows = (first + offset + tl.arange(0, BLOCK_R)).to(tl.int64)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            normed = x * rstd[:, None]
            if OFFSET:
                dw += tl.sum(dy * normed, 0)
            else:
                dw += tl.sum(dy * normed.to(X.dtype.element_ty).to(tl.float32), 0)
            g = dy * w[None, :]
            # d/dx of x*rstd: rstd * (g - normed * mean(g * normed))
            dot = tl.sum(g * normed, 1) / n_cols
            dx = rstd[:, None] * (g - normed * dot[:, None])
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DW_PART + pid * n_cols + cols, dw, mask=cmask)

    return SimpleNamespace(forward=forward, backward=backward)


def _blocks(n_cols: int) -> tuple[int, int, int]:
    """(rows per block, padded row length, warps): about 4096 elements per block, whole rows."""
    block_d = next_power_of_2(n_cols)
    block_r = max(1, min(16, 4096 // block_d))
    warps = min(16, max(4, block_d * block_r // 512))  # about 16 elements per thread
    return block_r, block_d, warps


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _rms_norm_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rebuild: bool = False, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    # ``rebuild`` changes nothing computed: it marks a backward's recomputation of a forward's output, so that
    # torch.compile does not merge the two calls (and then keep the output alive in between).
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    y = torch.empty(x2.shape, dtype=_output_dtype(x, weight, offset), device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block_r, block_d, warps = _blocks(n_cols)
    grid = (cdiv(x2.shape[0], block_r),)
    _kernels().forward[grid](
        x2, weight, y, rstd, x2.stride(0), y.stride(0), x2.shape[0], n_cols, eps,
        BLOCK_R=block_r, BLOCK_D=block_d, OFFSET=offset, num_warps=warps,
    )
    return y.view(*x.shape[:-1], n_cols), rstd


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, offset: bool) -> torch.dtype:
    return x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)


_rms_norm = torch.library.custom_op("entrenar::rms_norm", mutates_args=())(_rms_norm_impl)


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, rebuild: bool = False,
      offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, offset))
    return y, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _rms_norm_backward_impl(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2, dy2 = x.reshape(-1, n_cols), dy.reshape(-1, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, warps = _blocks(n_cols)
    # A power of two (a compile-time constant of the kernel), so few distinct values get compiled.
    rows_per_program = max(block_r, next_power_of_2(cdiv(n_rows, _num_programs(x.device))))
    programs = cdiv(n_rows, rows_per_program)
    dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    _kernels().backward[(programs,)](
        dy2, x2, weight, rstd, dx, dw_part, dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, n_cols,
        ROWS_PER_PROGRAM=rows_per_program, BLOCK_R=block_r, BLOCK_D=block_d, OFFSET=offset, num_warps=warps,
    )
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


_rms_norm_backward = torch.library.custom_op("entrenar::rms_norm_backward", mutates_args=())(_rms_norm_backward_impl)


@_rms_norm_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
      offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _, _, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor):
    x, weight, rstd = ctx.saved_tensors
    # the op: torch.compile traces this backward outside dynamo
    dx, dw = _rms_norm_backward(dy, x, weight, rstd, ctx.offset)
    return dx, dw, None, None, None


_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference`` through the fused kernel where Triton can run, else the reference itself."""
    if not _fits(x, weight):
        return rms_norm_reference(x, weight, eps)
    return call_op(_rms_norm, _rms_norm_impl, x, weight, float(eps))[0]


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``offset_rms_norm_reference`` (Gemma's ``1 + weight`` norm) through the fused kernel where Triton can run,
    else the reference itself."""
    if not _fits(x, weight):
        return offset_rms_norm_reference(x, weight, eps)
    return call_op(_rms_norm, _rms_norm_impl, x, weight, float(eps), False, True)[0]


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return use_triton(x, weight) and weight.shape == x.shape[-1:]


def rms_norm_and_rstd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rebuild: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x, weight, eps)`` and its fp32 ``1/rms`` per row (flat), for hand-written autograd nodes that
    end in :func:`rms_norm_backward`. ``rebuild=True`` marks a backward's recomputation of the output."""
    if _fits(x, weight):
        return call_op(_rms_norm, _rms_norm_impl, x, weight, float(eps), rebuild)
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd.reshape(-1)


def rms_norm_backward_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`rms_norm_reference` with respect to ``x`` and ``weight``, as the kernel forms them:
    ``dw = sum of dy * normed`` and ``dx = rstd * (g - normed * mean(g * normed))`` with ``g = dy * weight``."""
    x32 = x.float()
    normed = x32 * rstd.view(*x.shape[:-1], 1)
    dy32 = dy.float()
    dw = (dy32 * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    g = dy32 * weight.float()
    dx = rstd.view(*x.shape[:-1], 1) * (g - normed * (g * normed).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` and ``dweight`` of :func:`rms_norm_and_rstd` (no autograd graph): the kernel where it runs."""
    if _fits(x, weight):
        return call_op(_rms_norm_backward, _rms_norm_backward_impl, dy, x, weight, rstd)
    return rms_norm_backward_reference(dy, x, weight, rstd)


class FusedRMSNorm(RMSNorm):
    """An :class:`RMSNorm` whose forward runs the fused kernel; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class FusedOffsetRMSNorm(OffsetRMSNorm):
    """Gemma's :class:`OffsetRMSNorm` whose forward runs the fused kernel; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)
