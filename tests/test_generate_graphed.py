"""The static-cache decode (entrenar.generation.graphed) on the CPU: the layout a CUDA graph replays, run eagerly.

The graph records :class:`StaticDecoder`'s step; here the same step runs without a graph, so its preallocated
cache, in-place column and position updates and masks over unwritten columns are checked against the growing
cache of the eager path and transformers' greedy ``generate``, for prompts of different lengths, LoRA unmerged,
stop tokens and seeded sampling. tests/test_generate_graphed_gpu.py replays the graph itself on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.errors import ConfigError
from entrenar.generation import batched
from entrenar.generation.batched import SamplingConfig, generate_batch
from entrenar.generation.graphed import StaticDecoder, cache_columns
from entrenar.loading import load
from entrenar.tasks.rl.logprobs import completion_logprobs

PROMPTS = [[5, 9, 17, 3], [7], [11, 12, 13, 14, 15, 16, 2]]
NEW = 6


@pytest.fixture
def static_cache(monkeypatch):
    """generate_batch decoding on the static cache, eagerly (the graph's layout without a graph)."""

    def static(model, prompt_ids, prompt_mask, cfg):
        return StaticDecoder(model, prompt_ids, prompt_mask, cfg.max_new_tokens, graph=False), "static"

    monkeypatch.setattr(batched, "_decoder", static)


def _lora_model(folder):
    model, _ = load(folder, dtype="float32", device="cpu")
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
    return nonzero_adapters(model, std=0.5)


def test_static_cache_greedy_matches_transformers_eager_and_full_forward(hf_folder, monkeypatch):
    folder, hf_model = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    cfg = SamplingConfig(max_new_tokens=NEW, temperature=0.0)
    eager = generate_batch(model, PROMPTS, cfg, num_generations=2)
    assert eager.decode == "eager (the model computes on cpu, not CUDA)"
    columns = []
    real = StaticDecoder.step

    def counted(self, token):
        columns.append(int(self.column))
        return real(self, token)

    monkeypatch.setattr(StaticDecoder, "step", counted)
    monkeypatch.setattr(batched, "_decoder", lambda m, i, k, c: (StaticDecoder(m, i, k, c.max_new_tokens, False), ""))
    static = generate_batch(model, PROMPTS, cfg, num_generations=2)
    width = max(len(p) for p in PROMPTS)
    assert columns == list(range(width, width + NEW - 1))  # each token written one column on
    assert torch.equal(static.completion_ids, eager.completion_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, rtol=1e-5, atol=1e-5)
    assert static.entropies is not None and eager.entropies is not None
    torch.testing.assert_close(static.entropies, eager.entropies, rtol=1e-5, atol=1e-5)
    for i, prompt in enumerate(PROMPTS):
        hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert static.completion_ids[2 * i].tolist() == hf[0, len(prompt):].tolist()
    ids = torch.cat([static.prompt_ids, static.completion_ids], 1)
    mask = torch.cat([static.prompt_mask, static.completion_mask], 1)
    with torch.no_grad():
        full = completion_logprobs(model, ids, mask, NEW)
    torch.testing.assert_close(static.logprobs, full, rtol=1e-5, atol=1e-5)


def test_static_cache_with_lora_stop_tokens_and_sampling(hf_folder, static_cache, monkeypatch):
    folder, _ = hf_folder("llama")
    model = _lora_model(folder)
    greedy = SamplingConfig(max_new_tokens=NEW, temperature=0.0)
    static_free = generate_batch(model, PROMPTS, greedy)
    stop = int(static_free.completion_ids[0, 2])
    sampled = SamplingConfig(max_new_tokens=NEW, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)
    static = [generate_batch(model, PROMPTS, greedy, stop_ids=[stop]),
              generate_batch(model, PROMPTS, sampled, num_generations=3, stop_ids=[stop],
                             generator=torch.Generator().manual_seed(7))]
    monkeypatch.undo()  # the eager path again
    eager = [generate_batch(model, PROMPTS, greedy, stop_ids=[stop]),
             generate_batch(model, PROMPTS, sampled, num_generations=3, stop_ids=[stop],
                            generator=torch.Generator().manual_seed(7))]
    assert bool(static[0].stopped[0]) and not bool(static[0].completion_mask.all())
    for s, e in zip(static, eager, strict=True):
        assert torch.equal(s.completion_ids, e.completion_ids) and torch.equal(s.completion_mask, e.completion_mask)
        assert torch.equal(s.stopped, e.stopped)
        torch.testing.assert_close(s.logprobs, e.logprobs, rtol=1e-5, atol=1e-5)
        ids = torch.cat([s.prompt_ids, s.completion_ids], 1)
        mask = torch.cat([s.prompt_mask, s.completion_mask], 1)
        with torch.no_grad():
            full = completion_logprobs(model, ids, mask, s.completion_ids.shape[1], temperature=1.0)
        if s is static[0]:  # greedy: temperature 1 is the sampling distribution's
            torch.testing.assert_close(s.logprobs, full * s.completion_mask, rtol=1e-5, atol=1e-5)


def test_static_cache_sliding_window(hf_folder, static_cache, monkeypatch):
    """Keys older than the window are masked by column, as the growing cache masks them."""
    folder, _ = hf_folder("mistral", sliding_window=3)
    model, _ = load(folder, dtype="float32", device="cpu")
    assert model.config.sliding_window == 3
    cfg = SamplingConfig(max_new_tokens=NEW, temperature=0.0)
    static = generate_batch(model, PROMPTS, cfg)
    monkeypatch.undo()
    eager = generate_batch(model, PROMPTS, cfg)
    assert torch.equal(static.completion_ids, eager.completion_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, rtol=1e-5, atol=1e-5)


def test_cache_columns_bucket_and_cuda_graphs_setting(hf_folder):
    assert cache_columns(7, 6) == 64 and cache_columns(60, 4) == 64 and cache_columns(60, 5) == 128
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    model.train()
    with pytest.raises(ConfigError, match="cuda_graphs: true.*computes on cpu"):
        generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=2, cuda_graphs=True))
    assert model.training  # put back as it was
    off = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=2, temperature=0.0, cuda_graphs=False))
    assert off.decode == "eager (cuda_graphs: false)"
    with pytest.raises(ConfigError, match="cuda_graphs must be"):
        SamplingConfig(cuda_graphs="yes")


def test_generate_cuda_graphs_setting_on_cpu(hf_folder):
    """generation.sampling.generate: the eager path on a CPU under auto; true refused naming the reason."""
    from entrenar.generation.sampling import generate

    folder, hf_model = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    prompt = PROMPTS[0]
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=NEW) == expected
    with pytest.raises(ConfigError, match="cuda_graphs is true.*computes on cpu"):
        generate(model, prompt, max_new_tokens=NEW, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs must be"):
        generate(model, prompt, cuda_graphs="on")
