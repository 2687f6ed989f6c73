"""Per-expert LoRA on stacked MoE experts against PEFT's target_parameters, both ways; merge; grouped path."""

from __future__ import annotations

import json

import pytest
import torch

from entrenar.adapters.experts import LoraExpertWeights
from entrenar.adapters.lora import (
    LoraConfig,
    apply_lora,
    load_adapter,
    lora_state_dict,
    save_adapter,
    unload_lora,
)
from entrenar.models.hf import load_hf
from entrenar.models.moe import set_experts_implementation

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def randomise_adapters(model, seed=3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)


def peft_model(ref):
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], target_parameters=TARGETS)
    return peft.get_peft_model(ref, config)


def test_peft_adapter_on_experts_loads_with_the_same_logits(hf_folder, tmp_path):
    folder, ref = hf_folder("qwen3_moe")
    wrapped = peft_model(ref)
    randomise_adapters(wrapped)
    wrapped.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = wrapped(ids).logits
    model = load_hf(folder).eval()
    load_adapter(model, tmp_path / "adapter")
    assert isinstance(model.model.layers[1].mlp.experts, LoraExpertWeights)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=0)


def test_our_expert_adapter_loads_in_peft_with_the_same_logits(hf_folder, tmp_path):
    import peft

    folder, ref = hf_folder("qwen3_moe")
    model = load_hf(folder).eval()
    cfg = LoraConfig(r=2, alpha=6, target_modules=["q_proj", "v_proj"], target_parameters=TARGETS)
    names = apply_lora(model, cfg)
    assert "model.layers.1.mlp.experts" in names
    randomise_adapters(model)
    save_adapter(model, tmp_path / "adapter", cfg)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_parameters"] == TARGETS
    assert "model.layers.1.mlp.experts.base_layer.lora_A.weight" in lora_state_dict(model)
    back = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), back(ids).logits, atol=1e-5, rtol=0)


def test_merge_grouped_and_gradients(hf_folder):
    folder, _ = hf_folder("qwen3_moe")
    model = load_hf(folder)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj"], target_parameters=TARGETS))
    randomise_adapters(model)
    ids = torch.randint(0, 128, (2, 12))
    outputs, grads = [], []
    for impl in ("loop", "grouped"):
        set_experts_implementation(model, impl)
        model.zero_grad()
        out = model(ids)
        out.float().logsumexp(-1).mean().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)
    assert any("experts.base_layer.lora_B" in n for n in grads[0])
    assert not any(p.requires_grad for n, p in model.named_parameters() if "gate_up_proj" in n and "lora" not in n)
    # Merged into the stacked weights, the plain model computes the same.
    set_experts_implementation(model, "loop")
    with torch.no_grad():
        unload_lora(model, merge=True)
        torch.testing.assert_close(model(ids), outputs[0], atol=1e-5, rtol=0)
    assert type(model.model.layers[1].mlp.experts).__name__ == "Experts"


def test_unknown_expert_parameter_is_refused(hf_folder):
    from entrenar.errors import AdapterError

    folder, _ = hf_folder("llama")
    with pytest.raises(AdapterError, match="matches no expert parameter"):
        apply_lora(load_hf(folder), LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.up"]))


def test_export_merged_folder_equals_peft_with_the_adapter(tmp_path):
    import peft
    import transformers

    from conftest import make_hf_model
    from entrenar import quickstart
    from entrenar.export import export

    tokenizer = quickstart.build_tokenizer()
    make_hf_model("qwen3_moe", vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path / "base")
    tokenizer.save(tmp_path / "base")
    model = load_hf(tmp_path / "base")
    cfg = LoraConfig(r=2, alpha=4, target_modules=["q_proj"], target_parameters=TARGETS)
    apply_lora(model, cfg)
    randomise_adapters(model)
    save_adapter(model, tmp_path / "adapter", cfg)
    export(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with_adapter = peft.PeftModel.from_pretrained(make_hf_model("qwen3_moe", vocab_size=tokenizer.vocab_size),
                                                  tmp_path / "adapter").eval()
    ids = torch.randint(0, tokenizer.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("direction", ["peft_to_ours", "ours_to_peft"])
def test_router_adapter_matches_peft_both_ways(hf_folder, tmp_path, direction):
    import peft

    folder, ref = hf_folder("mixtral")
    targets = ["mlp.gate.weight", *TARGETS]
    ids = torch.randint(0, 128, (2, 12))
    model = load_hf(folder).eval()
    if direction == "peft_to_ours":
        wrapped = peft.get_peft_model(ref, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                           target_parameters=targets))
        randomise_adapters(wrapped, seed=5)
        wrapped.save_pretrained(tmp_path / "adapter")
        load_adapter(model, tmp_path / "adapter")
        other = wrapped.eval()
    else:
        cfg = LoraConfig(r=2, alpha=4, target_modules=["q_proj"], target_parameters=targets)
        apply_lora(model, cfg)
        randomise_adapters(model, seed=5)
        save_adapter(model, tmp_path / "adapter", cfg)
        other = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    assert "model.layers.0.mlp.gate.lora_B.weight" in lora_state_dict(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), other(ids).logits, atol=1e-5, rtol=0)
