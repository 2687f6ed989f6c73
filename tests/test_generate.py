"""Generation: KV-cached greedy decoding equals transformers' greedy generate; sampling obeys top-p."""

from __future__ import annotations

import pytest
import torch

from entrenar.errors import ConfigError
from entrenar.generation.sampling import generate, sample_next
from entrenar.models.hf import load_hf
from entrenar.models.transformer import KVCache


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_greedy_equals_transformers_generate(hf_folder, family):
    folder, ref = hf_folder(family)
    model = load_hf(folder)
    prompt = torch.randint(0, 128, (1, 10))
    expected = ref.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 10:]
    assert generate(model, prompt[0].tolist(), max_new_tokens=30) == expected.tolist()


def test_kv_cache_matches_full_recompute(hf_folder):
    folder, _ = hf_folder("mistral")  # sliding window 16: the cache path must apply it too
    model = load_hf(folder).eval()
    ids = torch.randint(0, 128, (1, 40))
    cache = KVCache(model.config.num_layers)
    with torch.no_grad():
        parts = [model(ids[:, :12], cache=cache), model(ids[:, 12:13], cache=cache), model(ids[:, 13:], cache=cache)]
        torch.testing.assert_close(torch.cat(parts, dim=1), model(ids), atol=1e-5, rtol=0)


def test_stop_token_ends_generation(hf_folder):
    folder, _ = hf_folder("llama")
    model = load_hf(folder)
    free = generate(model, [1, 2, 3], max_new_tokens=8)
    assert generate(model, [1, 2, 3], max_new_tokens=8, stop_ids=[free[2]]) == free[:2]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, 0.7, g) for _ in range(300)}
    assert picks == {0, 1}  # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it
    assert sample_next(logits, 0.0, 0.7) == 0


def test_bad_settings_are_rejected(hf_folder):
    folder, _ = hf_folder("llama")
    model = load_hf(folder)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, [1], top_p=0.0)
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate(model, [])
