"""Shared helpers for the kernel tests: where kernels can run, and how close is close enough.

A fused kernel passes if it is about as close to a float64 evaluation of the
specification as the plain PyTorch path is on the same low-precision inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from entrenar.kernels._common import interpreting, triton_available


def kernel_device() -> str | None:
    """"cuda" with a GPU; "cpu" under Triton's interpreter (TRITON_INTERPRET=1); else None."""
    if torch.cuda.is_available() and triton_available():
        return "cuda"
    if interpreting() and triton_available():
        return "cpu"
    return None


DEVICE = kernel_device()
needs_kernels = pytest.mark.skipif(DEVICE is None, reason="Triton kernels need CUDA (or TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest: allow it more.
_FACTOR = 3.0 if DEVICE == "cpu" else 2.0
_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def rel_err(a: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return ((a.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def assert_as_close(fast: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, what: str,
                    computed_in: torch.dtype | None = None) -> None:
    """``fast`` is within a small factor of the plain path's error against the float64 result, or within the
    floor of the dtype it was computed in (``computed_in``, default ``plain``'s: an fp32 loss of a bf16 model
    was computed in bf16)."""
    assert fast.shape == exact.shape, f"{what}: shape {tuple(fast.shape)} != {tuple(exact.shape)}"
    assert fast.dtype == plain.dtype, f"{what}: dtype {fast.dtype} != {plain.dtype}"
    assert torch.isfinite(fast).all(), f"{what}: non-finite values"
    e_fast, e_plain = rel_err(fast, exact), rel_err(plain, exact)
    bound = _FACTOR * e_plain + _FLOOR[computed_in or plain.dtype]
    assert e_fast <= bound, f"{what}: relative error {e_fast:.3g} > {bound:.3g} (plain path: {e_plain:.3g})"


def grads(outputs, inputs, grad_outputs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(outputs, inputs, grad_outputs)


def leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy (optionally cast) that requires grad."""
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def lora_group(dtype: torch.dtype, device: str = "cpu", train_base: bool = False, nf4: bool = False):
    """Three LoRA layers reading one input (as q, k, v), of different widths and ranks (so different
    scalings), one with a bias; the plain layers and fused copies of them. ``nf4``: QLoRA, each base
    quantized to NF4 (frozen)."""
    from entrenar.adapters.lora import LoraLinear
    from entrenar.kernels.lora_linear import FusedLoraLinear
    from entrenar.quant.nf4.format import NF4Linear

    torch.manual_seed(8)
    plain = []
    for out_features, r, bias in ((40, 4, True), (24, 2, False), (24, 6, False)):
        base = nn.Linear(48, out_features, bias=bias).to(dtype)
        if nf4:
            base = NF4Linear.from_linear(base)
        layer = LoraLinear(base, r=r, alpha=8.0).to(device)
        layer.base_layer.requires_grad_(train_base)
        with torch.no_grad():
            layer.lora_B.weight.normal_(0, 0.5)
        plain.append(layer)
    fused = copy.deepcopy(plain)
    for layer in fused:
        layer.__class__ = FusedLoraLinear
    return plain, fused


def check_gate_kernel(fused, reference, dtype: torch.dtype, seed: int = 1) -> None:
    """An MLP gate's kernel (``fused(gate, up)``: SwiGLU's, GeGLU's) against its ``reference`` in ``dtype`` and in
    float64: the product and both gradients, on 15,000 elements (not a multiple of a block)."""
    torch.manual_seed(seed)
    shape = (3, 5, 1000)
    g0, u0, dy = (torch.randn(shape, device=DEVICE) * 3 for _ in range(3))
    g, u = leaf(g0, dtype), leaf(u0, dtype)
    gr, ur = leaf(g0, dtype), leaf(u0, dtype)
    g64, u64 = leaf(g0, torch.float64), leaf(u0, torch.float64)
    y, y_plain, y64 = fused(g, u), reference(gr, ur), reference(g64, u64)
    assert_as_close(y, y_plain, y64, "output")
    for name, a, b, c in zip(
        ("d gate", "d up"), grads(y, (g, u), dy.to(dtype)), grads(y_plain, (gr, ur), dy.to(dtype)),
        grads(y64, (g64, u64), dy.double()),
    ):
        assert_as_close(a, b, c, name)
