"""Fused RMSNorm against its specification (``RMSNorm.forward``; Gemma's ``OffsetRMSNorm.forward``), forward and
backward."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, grads, leaf, needs_kernels

from entrenar.kernels.rmsnorm import (
    FusedOffsetRMSNorm,
    FusedRMSNorm,
    offset_rms_norm,
    offset_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from entrenar.models.transformer import OffsetRMSNorm, RMSNorm


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 7, 576), (2, 5, 4, 128), (33, 64)], ids=["hidden", "qk-norm", "rows"])
def test_forward_and_backward_match_the_specification(dtype, shape):
    torch.manual_seed(sum(shape))
    x0 = torch.randn(shape, device=DEVICE) * 3
    w0 = 1 + 0.3 * torch.randn(shape[-1], device=DEVICE)
    dy = torch.randn(shape, device=DEVICE)
    x, w = leaf(x0, dtype), leaf(w0, dtype)
    xr, wr = leaf(x0, dtype), leaf(w0, dtype)
    x64, w64 = leaf(x0, torch.float64), leaf(w0, torch.float64)

    y, y_plain, y64 = rms_norm(x, w, 1e-6), rms_norm_reference(xr, wr, 1e-6), rms_norm_reference(x64, w64, 1e-6)
    assert_as_close(y, y_plain, y64, "output")
    for name, g, g_plain, g64 in zip(
        ("d input", "d weight"), grads(y, (x, w), dy.to(dtype)), grads(y_plain, (xr, wr), dy.to(dtype)),
        grads(y64, (x64, w64), dy.double()),
    ):
        assert_as_close(g, g_plain, g64, name)


@needs_kernels
def test_fp32_weight_on_bf16_input_promotes_like_the_specification():
    x = torch.randn(4, 96, device=DEVICE, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(96, device=DEVICE)
    y, ref = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert y.dtype == ref.dtype == torch.float32
    # The normed value is rounded to bf16 before the fp32 weight multiplies it: one bf16 step apart at most.
    torch.testing.assert_close(y, ref, rtol=8e-3, atol=1e-2)


def test_cpu_fallback_is_the_specification(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the plain path, even where the interpreter is on
    torch.manual_seed(0)
    plain = RMSNorm(48, 1e-6)
    with torch.no_grad():
        plain.weight.add_(torch.randn(48) * 0.2)
    fused = FusedRMSNorm(48, 1e-6)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 48, requires_grad=True)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    assert list(fused.state_dict()) == ["weight"]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 7, 640), (2, 5, 4, 256), (33, 64)], ids=["hidden", "qk-norm", "rows"])
def test_gemmas_offset_norm_matches_its_module_forward_and_backward(dtype, shape):
    """Gemma's ``(1 + w)`` norm through the kernel (``offset``): its output and both gradients as close to a
    float64 evaluation as ``OffsetRMSNorm``'s own forward, rounded once in the input's dtype as it is."""
    torch.manual_seed(sum(shape) + 1)
    x0 = torch.randn(shape, device=DEVICE) * 3
    w0 = 0.3 * torch.randn(shape[-1], device=DEVICE)  # stored as Gemma stores it: zeros are the identity
    dy = torch.randn(shape, device=DEVICE)
    x, w = leaf(x0, dtype), leaf(w0, dtype)
    xr, wr = leaf(x0, dtype), leaf(w0, dtype)
    x64, w64 = leaf(x0, torch.float64), leaf(w0, torch.float64)
    y, y_plain = offset_rms_norm(x, w, 1e-6), offset_rms_norm_reference(xr, wr, 1e-6)
    y64 = offset_rms_norm_reference(x64, w64, 1e-6)
    assert y.dtype == x.dtype
    assert_as_close(y, y_plain, y64, "output")
    for name, g, g_plain, g64 in zip(
        ("d input", "d weight"), grads(y, (x, w), dy.to(dtype)), grads(y_plain, (xr, wr), dy.to(dtype)),
        grads(y64, (x64, w64), dy.double()),
    ):
        assert_as_close(g, g_plain, g64, name)


def test_offset_reference_is_gemmas_module_and_the_fused_module_keeps_its_state(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(3)
    plain = OffsetRMSNorm(40, 1e-6)
    with torch.no_grad():
        plain.weight.normal_(0, 0.3)
    fused = FusedOffsetRMSNorm(40, 1e-6)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(offset_rms_norm_reference(x, plain.weight, 1e-6), plain(x), rtol=0, atol=0)
    assert list(fused.state_dict()) == ["weight"]
