"""Fused SwiGLU (``silu(gate) * up``) against its specification, forward and backward, alone and feeding a LoRA
projection (``swiglu_lora_linear``, which rebuilds the product in backward instead of saving it)."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, check_gate_kernel, grads, leaf, needs_kernels

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels import apply_kernels
from entrenar.kernels.swiglu import (
    FusedMLP,
    swiglu,
    swiglu_backward,
    swiglu_backward_reference,
    swiglu_lora_linear,
    swiglu_reference,
)
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import MLP
from entrenar.quant.nf4.format import quantize_model_nf4


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_backward_match_the_specification(dtype):
    check_gate_kernel(swiglu, swiglu_reference, dtype)


def test_cpu_fallback_is_the_specification(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the plain path, even where the interpreter is on
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=40, num_layers=1, num_heads=2, num_kv_heads=1)
    plain = MLP(config)
    fused = FusedMLP(config)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)


def test_backward_reference_is_the_gradient_of_the_specification():
    torch.manual_seed(2)
    g, u = leaf(torch.randn(40, dtype=torch.float64) * 4), leaf(torch.randn(40, dtype=torch.float64))
    dy = torch.randn(40, dtype=torch.float64)
    want = grads(swiglu_reference(g, u), (g, u), dy)
    for name, a, b in zip(("d gate", "d up"), swiglu_backward_reference(dy, g.detach(), u.detach()), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_cpu_backward_is_autograds_bit_for_bit_and_the_reference_within_rounding(monkeypatch, dtype):
    """Without Triton, 16-bit gradients on a CPU are what autograd gives the plain MLP's ``silu(gate) * up`` (as
    transformers runs it under autocast), bit for bit, and within 16-bit rounding of the fp32 reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(4)
    g, u = leaf((torch.randn(64, 96) * 3).to(dtype)), leaf(torch.randn(64, 96).to(dtype))
    dy = torch.randn(64, 96).to(dtype)
    want = grads(swiglu_reference(g, u), (g, u), dy)
    got = swiglu_backward(dy, g.detach(), u.detach())
    reference = swiglu_backward_reference(dy, g.detach(), u.detach())
    for name, a, b, r in zip(("d gate", "d up"), got, want, reference):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        assert ((a.float() - r.float()).norm() / r.float().norm()) < 1e-2, name


def _lora_mlp(device: str, dtype: torch.dtype, nf4: bool = False) -> MLP:
    """A LoRA SwiGLU MLP with random B; ``nf4``: its bases quantized to NF4 first (QLoRA)."""
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=136, num_layers=1, num_heads=2,
                         num_kv_heads=1, mlp_bias=False)
    mlp = MLP(config).to(device=device, dtype=dtype)
    if nf4:
        quantize_model_nf4(mlp)
    apply_lora(mlp, LoraConfig(r=4, alpha=8.0, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return mlp


def _mlp_step(mlp: MLP, x0: torch.Tensor, dtype: torch.dtype):
    torch.manual_seed(4)
    x = leaf(x0, dtype)
    y = mlp(x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    return (y, *grads(y, (x, *params), torch.randn(y.shape, device=y.device).to(y.dtype)))


@pytest.mark.parametrize("device", ["cpu", pytest.param(DEVICE, marks=needs_kernels, id="kernels")])
def test_lora_mlp_as_three_nodes_is_as_accurate_as_the_plain_mlp(device, monkeypatch):
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    plain = _lora_mlp(device, torch.bfloat16)
    exact = copy.deepcopy(plain).double()
    fused = copy.deepcopy(plain)
    assert len(apply_kernels(fused, ["swiglu", "lora"])) == 4
    x0 = torch.randn(3, 7, 48, device=device)
    results = zip(_mlp_step(fused, x0, torch.bfloat16), _mlp_step(plain, x0, torch.bfloat16),
                  _mlp_step(exact, x0, torch.float64))
    names = ("output", "d x", "d A gate", "d B gate", "d A up", "d B up", "d A down", "d B down")
    for name, a, p, e in zip(names, *zip(*results), strict=True):
        assert_as_close(a, p, e, name)


@pytest.mark.parametrize("nf4", [False, True], ids=["fp32-base", "nf4-base"])
def test_swiglu_lora_linear_is_the_two_ops_in_turn(monkeypatch, nf4):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mlp = _lora_mlp("cpu", torch.float32, nf4)
    apply_kernels(mlp, ["lora"])
    down = mlp.down_proj
    weight = down.base_layer.quantized if nf4 else down.base_layer.weight
    g0, u0 = torch.randn(2, 5, 136) * 3, torch.randn(2, 5, 136)
    results = []
    for together in (True, False):
        gate, up = leaf(g0), leaf(u0)
        if together:
            y = swiglu_lora_linear(gate, up, weight, None, down.lora_A.weight, down.lora_B.weight, down.scaling)
        else:
            y = down(swiglu_reference(gate, up))
        dy = torch.ones_like(y).cumsum(-1) / 50
        results.append((y, *grads(y, (gate, up, down.lora_A.weight, down.lora_B.weight), dy)))
    for name, a, b in zip(("output", "d gate", "d up", "d A", "d B"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-bases", "nf4-bases"])
def test_lora_mlp_keeps_gate_and_up_but_not_their_product(monkeypatch, nf4):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mlp = _lora_mlp("cpu", torch.bfloat16, nf4)
    apply_kernels(mlp, ["swiglu", "lora"])
    x = torch.randn(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    params = {p.data_ptr() for p in (*mlp.parameters(), *mlp.buffers())}  # NF4 codes too
    saved = []

    def pack(t):
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    n = 4 * 16
    # A x of gate and up together (and their A matrices stacked), gate and up themselves, A h of down:
    # never h = silu(gate) * up, nor a dequantized NF4 weight.
    assert sorted(saved, key=str) == sorted([((n, 8), torch.float32), ((8, 48), torch.float32),
                                             ((4, 16, 136), torch.bfloat16), ((4, 16, 136), torch.bfloat16),
                                             ((n, 4), torch.float32)], key=str)
