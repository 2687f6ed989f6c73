"""MoE experts on a GPU: the grouped product (torch._grouped_mm) against the per-expert loop, forward and
backward, plain and with per-expert LoRA."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.models.config import ModelConfig
from entrenar.models.moe import grouped_mm_available, moe_blocks, set_experts_implementation
from entrenar.models.transformer import Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not grouped_mm_available(),
                                reason="the grouped expert product runs on CUDA with torch._grouped_mm")

CONFIG = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                     num_kv_heads=4, model_type="qwen3_moe", qk_norm=True, num_experts=16, num_experts_per_tok=4,
                     moe_intermediate_size=256, norm_topk_prob=True)


def _run(model, impl, ids):
    set_experts_implementation(model, impl)
    probe = torch.zeros(1, 512, device="cuda", dtype=next(model.parameters()).dtype)
    assert all(block.experts.use_grouped(probe) == (impl == "grouped") for _, block in moe_blocks(model))
    model.zero_grad(set_to_none=True)
    out = model(ids)
    out.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.float().detach(), grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("lora", [False, True])
def test_grouped_experts_equal_the_loop_forward_and_backward(dtype, tol, lora):
    torch.manual_seed(0)
    model = Transformer(CONFIG).cuda().to(dtype)
    model.reset_parameters()
    if lora:
        apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=["q_proj"],
                                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.02)
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    loop_out, loop_grads = _run(model, "loop", ids)
    grouped_out, grouped_grads = _run(model, "grouped", ids)
    assert loop_grads.keys() == grouped_grads.keys()
    if dtype == torch.float32:
        torch.testing.assert_close(grouped_out, loop_out, atol=tol, rtol=tol)
        for name, g in loop_grads.items():
            scale = g.abs().max().clamp_min(1e-6)
            assert (grouped_grads[name] - g).abs().max() / scale < tol * 5, name
        return
    # bf16: the two paths round in different orders, so neither is the reference. Both are held against the
    # same model in fp32: the grouped product may be no further from it than the loop is (plus one bf16 step).
    ref_out, ref_grads = _run(model.float(), "loop", ids)
    loop_err, grouped_err = (loop_out - ref_out).abs().max(), (grouped_out - ref_out).abs().max()
    assert grouped_err <= 2 * loop_err + 2**-7 * ref_out.abs().max(), (grouped_err, loop_err)
    for name, ref in ref_grads.items():
        loop_err = (loop_grads[name] - ref).abs().max()
        grouped_err = (grouped_grads[name] - ref).abs().max()
        assert grouped_err <= 2 * loop_err + 2**-7 * ref.abs().max(), (name, grouped_err, loop_err)
