"""Shared fixtures: tiny random Hugging Face models, built here (no hub access)."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models gain nothing from a second thread, and on a shared 2-core machine threads contend badly.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by subprocesses the tests start
# No test asks the Hugging Face Hub: a Hub id resolves from a cache the test writes (tests/io/test_hub.py), or not.
os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)

# family name -> (config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-scaled-tied-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            max_position_embeddings=512,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
            rope_theta=500000.0,
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model of the given family, in fp32 eval mode."""
    import transformers

    config_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    # Norm weights start at 1 and biases at 0; randomise them so parity tests can see a mix-up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def hf_folder(tmp_path):
    """Save a tiny transformers model of a family to a folder; returns (folder, hf_model)."""

    def build(family: str = "llama", **overrides):
        model = make_hf_model(family, **overrides)
        folder = tmp_path / family
        model.save_pretrained(folder)
        return folder, model

    return build


def tiny_llama():
    """A plain tiny transformers Llama (default init), for tests of module surgery and adapters."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=128)
    return transformers.LlamaForCausalLM(config)


def nonzero_adapters(model, std: float = 0.05, seed: int = 2):
    """Draw every LoRA B from N(0, std) (it starts at zero), so the adapters change the model's output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return model


def crash_after_step(monkeypatch, recipe, step: int) -> None:
    """Run ``recipe`` and stop it as if killed right after ``step`` is logged (checkpoints as they were)."""
    from entrenar.train import loop
    from entrenar.train.metrics import MetricsLogger

    real_log_step = MetricsLogger.log_step

    def crash(self, logged, *args, **kwargs):
        record = real_log_step(self, logged, *args, **kwargs)
        if logged == step:
            raise KeyboardInterrupt
        return record

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", crash)
        with pytest.raises(KeyboardInterrupt):
            loop.train(recipe, progress=False)


@pytest.fixture
def workspace(tmp_path):
    """A tiny native model folder with a character tokenizer, and prompt/completion data, for training runs."""
    return make_workspace(tmp_path)


def make_workspace(tmp_path):
    """What the ``workspace`` fixture builds, in any folder (module-scoped fixtures share one)."""
    import json

    from entrenar import quickstart
    from entrenar.models.config import ModelConfig
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    tokenizer = quickstart.build_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, model_type="llama")
    model = Transformer(config)
    model.reset_parameters()
    save_hf(model, tmp_path / "model")
    tokenizer.save(tmp_path / "model")
    with open(tmp_path / "train.jsonl", "w") as f:
        for a in range(40):
            f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "completion": str(a + a % 7)}) + "\n")
    return tmp_path


# MoE families: (config class name, model class name, extra config kwargs); small enough for CPU tests.
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False, num_hidden_layers=3,
                       mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                       num_hidden_layers=3, decoder_sparse_step=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                      clip_qkv=0.5, eos_token_id=2, pad_token_id=None)),
}
