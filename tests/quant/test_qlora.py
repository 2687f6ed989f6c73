"""QLoRA: an NF4 base loaded tensor by tensor, adapters trained through it, merged back to 16-bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import entrenar
from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters, merge_lora, unload_lora
from entrenar.models.hf import load_hf
from entrenar.models.surgery import replace_module
from entrenar.quant.nf4.format import NF4Linear, quantize_model_nf4
from entrenar.quant.nf4.sinks import nf4_sinks


def test_streamed_nf4_load_equals_quantizing_after_load(hf_folder):
    folder, _ = hf_folder("qwen2")
    streamed = load_hf(folder, sinks=nf4_sinks)
    reference = load_hf(folder)
    quantize_model_nf4(reference)
    assert isinstance(streamed.model.layers[1].mlp.down_proj, NF4Linear)
    assert isinstance(streamed.lm_head, nn.Linear)  # the output head stays in full precision
    for (name, a), (_, b) in zip(streamed.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    # No full-precision copy of any quantized weight is resident: floats are only embeddings, head, norms, biases.
    floats = [n for n, t in streamed.state_dict().items() if t.is_floating_point() and t.dim() == 2]
    assert floats == ["model.embed_tokens.weight", "lm_head.weight"]


def test_adapter_gradients_equal_those_on_the_dequantized_base(hf_folder):
    folder, _ = hf_folder("llama")
    qlora = load_hf(folder, sinks=nf4_sinks)
    dequantized = copy.deepcopy(qlora)
    for name, module in list(dequantized.named_modules()):
        if isinstance(module, NF4Linear):
            replace_module(dequantized, name, module.to_linear())
    ids = torch.randint(0, 128, (2, 16))
    grads = []
    for model in (qlora, dequantized):
        torch.manual_seed(3)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        for p in lora_parameters(model):
            if p.abs().sum() == 0:
                nn.init.normal_(p, std=0.05)  # B starts at zero; make the base's input gradient matter
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


def test_merged_qlora_model_is_16_bit_with_the_same_output(hf_folder):
    folder, _ = hf_folder("qwen3")
    model = load_hf(folder, dtype=torch.bfloat16, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    for p in lora_parameters(model):
        nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        before = model(ids).float()
    merge_lora(model)
    unload_lora(model, merge=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(model(ids).float(), before, atol=0.05, rtol=0.05)


def test_unknown_base_quantization_is_refused(hf_folder):
    from entrenar.errors import ModelError

    folder, _ = hf_folder("llama")
    with pytest.raises(ModelError, match="unknown base quantization 'nf2'"):
        entrenar.load(folder, quantize="nf2")


def test_adapters_on_a_quantized_base_are_built_without_dequantizing_it(hf_folder, monkeypatch):
    """LoRA reads the base's dtype and device from an empty tensor beside its codes: dequantizing every layer
    just to read them made an FSDP run's rank 0 spend minutes building a 70B NF4 base on its CPU."""
    from entrenar.quant import int as int_quant
    from entrenar.quant.int import QuantLinear
    from entrenar.quant.nf4 import format as nf4

    folder, _ = hf_folder("llama")
    model = load_hf(folder, sinks=nf4_sinks, dtype=torch.bfloat16)
    q_proj = model.model.layers[0].self_attn.q_proj
    replace_module(model, "model.layers.0.self_attn.q_proj",
                   QuantLinear.from_linear(q_proj.to_linear(), name="q_proj.weight", bits=8))

    def refuse(*args, **kwargs):
        raise AssertionError("the base was dequantized")

    monkeypatch.setattr(nf4, "dequantize_nf4", refuse)
    monkeypatch.setattr(int_quant, "dequantize_int", refuse)
    names = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    assert len(names) == 7 * model.config.num_layers
    # The device comes from the codes: a base built on the meta device (an FSDP rank) gets adapters there.
    skeleton = load_hf(folder, sinks=nf4_sinks, dtype=torch.bfloat16, device="meta")
    apply_lora(skeleton, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
