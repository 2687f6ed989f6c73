"""Shared prompts: whether a pair's prompt is computed once for both completions (``task.share_prompt``).

A batch laid out for sharing carries the ``shared_*`` keys (:func:`entrenar.data.preference.shared_prompt_layout`)
beside its rows; whether it runs through them is decided here, for the plan (:func:`share_prompt_of`, the row
layout's reason) and per batch (:func:`shares_prompt`), from the recipe, the rows' layout and the model's width
and device.
"""

from __future__ import annotations

from typing import Any

from entrenar.config import Recipe
from entrenar.data.preference_static import is_static
from entrenar.models.transformer import compute_device
from entrenar.tasks.base import Batch

# Under ``task.share_prompt: auto`` a GPU shares prompts only for models at least this wide. One H200,
# 2026-11-26, bench/bench_dpo.py (256 + 256 tokens, two calls): on the Llama-3.1-8B shape (hidden 4096) sharing
# ran 11,825 tokens/s against 9,177 unshared; on the Llama-3.2-1B shape (hidden 2048) 46,630 / 45,095 against
# 54,722 / 57,761: a small model's eager step waits on the host's kernel launches, which the shared layout
# adds (the keys gathered again in every layer) while the GPU work it saves was not what bounded the step.
SHARE_PROMPT_MIN_HIDDEN = 4096


def share_prompt_of(recipe: Recipe, padding_free: bool, hidden_size: int | None = None,
                    device_type: str = "cpu") -> tuple[bool, str]:
    """``(shared, why)``: whether a pair's prompt is computed once for both completions (``task.share_prompt``),
    for rows laid out padding-free or not (``padding_free``: the plan's ``data.padding_free``), for a model of
    ``hidden_size`` (None: not known, taken as wide enough) on ``device_type``."""
    task = recipe.task
    if task.type != "preference" or task.loss == "kto":
        return False, "unpaired examples, no prompt to share (task.share_prompt)"
    if task.share_prompt is False:
        return False, "each pair as two sequences [prompt, chosen], [prompt, rejected] (task.share_prompt: false)"
    narrow = device_type == "cuda" and hidden_size is not None and hidden_size < SHARE_PROMPT_MIN_HIDDEN
    if task.share_prompt is True or padding_free and not narrow:
        return True, (f"each pair as one sequence [prompt, chosen, rejected], its prompt computed once "
                      f"(task.share_prompt: {'true' if task.share_prompt is True else 'auto'})")
    if padding_free:
        return False, (f"each pair as two sequences [prompt, chosen], [prompt, rejected]: hidden size {hidden_size} "
                       f"< {SHARE_PROMPT_MIN_HIDDEN} on a GPU, where the step waits on kernel launches more than "
                       f"on the work a shared prompt saves (task.share_prompt: auto)")
    return False, ("each pair as two sequences [prompt, chosen], [prompt, rejected]: the rows are not padding-free "
                   "(task.share_prompt: auto)")


def width_and_device(model: Any) -> tuple[int | None, str]:
    """A prepared model's hidden size and device type (what ``task.share_prompt: auto`` weighs); None: no model
    yet (taken as wide enough, on the CPU)."""
    if model is None:
        return None, "cpu"
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None), compute_device(model).type


def may_share(recipe: Recipe, model: Any) -> bool:
    """Whether batches carry the shared-prompt layout (``task.share_prompt`` may pick it for ``model``)."""
    return share_prompt_of(recipe, True, *width_and_device(model))[0]


def shares_prompt(recipe: Recipe, batch: Batch, model: Any) -> bool:
    """Whether ``batch`` runs with each prompt once: it carries the layout, and ``task.share_prompt`` is true or
    auto with the rows padding-free (``cu_seqlens`` without ``document_ids``), as the plan said."""
    if is_static(batch):  # decided when it was laid out (the task's graph_layout)
        return bool(batch["static_shared"])
    flat = "cu_seqlens" in batch and "document_ids" not in batch
    return "shared_input_ids" in batch and share_prompt_of(recipe, flat, *width_and_device(model))[0]


__all__ = ["SHARE_PROMPT_MIN_HIDDEN", "may_share", "share_prompt_of", "shares_prompt", "width_and_device"]
