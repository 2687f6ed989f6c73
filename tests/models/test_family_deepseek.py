"""DeepSeek-V3 (Kimi-K2 and Moonlight share it) against transformers: multi-head latent attention (with and
without the low-rank query), sigmoid routing with the correction bias over grouped top-k, routed scaling, shared
experts and dense first layers; saved back in the checkpoint's layout; the padding-free and cached paths."""

from __future__ import annotations

import pytest
import torch

from entrenar.models.hf import load_hf

DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, eos_token_id=2,
                pad_token_id=0)


def make_deepseek(seed: int = 0, **overrides):
    """A tiny transformers DeepseekV3ForCausalLM, norms and the correction bias perturbed so they matter."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**DEEPSEEK, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    return model


@pytest.fixture
def deepseek_folder(tmp_path):
    def build(**overrides):
        model = make_deepseek(**overrides)
        folder = tmp_path / f"deepseek{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(folder)
        return folder, model

    return build


VARIANTS = {
    "q_lora": {},
    "plain_q": dict(q_lora_rank=None),
    "no_interleave_bias": dict(rope_interleave=False, attention_bias=True, norm_topk_prob=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_of_padded_batches_match_transformers(deepseek_folder, variant):
    folder, ref = deepseek_folder(**VARIANTS[variant])
    model = load_hf(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 20))
    attention = torch.ones_like(ids)
    attention[1, 13:] = 0  # right padding
    with torch.no_grad():
        expected = ref(ids, attention_mask=attention).logits
        ours = model(ids)
    torch.testing.assert_close(ours[0], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours[1, :13], expected[1, :13], atol=1e-4, rtol=0)
