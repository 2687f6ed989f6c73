"""Fused SwiGLU (``silu(gate) * up``) against its specification, forward and backward."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, grads, leaf, needs_kernels

from entrenar.kernels.swiglu import FusedMLP, swiglu, swiglu_reference
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import MLP


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_backward_match_the_specification(dtype):
    torch.manual_seed(1)
    shape = (3, 5, 1000)  # 15000 elements: not a multiple of the block
    g0, u0, dy = (torch.randn(shape, device=DEVICE) * 3 for _ in range(3))
    g, u = leaf(g0, dtype), leaf(u0, dtype)
    gr, ur = leaf(g0, dtype), leaf(u0, dtype)
    g64, u64 = leaf(g0, torch.float64), leaf(u0, torch.float64)
    y, y_plain, y64 = swiglu(g, u), swiglu_reference(gr, ur), swiglu_reference(g64, u64)
    assert_as_close(y, y_plain, y64, "output")
    for name, a, b, c in zip(
        ("d gate", "d up"), grads(y, (g, u), dy.to(dtype)), grads(y_plain, (gr, ur), dy.to(dtype)),
        grads(y64, (g64, u64), dy.double()),
    ):
        assert_as_close(a, b, c, name)


def test_cpu_fallback_is_the_specification(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the plain path, even where the interpreter is on
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=40, num_layers=1, num_heads=2, num_kv_heads=1)
    plain = MLP(config)
    fused = FusedMLP(config)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
