"""Text generation: greedy at temperature 0, otherwise temperature and nucleus (top-p) sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from entrenar.errors import ConfigError
from entrenar.models.transformer import KVCache, Transformer, compute_device


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None = None) -> int:
    """Pick the next token id from one row of logits [vocab]."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Iterable[int] = (),
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Continue `prompt_ids`; returns only the new tokens (a stop token ends generation and is not returned)."""
    if not prompt_ids:
        raise ConfigError("generate: the prompt is empty")
    if max_new_tokens < 0:
        raise ConfigError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"generate: temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"generate: top_p must be in (0, 1], got {top_p}")
    device = compute_device(model)
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    stop = set(stop_ids)
    was_training = model.training
    model.eval()
    cache = KVCache(model.config.num_layers)
    new: list[int] = []
    step_input = torch.tensor([prompt_ids], device=device)
    try:
        for _ in range(max_new_tokens):
            logits = model(step_input, cache=cache)[0, -1]
            token = sample_next(logits.cpu(), temperature, top_p, generator)
            if token in stop:
                break
            new.append(token)
            if on_token is not None:
                on_token(token)
            step_input = torch.tensor([[token]], device=device)
    finally:
        model.train(was_training)
    return new
