"""GRPO rollouts and updates on a tiny random Llama: the reward rises, resume repeats completions, bad set-ups fail.

The reward is a toy verifiable one (the share of completion tokens below 64, scored on the decoded text through
the reward-function contract), so a random policy starts near 0.5 with spread inside each group.
"""

from __future__ import annotations

import json

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.errors import ConfigError
from entrenar.generation.batched import SamplingConfig
from entrenar.loading import load
from entrenar.tasks.rl.objective import Objective
from entrenar.tasks.rl.rewards import Reward
from entrenar.tasks.rl.task import GRPO, GRPOSettings, write_samples

PROMPTS = [[5, 9, 17], [7, 3], [11, 12, 13, 14], [100, 90]]


def low_tokens(prompts, completions, **_):
    return [sum(int(t) < 64 for t in c.split()) / max(len(c.split()), 1) for c in completions]


def _decode(ids):
    return " ".join(map(str, ids))


def _grpo(folder, beta: float, iterations: int, seed: int = 0) -> GRPO:
    model, _ = load(folder, dtype="float32", device="cpu")
    # lm_head too: the tiny random model's logits barely move through the layers alone
    targets = ("q_proj", "v_proj", "gate_proj", "down_proj", "lm_head")
    apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=targets))
    for p in lora_parameters(model):
        p.requires_grad_(True)
    settings = GRPOSettings(num_generations=4, num_iterations=iterations,
                            sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
                            objective=Objective(loss_type="dapo", beta=beta, max_completion_length=6))
    return GRPO(model, [Reward("low", low_tokens)], settings, _decode, seed=seed)


@pytest.mark.parametrize(("beta", "iterations"), [(0.0, 1), (0.04, 2)])
def test_reward_rises(hf_folder, tmp_path, beta, iterations):
    folder, _ = hf_folder("llama")
    grpo = _grpo(folder, beta, iterations)
    optimizer = torch.optim.Adam(lora_parameters(grpo.model), lr=5e-2)
    history = []
    for step in range(12):
        rollout = grpo.rollout(PROMPTS)
        for _ in range(iterations):
            optimizer.zero_grad()
            parts = grpo.loss(rollout)
            parts.loss.backward()
            optimizer.step()
        metrics = grpo.metrics(rollout, parts)
        history.append(metrics["reward"])
        write_samples(tmp_path / "samples.jsonl", step, rollout, limit=2)
    assert sum(history[-3:]) / 3 > sum(history[:3]) / 3 + 0.15, history
    assert set(metrics) >= {"reward", "reward_std", "rewards/low/mean", "kl", "clip_ratio/region_mean",
                            "completions/mean_length", "completions/clipped_ratio"}
    assert (metrics["kl"] > 0) == (beta > 0)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 24 and json.loads(lines[-1])["step"] == 11


def test_resumed_sampler_generates_the_same(hf_folder):
    folder, _ = hf_folder("llama")
    grpo = _grpo(folder, 0.0, 1, seed=5)
    grpo.rollout(PROMPTS)
    state = {k: v.clone() for k, v in grpo.state_dict().items()}
    expected = grpo.rollout(PROMPTS).generated.completion_ids
    resumed = _grpo(folder, 0.0, 1, seed=99)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.rollout(PROMPTS).generated.completion_ids, expected)


def test_bad_setups(hf_folder):
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        GRPOSettings(num_generations=1)
    with pytest.raises(ConfigError, match="beta > 0 needs a reference"):
        GRPO(model, [Reward("low", low_tokens)], GRPOSettings(objective=Objective(beta=0.1)), _decode)
    with pytest.raises(ConfigError, match="loss_type"):
        Objective(loss_type="ppo")
