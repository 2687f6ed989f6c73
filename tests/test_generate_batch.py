"""Batched KV-cache generation (entrenar.generation.batched) against full-sequence forwards and transformers.

Greedy: each row's tokens equal transformers' greedy ``generate`` on that prompt alone (no padding), and the
returned log-probabilities equal the full-sequence forward's (``completion_logprobs`` over the padded batch), for
prompts of different lengths in one left-padded batch, with and without LoRA (applied unmerged).
"""

from __future__ import annotations

import pytest
import torch

from conftest import nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.errors import ConfigError
from entrenar.generation.batched import SamplingConfig, filter_logits, generate_batch
from entrenar.loading import load
from entrenar.tasks.rl.logprobs import completion_logprobs

PROMPTS = [[5, 9, 17, 3], [7], [11, 12, 13, 14, 15, 16, 2]]
NEW = 6


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_matches_transformers_and_full_forward(hf_folder, lora):
    folder, hf_model = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    if lora:
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
        nonzero_adapters(model, std=0.5)
    out = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=0.0), num_generations=2)
    assert out.completion_ids.shape == (6, NEW) and bool(out.completion_mask.all())
    assert torch.equal(out.completion_ids[0::2], out.completion_ids[1::2])  # greedy: both generations agree
    if not lora:
        for i, prompt in enumerate(PROMPTS):
            hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
            assert out.completion_ids[2 * i].tolist() == hf[0, len(prompt):].tolist()
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        full = completion_logprobs(model, ids, mask, NEW)
        logits = model(ids[:1, -NEW - 1 - 3:-1])  # row 0 has no padding: its own argmax tokens
    torch.testing.assert_close(out.logprobs, full, rtol=1e-5, atol=1e-5)
    assert logits[0, -NEW:].argmax(-1).tolist() == out.completion_ids[0].tolist()


def test_stop_token_ends_its_row_and_is_kept(hf_folder):
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    free = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=0.0))
    stop_token = int(free.completion_ids[0, 2])
    out = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=0.0), stop_ids=[stop_token])
    first = free.completion_ids[0].tolist().index(stop_token)
    assert out.completion_ids[0, :first + 1].tolist() == free.completion_ids[0, :first + 1].tolist()
    assert int(out.completion_mask[0].sum()) == first + 1 and bool(out.stopped[0])
    for row in range(1, 3):  # other rows run on unless they sample the stop token too
        ids = free.completion_ids[row].tolist()
        keep = ids.index(stop_token) + 1 if stop_token in ids else NEW
        assert out.completion_ids[row, :keep].tolist() == ids[:keep]


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(logits, SamplingConfig(temperature=1.0, top_k=2))[0, 2:]).all()
    kept = ~torch.isinf(filter_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7)))
    assert kept.tolist() == [[True, True, False, False]]  # p = .64, .24, ...: two reach 0.7
    kept = ~torch.isinf(filter_logits(logits, SamplingConfig(temperature=1.0, min_p=0.3)))
    assert kept.tolist() == [[True, True, False, False]]  # e^-1 = .37 >= .3, e^-2 < .3
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_seeded_sampling_repeats(hf_folder):
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    cfg = SamplingConfig(max_new_tokens=NEW, temperature=1.0, top_k=50)

    def run():
        return generate_batch(model, PROMPTS, cfg, num_generations=3,
                              generator=torch.Generator().manual_seed(4)).completion_ids

    first = run()
    assert torch.equal(first, run())
    assert not torch.equal(first[0::3], first[1::3])  # generations of one prompt differ


def test_entropies_match_trl_on_transformers_logits(hf_folder):
    """Each sampled token's entropy is TRL's ``entropy_from_logits`` of transformers' full-sequence logits divided
    by the temperature, at that completion position (0 past a row's stop token), and GRPO's ``entropy`` metric is
    TRL's masked mean of them."""
    from trl.trainer.utils import entropy_from_logits

    from entrenar.tasks.rl.rewards import Reward
    from entrenar.tasks.rl.task import GRPO, GRPOSettings, Rollout

    folder, hf_model = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    temperature = 0.7
    free = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=temperature),
                          num_generations=2, generator=torch.Generator().manual_seed(1))
    stop_token = int(free.completion_ids[1, 2])  # some rows stop early: the mask matters
    out = generate_batch(model, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=temperature),
                         num_generations=2, stop_ids=[stop_token], generator=torch.Generator().manual_seed(1))
    assert out.entropies is not None and not bool(out.completion_mask.all())
    expected = torch.zeros_like(out.entropies)
    for row in range(out.completion_ids.shape[0]):
        real = out.prompt_ids[row][out.prompt_mask[row].bool()]
        ids = torch.cat([real, out.completion_ids[row]])[None]
        with torch.no_grad():
            logits = hf_model(ids).logits[0, len(real) - 1:-1] / temperature
        expected[row] = entropy_from_logits(logits) * out.completion_mask[row]
    torch.testing.assert_close(out.entropies, expected, rtol=1e-4, atol=1e-5)
    mask = out.completion_mask.float()
    rollout = Rollout(out, [""] * 6, [""] * 6, torch.zeros(6), torch.zeros(6, 1), torch.zeros(6), None, None)
    grpo = GRPO(model, [Reward("zero", lambda **_: [0.0] * 6)], GRPOSettings(num_generations=2), str)
    trl_mean = float((expected * mask).sum() / mask.sum())  # TRL's masked_batch_mean
    assert abs(grpo.metrics(rollout)["entropy"] - trl_mean) < 1e-4
