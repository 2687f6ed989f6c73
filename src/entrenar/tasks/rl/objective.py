"""The GRPO objective and its variants as pure functions of per-token log-probabilities, with TRL 1.16's semantics.

* :func:`group_advantages`: each completion's reward minus its group's mean (the ``num_generations`` completions of
  one prompt), divided by the group's (``scale_rewards="group"``) or the batch's (``"batch"``) unbiased std + 1e-4,
  or not divided (``"none"``, Dr. GRPO) — TRL's ``sum_then_normalize``.
* :func:`grpo_loss`: the clipped importance ratio ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token
  (``importance_sampling_level="token"``) or per sequence (GSPO: ``"sequence"``, the ratio of the mean token
  log-ratio), plus ``beta`` times the k3 estimate of KL to the reference, ``exp(ref - logp) - (ref - logp) - 1``,
  then normalised by ``loss_type``: ``"grpo"`` the mean over sequences of each sequence's token mean, ``"bnpo"``
  the token mean of the batch, ``"dapo"`` the token sum over the tokens of the whole generation batch
  (``num_items``), ``"dr_grpo"`` the token sum over ``sequences x max_completion_length``.

Shapes: ``[B, T]`` per-token tensors over the completion positions, ``mask`` 1 on real completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from entrenar.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass(frozen=True)
class Objective:
    """The settings of :func:`grpo_loss` (TRL's GRPOConfig names and defaults; ``epsilon_high`` None = epsilon)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int = 256
    scale_rewards: str = "group"

    def __post_init__(self) -> None:
        for key, value, allowed in (("loss_type", self.loss_type, LOSS_TYPES),
                                    ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                    ("importance_sampling_level", self.importance_sampling_level,
                                     IMPORTANCE_LEVELS)):
            if value not in allowed:
                raise ConfigError(f"task.{key}: {value!r} is not one of {', '.join(allowed)}")
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError("task.beta, task.epsilon and task.epsilon_high must be >= 0")
        if self.max_completion_length <= 0:
            raise ConfigError(f"task.max_completion_length must be > 0, got {self.max_completion_length}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages [N] of rewards [N] laid out prompt-major (``num_generations`` consecutive completions a prompt)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"scale_rewards: {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    if num_generations <= 0 or rewards.ndim != 1 or rewards.numel() % num_generations:
        raise ConfigError(f"group_advantages: {rewards.numel()} rewards do not split into groups of "
                          f"{num_generations}")
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "group":
        std = grouped.std(dim=1).repeat_interleave(num_generations) if num_generations > 1 else torch.zeros_like(
            rewards)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        return advantages
    return advantages / (std + STD_EPS)


@dataclass
class LossParts:
    """The loss and what a step logs of it (detached, means over real completion tokens)."""

    loss: torch.Tensor
    kl: float
    clip_low: float
    clip_high: float
    clip_region: float


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, objective: Objective,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              num_items: float | torch.Tensor | None = None) -> LossParts:
    """The GRPO-family loss of per-token log-probabilities ``logps`` [B, T] (differentiable) of sampled completions.

    ``old_logps``: the sampling policy's (None: ``logps`` detached — one optimisation step per generation batch);
    ``ref_logps``: the reference's, needed when ``beta > 0``; ``num_items``: real completion tokens of the whole
    generation batch for ``"dapo"`` (None: this batch's).
    """
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)
    adv = adv.unsqueeze(1) if adv.ndim == 1 else adv
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if objective.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - objective.epsilon_low, 1 + objective.upper)
    per_token = -torch.min(ratio * adv, clipped * adv)
    per_token_kl = None
    if objective.beta != 0.0:
        if ref_logps is None:
            raise ConfigError("grpo_loss: beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + objective.beta * per_token_kl
    per_token = per_token * mask  # a sequence-level [B, 1] loss spreads over the tokens
    if objective.loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif objective.loss_type == "bnpo":
        loss = per_token.sum() / mask.sum().clamp(min=1.0)
    elif objective.loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.shape[0] * objective.max_completion_length)
    else:  # dapo
        items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = per_token.sum() / items.clamp(min=1.0)

    with torch.no_grad():
        def masked_mean(x: torch.Tensor) -> float:
            if x.shape[1] == 1:
                return float(x.float().mean())
            return float((x.float() * mask).sum() / mask.sum().clamp(min=1.0))

        low = (ratio < 1 - objective.epsilon_low) & (adv < 0)
        high = (ratio > 1 + objective.upper) & (adv > 0)
        kl = 0.0 if per_token_kl is None else masked_mean(per_token_kl)
        return LossParts(loss, kl, masked_mean(low), masked_mean(high), masked_mean(low | high))


__all__ = ["IMPORTANCE_LEVELS", "LOSS_TYPES", "SCALE_REWARDS", "LossParts", "Objective", "group_advantages",
           "grpo_loss"]
