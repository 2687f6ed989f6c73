"""apply_kernels on a whole model: what it swaps, that it changes no state, and that training matches."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import assert_as_close, needs_cuda, rel_err

from entrenar.adapters.lora import LoraConfig, LoraLinear, apply_lora, lora_parameters
from entrenar.errors import ConfigError
from entrenar.kernels import (
    KERNELS,
    apply_kernels,
    fused_linear_cross_entropy,
    remove_kernels,
)
from entrenar.models.config import ModelConfig
from entrenar.models.loss import chunked_cross_entropy
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import quantize_model_nf4


def _lora_model(device="cpu", dtype=torch.float32, nf4: bool = False, **shape) -> Transformer:
    """A small Qwen3-shaped model with LoRA (random B) on every projection; ``nf4``: QLoRA, the bases in NF4."""
    torch.manual_seed(0)
    dims = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2}
    config = ModelConfig(**{**dims, **shape}, qk_norm=True, model_type="qwen3", tie_word_embeddings=True)
    model = Transformer(config)
    model.reset_parameters()
    model.to(device=device, dtype=dtype)
    if nf4:
        quantize_model_nf4(model)
    apply_lora(model, LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():  # B starts at zero; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _step(model: Transformer, ids: torch.Tensor, loss_fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss_sum, n = loss_fn(model.hidden_states(ids), model.lm_head.weight, ids)
    loss = loss_sum / n
    return loss.detach(), list(torch.autograd.grad(loss, lora_parameters(model)))


def test_swaps_every_module_kind_and_keeps_the_state(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = _lora_model()
    keys = list(model.state_dict())
    changed = apply_kernels(model)
    n = model.config.num_layers
    # per layer: the block, 2 norms + q/k norms, attention, MLP, 7 adapted linears; plus the final norm
    assert len(changed) == n * (1 + 4 + 1 + 1 + 7) + 1
    assert apply_kernels(model) == []  # already applied
    assert list(model.state_dict()) == keys
    assert sorted(remove_kernels(model)) == sorted(changed)
    assert apply_kernels(model, ["swiglu"]) == [f"model.layers.{i}.mlp" for i in range(n)]
    apply_kernels(model, ["lora"], lora_compute_dtype=torch.bfloat16)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.lora_compute_dtype == torch.bfloat16
    remove_kernels(model)
    assert type(q_proj) is LoraLinear and "lora_compute_dtype" not in vars(q_proj)


def test_unknown_kernel_is_refused():
    with pytest.raises(ConfigError, match="unknown kernels \\['flash'\\]"):
        apply_kernels(_lora_model(), ["rms_norm", "flash"])
    assert "rope" in KERNELS


def test_cpu_training_step_matches_the_plain_model(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plain = _lora_model()
    fused = copy.deepcopy(plain)
    apply_kernels(fused)
    ids = torch.randint(0, 128, (2, 12))
    loss, g = _step(fused, ids, fused_linear_cross_entropy)
    loss_ref, g_ref = _step(plain, ids, chunked_cross_entropy)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_gpu_qlora_training_step_matches_the_plain_qlora_model():
    """NF4 bases through the shared nodes (Triton dequantization) against LoraLinear over NF4Linear."""
    shape = {"hidden_size": 256, "intermediate_size": 704, "vocab_size": 1000}
    plain = _lora_model("cuda", torch.bfloat16, nf4=True, **shape)
    fused = copy.deepcopy(plain)
    apply_kernels(fused)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    loss, g = _step(fused, ids, fused_linear_cross_entropy)
    loss_plain, g_plain = _step(plain, ids, chunked_cross_entropy)
    assert rel_err(loss, loss_plain.float()) < 1e-2
    for i, (a, p) in enumerate(zip(g, g_plain, strict=True)):
        assert rel_err(a, p.float()) < 3e-2, f"gradient {i}: relative error {rel_err(a, p.float()):.3g}"


@needs_cuda
def test_gpu_bf16_training_step_is_as_accurate_as_the_plain_model():
    shape = {"hidden_size": 256, "intermediate_size": 704, "vocab_size": 1000}
    plain = _lora_model("cuda", torch.bfloat16, **shape)
    exact = copy.deepcopy(plain).double()
    fused = copy.deepcopy(plain)
    apply_kernels(fused)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    loss, g = _step(fused, ids, fused_linear_cross_entropy)
    loss_plain, g_plain = _step(plain, ids, chunked_cross_entropy)
    loss_exact, g_exact = _step(exact, ids, chunked_cross_entropy)
    assert_as_close(loss, loss_plain, loss_exact.float(), "loss", computed_in=torch.bfloat16)
    for i, (a, p, e) in enumerate(zip(g, g_plain, g_exact)):
        assert_as_close(a, p, e.float(), f"gradient {i}")


@needs_cuda
@pytest.mark.parametrize("nf4", [False, True], ids=["lora", "qlora"])
def test_compiles_without_graph_breaks(nf4):
    model = _lora_model("cuda", torch.bfloat16, nf4, hidden_size=128, intermediate_size=256)
    apply_kernels(model)
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    compiled = torch.compile(model.hidden_states, fullgraph=True)
    eager_out = model.hidden_states(ids)
    out = compiled(ids)
    assert rel_err(out, eager_out) < 1e-2  # bf16: inductor fuses and rounds differently
    loss_sum, n = fused_linear_cross_entropy(out, model.lm_head.weight, ids)
    (loss_sum / n).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora_parameters(model))
