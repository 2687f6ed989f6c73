"""Gemma's fused MLP gate (``gelu_tanh(gate) * up``) against its specification, forward and backward, and the
fused Gemma MLP against the plain one."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, check_gate_kernel, grads, leaf, needs_kernels

from entrenar.kernels import apply_kernels
from entrenar.kernels.geglu import FusedGatedMLP, geglu, geglu_backward_reference, geglu_reference
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import GatedMLP


def _config(act: str = "gelu_pytorch_tanh") -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=40, num_layers=1, num_heads=2,
                       num_kv_heads=1, hidden_act=act)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_backward_match_the_specification(dtype):
    check_gate_kernel(geglu, geglu_reference, dtype)


def test_backward_reference_is_the_gradient_of_the_specification():
    """The sigmoid form of the tanh approximation and its derivative (the kernel's formulas) are PyTorch's
    ``gelu(approximate="tanh")`` and its autograd gradient, to float64 rounding."""
    torch.manual_seed(2)
    g, u = leaf(torch.randn(200, dtype=torch.float64) * 4), leaf(torch.randn(200, dtype=torch.float64))
    dy = torch.randn(200, dtype=torch.float64)
    want = grads(geglu_reference(g, u), (g, u), dy)
    for name, a, b in zip(("d gate", "d up"), geglu_backward_reference(dy, g.detach(), u.detach()), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_apply_kernels_swaps_gemmas_mlp_and_norms_and_the_outputs_stay(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the plain path, even where the interpreter is on
    torch.manual_seed(0)
    for act, fused_class in (("gelu_pytorch_tanh", FusedGatedMLP), ("gelu", FusedGatedMLP)):
        plain = GatedMLP(_config(act))
        model = torch.nn.Sequential(GatedMLP(_config(act)))
        model[0].load_state_dict(plain.state_dict())
        assert "0" in apply_kernels(model)
        assert type(model[0]) is fused_class and list(model[0].state_dict()) == list(plain.state_dict())
        x = torch.randn(2, 3, 16)
        torch.testing.assert_close(model[0](x), plain(x), rtol=0, atol=0)


@needs_kernels
def test_fused_mlp_gradients_match_the_plain_mlp():
    """The whole Gemma MLP (bf16) with the kernel: output and every weight's gradient as close to float64 as the
    plain module's."""
    torch.manual_seed(5)
    config = _config()
    plain = GatedMLP(config).to(DEVICE)
    exact = GatedMLP(config).to(DEVICE, torch.float64)
    exact.load_state_dict(plain.state_dict())
    fused = FusedGatedMLP(config).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    plain, fused = plain.bfloat16(), fused.bfloat16()
    x0 = torch.randn(4, 7, 16, device=DEVICE)
    outs = [m(x0.to(dtype)) for m, dtype in ((fused, torch.bfloat16), (plain, torch.bfloat16), (exact, torch.float64))]
    assert_as_close(*outs, "output")
    dy = torch.randn_like(outs[2])
    for out in outs:
        out.backward(dy.to(out.dtype))
    for name, p in fused.named_parameters():
        assert_as_close(p.grad, dict(plain.named_parameters())[name].grad,
                        dict(exact.named_parameters())[name].grad, f"d {name}")
