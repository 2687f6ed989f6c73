"""GRPO's rollout and update on entrenar's own model: generate, score, advantages, then the loss, in one process.

:class:`GRPO` holds the policy (LoRA applied unmerged, or a full model), the reward functions and the settings;
``rollout`` samples ``num_generations`` completions of each prompt with the KV cache
(:mod:`entrenar.generation.batched`), scores them, takes group-relative advantages and, when needed, the sampling
policy's (``num_iterations > 1``) and the reference's (``beta > 0``: the same model with its adapters off, no second
copy) per-token log-probabilities; ``loss`` is the differentiable objective of a rollout, called once per
optimisation step (``num_iterations`` steps reuse one rollout, with the clipped ratio against the sampling policy).
The sampler's RNG is ``state_dict``'s, so a resumed run generates the same completions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from entrenar.adapters.layer import lora_layers
from entrenar.adapters.switch import adapters_off
from entrenar.errors import ConfigError
from entrenar.generation.batched import Generated, SamplingConfig, generate_batch
from entrenar.models.transformer import Transformer
from entrenar.tasks.rl.logprobs import completion_logprobs, plain_head
from entrenar.tasks.rl.objective import LossParts, Objective, group_advantages, grpo_loss
from entrenar.tasks.rl.rewards import Reward, score


@dataclass(frozen=True)
class GRPOSettings:
    """A GRPO run's settings (TRL's names): completions per prompt, optimisation steps per rollout, sampling and the
    objective."""

    num_generations: int = 8
    num_iterations: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    objective: Objective = field(default_factory=Objective)
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(f"task.num_generations must be >= 2 (advantages compare completions of a prompt), "
                              f"got {self.num_generations}")
        if self.num_iterations < 1:
            raise ConfigError(f"task.num_iterations must be >= 1, got {self.num_iterations}")


@dataclass
class Rollout:
    """One generation batch, scored: what every optimisation step on it reads."""

    generated: Generated
    prompts: list[str]
    completions: list[str]
    rewards: torch.Tensor  # [N] weighted total
    per_function: torch.Tensor  # [N, F]
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.generated.prompt_ids, self.generated.completion_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.generated.prompt_mask, self.generated.completion_mask], 1)


class GRPO:
    """Rollouts and the GRPO loss of ``model`` under ``rewards`` (see the module's docstring)."""

    def __init__(self, model: Transformer, rewards: Sequence[Reward], settings: GRPOSettings,
                 decode: Callable[[list[int]], str], seed: int = 0) -> None:
        if not rewards:
            raise ConfigError("reward.functions: at least one reward function is needed")
        if settings.objective.beta > 0 and next(lora_layers(model), None) is None:
            raise ConfigError("task.beta > 0 needs a reference: train with LoRA (the reference is the model with its "
                              "adapters off), or set task.beta: 0")
        self.model, self.rewards, self.settings, self.decode = model, list(rewards), settings, decode
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def _temperature(self) -> float:
        t = self.settings.sampling.temperature
        return t if t > 0 else 1.0

    def _logps(self, input_ids: torch.Tensor, mask: torch.Tensor, length: int) -> torch.Tensor:
        return completion_logprobs(self.model, input_ids, mask, length, plain_head(self.model),
                                   temperature=self._temperature)

    def rollout(self, prompt_ids: Sequence[Sequence[int]], columns: dict[str, list[Any]] | None = None) -> Rollout:
        """Sample, score and take advantages of the completions of ``prompt_ids``; ``columns``: the dataset's other
        fields, one value per prompt (handed to the reward functions once per completion)."""
        g = self.settings.num_generations
        out = generate_batch(self.model, prompt_ids, self.settings.sampling, g, self.settings.stop_ids,
                             self.generator)
        completions = [self.decode(row[: int(m.sum())].tolist())
                       for row, m in zip(out.completion_ids, out.completion_mask, strict=True)]
        prompts = [self.decode(list(p)) for p in prompt_ids for _ in range(g)]
        repeated = {k: [v for v in values for _ in range(g)] for k, values in (columns or {}).items()}
        total, per = score(self.rewards, prompts, completions, repeated)
        device = out.completion_ids.device
        advantages = group_advantages(total, g, self.settings.objective.scale_rewards).to(device)
        rollout = Rollout(out, prompts, completions, total, per, advantages, None, None)
        length = out.completion_ids.shape[1]
        with torch.no_grad():
            if self.settings.num_iterations > 1:
                rollout.old_logps = self._logps(rollout.input_ids, rollout.attention_mask, length)
            if self.settings.objective.beta > 0:
                with adapters_off(self.model):
                    rollout.ref_logps = self._logps(rollout.input_ids, rollout.attention_mask, length)
        return rollout

    def loss(self, rollout: Rollout) -> LossParts:
        """The objective of ``rollout`` under the current weights (differentiable)."""
        length = rollout.generated.completion_ids.shape[1]
        logps = self._logps(rollout.input_ids, rollout.attention_mask, length)
        return grpo_loss(logps, rollout.advantages, rollout.generated.completion_mask, self.settings.objective,
                         old_logps=rollout.old_logps, ref_logps=rollout.ref_logps)

    def metrics(self, rollout: Rollout, parts: LossParts | None = None) -> dict[str, float]:
        """A step's metrics: reward mean/std per function and in total, completion lengths, the sampling
        distribution's mean entropy per completion token, KL and clipping."""
        out: dict[str, float] = {"reward": float(rollout.rewards.mean()), "reward_std": float(rollout.rewards.std())}
        for j, reward in enumerate(self.rewards):
            out[f"rewards/{reward.name}/mean"] = float(rollout.per_function[:, j].mean())
            out[f"rewards/{reward.name}/std"] = float(rollout.per_function[:, j].std())
        lengths = rollout.generated.completion_mask.sum(1).float()
        out.update({"completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float((~rollout.generated.stopped).float().mean())})
        if rollout.generated.entropies is not None:  # TRL's: the masked mean over the completion tokens
            mask = rollout.generated.completion_mask.float()
            out["entropy"] = float((rollout.generated.entropies * mask).sum() / mask.sum().clamp(min=1.0))
        if parts is not None:
            out.update({"kl": parts.kl, "clip_ratio/low_mean": parts.clip_low, "clip_ratio/high_mean": parts.clip_high,
                        "clip_ratio/region_mean": parts.clip_region})
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sampler's RNG (kept in checkpoints: a resumed run generates the same completions)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def write_samples(path: Path, step: int, rollout: Rollout, limit: int = 16) -> None:
    """Append up to ``limit`` sample completions of a rollout with their rewards to a JSONL table (one object a
    line: step, prompt, completion, reward, advantage, each function's reward)."""
    with path.open("a", encoding="utf-8") as f:
        for i in range(min(limit, len(rollout.completions))):
            f.write(json.dumps({"step": step, "prompt": rollout.prompts[i], "completion": rollout.completions[i],
                                "reward": float(rollout.rewards[i]), "advantage": float(rollout.advantages[i]),
                                "rewards": rollout.per_function[i].tolist()}) + "\n")


__all__ = ["GRPO", "GRPOSettings", "Rollout", "write_samples"]
