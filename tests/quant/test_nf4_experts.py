"""NF4 experts (QLoRA on MoE models): streamed loading equals quantizing the loaded experts, the block computes
with the dequantized weights, adapters train on top, and merging into them is refused."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, merge_lora
from entrenar.errors import AdapterError
from entrenar.models.hf import load_hf
from entrenar.models.moe import moe_blocks
from entrenar.quant.nf4.experts import NF4Experts, quantize_experts_nf4
from entrenar.quant.nf4.format import dequantize_nf4, quantize_nf4
from entrenar.quant.nf4.sinks import nf4_sinks

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_streamed_nf4_experts_compute_with_the_dequantized_weights(hf_folder, family):
    folder, _ = hf_folder(family)
    full = load_hf(folder).eval()
    streamed = load_hf(folder, sinks=nf4_sinks).eval()
    blocks = moe_blocks(streamed)
    assert blocks and all(isinstance(b.experts, NF4Experts) for _, b in blocks)
    # Each expert's projection is bitsandbytes-style NF4 of the checkpoint's tensor.
    (layer, block), = blocks[:1]
    ref = full.model.layers[layer].mlp.experts
    i = ref.intermediate_size
    expected = dequantize_nf4(quantize_nf4(ref.gate_up_proj[2, i:].detach()))
    assert torch.equal(block.experts.expert(2).up_proj.weight, expected)
    # Quantizing after loading gives the same model as quantizing while streaming.
    quantize_experts_nf4(full)
    x = torch.randn(1, 6, full.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(block(x), full.model.layers[layer].mlp(x), atol=0, rtol=0)
    # And the block computes with the dequantized stacks (the full-precision Experts on those weights).
    from entrenar.models.moe import Experts

    plain = Experts(ref.num_experts, ref.hidden_size, i)
    with torch.no_grad():
        plain.gate_up_proj.copy_(block.experts.gate_up_proj)
        plain.down_proj.copy_(block.experts.down_proj)
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = block.gate(flat)
        torch.testing.assert_close(block.experts(flat, indices, weights), plain(flat, indices, weights),
                                   atol=1e-6, rtol=1e-5)


def test_qlora_adapters_on_nf4_experts_get_gradients_and_refuse_to_merge(hf_folder):
    folder, _ = hf_folder("qwen3_moe")
    model = load_hf(folder, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=2, alpha=4, target_modules=["q_proj"], target_parameters=TARGETS))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    model(torch.randint(0, 128, (2, 8))).float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with pytest.raises(AdapterError, match="quantized"):
        merge_lora(model)
