"""The fused MoE routing steps (routed SwiGLU, gather-sum) against their specification in models/moe.py, alone
and inside an MoE model whose experts run grouped, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, grads, leaf, needs_kernels

from entrenar.kernels import FUSED_ROUTING_OPS, apply_kernels, remove_kernels
from entrenar.kernels.moe_routing import gather_sum, routed_swiglu
from entrenar.models.config import ModelConfig
from entrenar.models.moe import (
    REFERENCE_ROUTING_OPS,
    gather_sum_reference,
    grouped_mm_available,
    moe_blocks,
    routed_swiglu_reference,
    set_experts_implementation,
)
from entrenar.models.transformer import Transformer


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [48, 1100])  # one masked block; two blocks, the second partial
def test_routed_swiglu_matches_the_specification(dtype, width):
    torch.manual_seed(0)
    rows = 37
    gu0, dh = torch.randn(rows, 2 * width, device=DEVICE) * 3, torch.randn(rows, width, device=DEVICE)
    s0 = torch.rand(rows, device=DEVICE)
    gu, s = leaf(gu0, dtype), leaf(s0, dtype)
    gur, sr = leaf(gu0, dtype), leaf(s0, dtype)
    gu64, s64 = leaf(gu0, torch.float64), leaf(s0, torch.float64)
    h, h_plain, h64 = routed_swiglu(gu, s), routed_swiglu_reference(gur, sr), routed_swiglu_reference(gu64, s64)
    assert_as_close(h, h_plain, h64, "output")
    for name, a, b, c in zip(("d gate_up", "d scale"), grads(h, (gu, s), dh.to(dtype)),
                             grads(h_plain, (gur, sr), dh.to(dtype)), grads(h64, (gu64, s64), dh.double())):
        assert_as_close(a, b, c, name)


@needs_kernels
def test_routed_swiglu_of_bf16_rows_and_fp32_weights_matches_the_specification():
    """An fp32 model under autocast: the grouped products give bf16 rows, the routing weights stay fp32."""
    torch.manual_seed(0)
    gu0, dh = torch.randn(19, 96, device=DEVICE) * 3, torch.randn(19, 48, device=DEVICE)
    s0 = torch.rand(19, device=DEVICE)
    gu, s = leaf(gu0, torch.bfloat16), leaf(s0)
    gur, sr = leaf(gu0, torch.bfloat16), leaf(s0)
    gu64, s64 = leaf(gu0.bfloat16(), torch.float64), leaf(s0, torch.float64)
    h, h_plain, h64 = routed_swiglu(gu, s), routed_swiglu_reference(gur, sr), routed_swiglu_reference(gu64, s64)
    assert h.dtype == torch.bfloat16
    assert_as_close(h, h_plain, h64, "output")
    fused, plain, exact = grads(h, (gu, s), dh.bfloat16()), grads(h_plain, (gur, sr), dh.bfloat16()), \
        grads(h64, (gu64, s64), dh.bfloat16().double())
    assert fused[1].dtype == torch.float32  # each routing weight's gradient in its own dtype
    assert_as_close(fused[0], plain[0], exact[0], "d gate_up")
    assert_as_close(fused[1], plain[1], exact[1], "d scale", computed_in=torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_sum_matches_the_specification(dtype):
    torch.manual_seed(0)
    n, k, width = 29, 4, 1500
    rows0 = torch.randn(n * k, width, device=DEVICE)
    index = torch.randperm(n * k, device=DEVICE)
    out = gather_sum(rows0.to(dtype), index, k)
    plain = gather_sum_reference(rows0.to(dtype), index, k)
    exact = gather_sum_reference(rows0.to(dtype).double(), index, k)
    assert_as_close(out, plain, exact, "gather-sum")
    assert gather_sum(rows0[:0].to(dtype), index[:0], k).shape == (0, width)


def _moe_model(device: str) -> Transformer:
    config = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, num_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=32, norm_topk_prob=True, qk_norm=True)
    torch.manual_seed(0)
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model.to(device)


@needs_kernels
@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped expert path needs torch._grouped_mm")
def test_apply_kernels_gives_grouped_experts_the_fused_steps_with_the_same_result():
    """An MoE model with kernels applied: same loss and gradients as its plain grouped path, and removal restores
    the reference steps."""
    plain = _moe_model(DEVICE)
    set_experts_implementation(plain, "grouped")
    fused = copy.deepcopy(plain)
    changed = apply_kernels(fused, ("moe_routing",))
    blocks = moe_blocks(fused)
    assert [f"model.layers.{i}.mlp.experts" for i, _ in blocks] == changed
    assert all(b.experts.routing_ops is FUSED_ROUTING_OPS for _, b in blocks)
    ids = torch.randint(0, 96, (2, 24), device=DEVICE)
    losses, gradients = [], []
    for model in (plain, fused):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
        loss.backward()
        losses.append(loss.detach())
        gradients.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for name, g in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], g, atol=1e-5, rtol=1e-4, msg=name)
    remove_kernels(fused)
    assert all(b.experts.routing_ops is REFERENCE_ROUTING_OPS for _, b in moe_blocks(fused))


@needs_kernels
@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped expert path needs torch._grouped_mm")
def test_lora_wrapped_experts_use_the_fused_steps_with_the_same_result():
    """LoRA on every expert (both stacks wrapped, PEFT's nesting): the wrappers answer the fused steps of the
    Experts inside, and the adapters' gradients equal the plain grouped path's."""
    from entrenar.adapters.lora import LoraConfig, apply_lora

    plain = _moe_model(DEVICE)
    set_experts_implementation(plain, "grouped")
    apply_lora(plain, LoraConfig(r=8, alpha=16, target_modules=["q_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    for name, p in plain.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B starts at zero: give the adapters an effect to check
    fused = copy.deepcopy(plain)
    apply_kernels(fused, ("moe_routing",))
    assert all(b.experts.routing_ops is FUSED_ROUTING_OPS for _, b in moe_blocks(fused))  # the outer wrapper
    ids = torch.randint(0, 96, (2, 24), device=DEVICE)
    gradients = []
    for model in (plain, fused):
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert any("experts" in n for n in gradients[0])
    for name, g in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], g, atol=1e-5, rtol=1e-4, msg=name)
