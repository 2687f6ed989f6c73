"""The GRPO objective against TRL 1.16's GRPOTrainer, on a tiny random Llama saved by transformers.

TRL's side is its own loss code — ``GRPOTrainer._compute_loss`` and ``_get_per_token_logps_and_entropies`` (its
fused LM head on the transformers model) — called on a stand-in ``self`` with the attributes it reads, fed
precomputed tensors: fixed prompts and completions (no generation), advantages, the sampling policy's and the
reference's log-probabilities (perturbed so ratios clip and KL is non-zero), at a sampling temperature
(TRL divides the logits by it). entrenar's side is
:func:`entrenar.tasks.rl.logprobs.completion_logprobs` on its own model loaded from the same folder and
:func:`entrenar.tasks.rl.objective.grpo_loss`. Loss and the gradient of every weight agree within fp32 tolerance.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from types import MethodType, SimpleNamespace

import pytest
import torch

from entrenar.loading import load
from entrenar.tasks.rl.logprobs import completion_logprobs, plain_head
from entrenar.tasks.rl.objective import Objective, group_advantages, grpo_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

B, G, P, T, MAX_LEN, TEMPERATURE = 6, 3, 5, 7, 10, 0.7


def _stand_in(model, objective: Objective) -> SimpleNamespace:
    accelerator = SimpleNamespace(autocast=nullcontext, num_processes=1, reduce=lambda t, reduction: t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t, device=torch.device("cpu"),
                                  is_main_process=True)
    me = SimpleNamespace(
        accelerator=accelerator, model=model, loss_type=objective.loss_type, beta=objective.beta,
        epsilon_low=objective.epsilon_low, epsilon_high=objective.upper,
        importance_sampling_level=objective.importance_sampling_level,
        max_completion_length=objective.max_completion_length, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, current_gradient_accumulation_steps=1,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    me._get_per_token_logps_and_entropies = MethodType(
        trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies, me)
    return me


@pytest.fixture
def setup(hf_folder):
    folder, hf_model = hf_folder("llama")
    trl_utils.add_fused_lm_head(hf_model, temperature=TEMPERATURE, cast_lm_head_to_fp32=False,
                                outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    model, _ = load(folder, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 128, (B // G, P), generator=g).repeat_interleave(G, 0)
    completion = torch.randint(3, 128, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, 0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0])
    with torch.no_grad():
        ids = torch.cat([prompt, completion], 1)
        mask = torch.cat([torch.ones_like(prompt), completion_mask], 1)
        now = completion_logprobs(model, ids, mask, T, temperature=TEMPERATURE)
    old = (now + 0.3 * torch.randn(now.shape, generator=g)) * completion_mask
    ref = (now + 0.3 * torch.randn(now.shape, generator=g)) * completion_mask
    return SimpleNamespace(hf=hf_model.train(), model=model.train(), prompt=prompt, completion=completion,
                           completion_mask=completion_mask, rewards=rewards, old=old, ref=ref)


def test_group_advantages_match_trl_formula():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0])
    grouped = rewards.view(-1, G)
    mean = grouped.mean(1).repeat_interleave(G)
    std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(G)
    torch.testing.assert_close(group_advantages(rewards, G, "group"), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, G, "batch"),
                               (rewards - mean) / (trl_utils.nanstd(rewards) + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, G, "none"), rewards - mean)


@pytest.mark.parametrize(("loss_type", "level", "beta", "scale"), [
    ("grpo", "token", 0.05, "group"),
    ("bnpo", "token", 0.0, "batch"),
    ("dapo", "token", 0.1, "group"),
    ("dr_grpo", "token", 0.05, "none"),
    ("grpo", "sequence", 0.05, "group"),  # GSPO
    ("dapo", "sequence", 0.0, "group"),
])
def test_loss_and_gradients_match_trl(setup, loss_type, level, beta, scale):
    s = setup
    objective = Objective(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                          importance_sampling_level=level, max_completion_length=MAX_LEN, scale_rewards=scale)
    advantages = group_advantages(s.rewards, G, scale)
    inputs = {"prompt_ids": s.prompt, "prompt_mask": torch.ones_like(s.prompt), "completion_ids": s.completion,
              "completion_mask": s.completion_mask, "advantages": advantages, "old_per_token_logps": s.old,
              "ref_per_token_logps": s.ref, "num_items_in_batch": s.completion_mask.sum().float()}
    trl_loss = trl_grpo.GRPOTrainer._compute_loss(_stand_in(s.hf, objective), s.hf, inputs)
    trl_loss.backward()

    ids = torch.cat([s.prompt, s.completion], 1)
    mask = torch.cat([torch.ones_like(s.prompt), s.completion_mask], 1)
    logps = completion_logprobs(s.model, ids, mask, T, plain_head(s.model), temperature=TEMPERATURE)
    parts = grpo_loss(logps, advantages, s.completion_mask, objective, old_logps=s.old, ref_logps=s.ref)
    parts.loss.backward()

    torch.testing.assert_close(parts.loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert parts.clip_region > 0  # the perturbed old log-probabilities make some ratios clip
    hf_grads = {n: p.grad for n, p in s.hf.named_parameters()}
    for name, p in s.model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, hf_grads[name], rtol=1e-4, atol=1e-6, msg=name)
