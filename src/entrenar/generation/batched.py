"""Batched sampling with a KV cache: many prompts (and many completions per prompt) advance one token per forward.

Prompts are left-padded to a common length; each row's positions count its real tokens only and padding is masked
out of attention (every query also sees itself, so a padding row never attends to nothing), so a row's completion
does not depend on its neighbours. LoRA and other wrapped layers run as they are (unmerged), since the model's own
layers are called. Sampling: temperature (0 = greedy), then top-k, top-p (nucleus) and min-p filters; a stop token
ends its row and is kept as the completion's last token (it was sampled: RL scores it, as TRL does).

On a CUDA model the decode step replays from a CUDA graph on a static cache (:mod:`entrenar.generation.graphed`,
``SamplingConfig.cuda_graphs``); elsewhere, and where a graph cannot replay, it runs eagerly on a growing cache.
Sampling runs outside the graph either way, so a seed draws the same tokens from the same logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from entrenar.errors import ConfigError
from entrenar.generation.graphed import StaticDecoder, step_logits, uses_graphs
from entrenar.models.transformer import KVCache, Transformer, compute_device


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn (``temperature`` 0: greedy; filters off at top_k 0, top_p 1, min_p 0), and
    whether the decode step replays from a CUDA graph (``cuda_graphs``: auto, where the model allows; True: refuse
    a model that does not; False: eager)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    cuda_graphs: str | bool = "auto"

    def __post_init__(self) -> None:
        if self.cuda_graphs not in ("auto", True, False):
            raise ConfigError(f"cuda_graphs must be auto, true or false, got {self.cuda_graphs!r}")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")


@dataclass
class Generated:
    """A generation batch: ``[B, P]`` left-padded prompts, ``[B, T]`` right-padded completions (0 as padding), and
    each sampled token's log-probability under the temperature-scaled, unfiltered distribution (0 on padding)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    stopped: torch.Tensor  # [B] bool: ended by a stop token (else it hit max_new_tokens)
    entropies: torch.Tensor | None = None  # [B, T] entropy (nats) of that distribution at each token (0 on padding)
    decode: str = "eager"  # how the decode step ran: "cuda graph", or "eager (why)"


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with the tokens top-k, top-p and min-p exclude set to -inf."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= cfg.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    if cfg.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < cfg.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def _forward(model: Transformer, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
             cache: KVCache) -> torch.Tensor:
    """Logits [B, V] of each row's last position; ``key_valid`` [B, past + t] marks real tokens."""
    past, t = cache.length, ids.shape[1]
    q_pos = torch.arange(past, past + t, device=ids.device)[:, None]
    k_pos = torch.arange(past + t, device=ids.device)[None, :]

    def mask(window: int | None) -> torch.Tensor:
        allowed = (k_pos <= q_pos)[None] & key_valid[:, None, :]
        if window is not None:
            allowed = allowed & (q_pos - k_pos < window)[None]
        return (allowed | (k_pos == q_pos)[None])[:, None]

    return step_logits(model, ids, positions, mask, cache)


class _EagerDecoder:
    """Prefill and decode on a cache that grows by a column a step (the CPU's path, and the fallback)."""

    def __init__(self, model: Transformer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self.model, self.prompt_ids = model, prompt_ids
        self.cache = KVCache(model.config.num_layers)
        self.key_valid = prompt_mask.bool()
        self.positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = self.positions[:, -1:] + 1

    def prefill(self) -> torch.Tensor:
        return _forward(self.model, self.prompt_ids, self.positions, self.key_valid, self.cache)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        b = token.shape[0]
        self.key_valid = torch.cat([self.key_valid, torch.ones(b, 1, dtype=torch.bool, device=token.device)], 1)
        logits = _forward(self.model, token[:, None], self.next_position, self.key_valid, self.cache)
        self.next_position = self.next_position + 1
        return logits


def _decoder(model: Transformer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             cfg: SamplingConfig) -> tuple[_EagerDecoder | StaticDecoder, str]:
    """The decoder ``cfg.cuda_graphs`` and the model allow, and how it runs (``Generated.decode``)."""
    graphed, how = uses_graphs(cfg.cuda_graphs, model)
    if cfg.cuda_graphs is True and not graphed:
        raise ConfigError(f"cuda_graphs: true, but the decode step cannot replay from a CUDA graph: "
                          f"{how.removeprefix('eager (').removesuffix(')')} (set cuda_graphs: auto or false)")
    if graphed:
        return StaticDecoder(model, prompt_ids, prompt_mask, cfg.max_new_tokens, graph=True,
                             strict=cfg.cuda_graphs is True), how
    return _EagerDecoder(model, prompt_ids, prompt_mask), how


@torch.no_grad()
def generate_batch(model: Transformer, prompts: Sequence[Sequence[int]], cfg: SamplingConfig,
                   num_generations: int = 1, stop_ids: Iterable[int] = (),
                   generator: torch.Generator | None = None) -> Generated:
    """Sample ``num_generations`` completions of each prompt (prompt-major rows) with a KV cache."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate_batch: every prompt needs at least one token")
    if num_generations <= 0:
        raise ConfigError(f"num_generations must be > 0, got {num_generations}")
    device = compute_device(model)
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    width = max(len(p) for p in rows)
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    b, n = len(rows), cfg.max_new_tokens
    tokens = torch.zeros(b, n, dtype=torch.long, device=device)
    logprobs = torch.zeros(b, n, dtype=torch.float32, device=device)
    entropies = torch.zeros(b, n, dtype=torch.float32, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    done_at = torch.full((b,), n, dtype=torch.long, device=device)
    stopped = torch.zeros(b, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        decoder, how = _decoder(model, prompt_ids, prompt_mask, cfg)
        logits = decoder.prefill()
        for i in range(n):
            logits = logits.float()
            scaled = logits / (cfg.temperature if cfg.temperature > 0 else 1.0)
            if cfg.temperature == 0:
                token = logits.argmax(-1)
            else:
                probs = filter_logits(logits, cfg).softmax(-1)
                on = probs if generator is None else probs.to(generator.device)
                token = torch.multinomial(on, 1, generator=generator).squeeze(-1).to(device)
            token = torch.where(alive, token, 0)
            tokens[:, i] = token
            log_p = torch.log_softmax(scaled, -1)
            logprobs[:, i] = log_p.gather(-1, token[:, None]).squeeze(-1) * alive
            entropies[:, i] = -(log_p.exp() * log_p).sum(-1) * alive
            ended = alive & torch.isin(token, stop)
            done_at = torch.where(ended, i + 1, done_at)
            alive, stopped = alive & ~ended, stopped | ended
            if i == n - 1 or not bool(alive.any()):
                break
            logits = decoder.step(token)
    finally:
        model.train(was_training)
    how = decoder.how if isinstance(decoder, StaticDecoder) else how  # a capture that failed went on eagerly
    length = int(done_at.max())
    completion_mask = (torch.arange(length, device=device)[None] < done_at[:, None]).long()
    return Generated(prompt_ids, prompt_mask, tokens[:, :length] * completion_mask, completion_mask,
                     logprobs[:, :length] * completion_mask, stopped, entropies[:, :length] * completion_mask, how)


__all__ = ["Generated", "SamplingConfig", "filter_logits", "generate_batch"]
