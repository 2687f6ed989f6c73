"""LoRA fused with its base projection (hand-written backward) against the plain ``LoraLinear``.

This op is plain PyTorch, so it is checked on CPU too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import assert_as_close, rel_err
from torch import nn

from entrenar.kernels.lora_linear import FusedLoraLinear
from entrenar.lora import LoraLinear


def _pair(dtype: torch.dtype, bias: bool = True, dropout: float = 0.0, device: str = "cpu"):
    """A plain LoRA layer with a random (non-zero) B, and a fused copy of it."""
    torch.manual_seed(6)
    base = nn.Linear(48, 40, bias=bias).to(device=device, dtype=dtype)
    plain = LoraLinear(base, r=4, alpha=8.0, dropout=dropout)
    with torch.no_grad():
        plain.lora_B.weight.normal_(0, 0.5)
    fused = copy.deepcopy(plain)
    fused.__class__ = FusedLoraLinear
    return plain, fused


def _run(layer: nn.Module, x0: torch.Tensor, dy: torch.Tensor, x_dtype: torch.dtype):
    x = x0.detach().to(x_dtype).requires_grad_(True)
    y = layer(x)
    params = [layer.lora_A.weight, layer.lora_B.weight]
    if layer.base_layer.weight.requires_grad:
        params += [layer.base_layer.weight, layer.base_layer.bias]
    return (y, *torch.autograd.grad(y, [x, *params], dy.to(y.dtype)))


NAMES = ("output", "d x", "d A", "d B", "d W", "d bias")


@pytest.mark.parametrize("train_base", [False, True], ids=["frozen-base", "trained-base"])
def test_fp32_matches_plain_lora(train_base):
    plain, fused = _pair(torch.float32)
    for layer in (plain, fused):
        layer.base_layer.requires_grad_(train_base)
    x0, dy = torch.randn(2, 5, 48), torch.randn(2, 5, 40)
    for name, a, b in zip(NAMES, _run(fused, x0, dy, torch.float32), _run(plain, x0, dy, torch.float32)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_base_with_fp32_adapters_is_as_accurate_as_plain_lora():
    plain, fused = _pair(torch.bfloat16)
    exact = copy.deepcopy(plain).double()
    x0, dy = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    results = zip(NAMES, _run(fused, x0, dy, torch.bfloat16), _run(plain, x0, dy, torch.bfloat16),
                  _run(exact, x0, dy, torch.float64))
    for name, a, p, e in results:
        assert_as_close(a, p, e, name)


def test_bf16_adapter_math_stays_within_bf16_error():
    plain, fused = _pair(torch.bfloat16)
    fused.lora_compute_dtype = torch.bfloat16
    exact = copy.deepcopy(plain).double()
    x0, dy = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    got, want = _run(fused, x0, dy, torch.bfloat16), _run(exact, x0, dy, torch.float64)
    for name, a, e in zip(NAMES, got, want):
        assert a.dtype == (torch.bfloat16 if name in ("output", "d x") else torch.float32), name
        assert rel_err(a, e) < 1e-2, f"{name}: relative error {rel_err(a, e):.3g}"


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward, parameters excluded."""
    params = {p.data_ptr() for p in layer.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved)


def test_backward_keeps_only_the_small_adapter_activation():
    plain, fused = _pair(torch.bfloat16)
    x = torch.randn(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    xa_bytes = 4 * 16 * plain.r * 4  # A x in fp32
    assert _saved_bytes(fused, x) == xa_bytes
    assert _saved_bytes(plain, x) > 2 * x.numel() * x.element_size()  # an fp32 copy of x, at least


def test_merged_or_dropout_falls_back_to_the_plain_forward():
    plain, fused = _pair(torch.float32, dropout=0.3)
    x = torch.randn(2, 48)
    torch.manual_seed(7)
    y_plain = plain(x)
    torch.manual_seed(7)
    torch.testing.assert_close(fused(x), y_plain, rtol=0, atol=0)  # same dropout mask: the plain path ran
    plain.eval(), fused.eval()
    fused.merge(), plain.merge()
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
