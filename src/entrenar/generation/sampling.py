"""Text generation: greedy at temperature 0, otherwise temperature and nucleus (top-p) sampling.

On a CUDA model the decode step replays from a CUDA graph on a static cache (:mod:`entrenar.generation.graphed`)
where the model allows (``cuda_graphs``); sampling runs on the host either way, so a seed draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from entrenar.errors import ConfigError
from entrenar.generation.graphed import StaticDecoder, uses_graphs
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
    cuda_graphs: str | bool = "auto",
) -> list[int]:
    """Continue `prompt_ids`; returns only the new tokens (a stop token ends generation and is not returned).
    ``cuda_graphs``: auto (the decode step replayed from a CUDA graph where the model allows), True (refuse a
    model that does not), False (eager)."""
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
    if cuda_graphs not in ("auto", True, False):
        raise ConfigError(f"generate: cuda_graphs must be auto, true or false, got {cuda_graphs!r}")
    graphed = False
    if isinstance(model, Transformer) and max_new_tokens > 1:
        graphed, how = uses_graphs(cuda_graphs, model)
        if cuda_graphs is True and not graphed:
            raise ConfigError(f"generate: cuda_graphs is true, but the decode step cannot replay from a CUDA graph: "
                              f"{how.removeprefix('eager (').removesuffix(')')}")
    stop = set(stop_ids)
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        decoder = None
        if graphed:
            ids = torch.tensor([prompt_ids], device=device)
            decoder = StaticDecoder(model, ids, torch.ones_like(ids), max_new_tokens, graph=True,
                                    strict=cuda_graphs is True)
        cache = KVCache(model.config.num_layers)

        def next_logits(token: int | None) -> torch.Tensor:
            """The logits after the prompt (``token`` None) or after feeding ``token``."""
            if decoder is not None:
                return (decoder.prefill() if token is None else decoder.step(torch.tensor([token], device=device)))[0]
            return model(torch.tensor([prompt_ids if token is None else [token]], device=device), cache=cache)[0, -1]

        token: int | None = None
        for _ in range(max_new_tokens):
            token = sample_next(next_logits(token).cpu(), temperature, top_p, generator)
            if token in stop:
                break
            new.append(token)
            if on_token is not None:
                on_token(token)
    finally:
        model.train(was_training)
    return new
