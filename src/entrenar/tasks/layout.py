"""What a task tells the run plan about its batches, so the plan decides without asking which task it runs.

Each task class declares its :class:`TaskLayout` (``layout``, a class attribute) and
:func:`entrenar.tasks.layout_of` finds it from ``task.type``. The plan (:mod:`entrenar.train.plan`) reads these
facts where it used to test task names: how many sequences the memory estimate counts for an example, whether
packed rows may attend document by document or lie padding-free, whether the loss can read the output head
chunk by chunk, whether a CUDA graph can replay a micro-batch, what the reference model is, what the task
samples before its loss (:class:`Rollout`: GRPO's completions) and whether its decode step may replay from a CUDA
graph, and whether FSDP ranks may read the model's shards from its folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from entrenar.config import Recipe


@dataclass(frozen=True)
class Rollout:
    """What a task samples before its loss, per example of a micro-batch, as the memory estimate counts it."""

    sequences: int  # completions sampled of each example, all in one batch with a KV cache; the loss reads them all
    new_tokens: int  # the most tokens each completion grows by (its prompt: the rest of data.seq_len)
    filtered: bool = False  # top-k, top-p or min-p filters (their sort, indices and masks over the vocabulary)
    scoring_passes: int = 0  # no-grad forwards over every sequence before the loss (reference, sampling policy)


@dataclass(frozen=True)
class TaskLayout:
    """A task's batches as the plan sees them; the defaults are a task that none of the plan's levers reach."""

    # Sequences the model runs for one example of a micro-batch (a preference pair: two; KTO: the example and its
    # mismatched KL sequence): the memory estimate's rows per example.
    sequences_per_example: int = 1
    # Rows packed from whole documents, which may attend document by document (the variable-length kernel) or be
    # laid out padding-free (data.padding_free: auto considers it; other rows stay padded).
    documents: bool = False
    # The loss reads the output head's products chunk by chunk (no [tokens, vocab] logits) when the kernels are
    # on and LoRA leaves the head plain: the memory estimate's fused loss.
    fused_head: bool = False
    # Why a captured CUDA graph cannot replay this task's micro-batches (training.cuda_graphs: true is refused with
    # it, auto stays off, and auto rows may be padding-free on a GPU); None: graphs replay them.
    no_cuda_graphs: str | None = None
    # training.offload_embeddings: auto may keep the frozen input table in host memory (measured on causal-LM
    # LoRA steps only, docs/PERFORMANCE.md).
    auto_offload_embeddings: bool = False
    # ``(reference, why)``: what task.reference becomes for a recipe (a frozen "copy" costs the weights again);
    # None: the task has no reference model.
    reference: Callable[[Recipe], tuple[str, str]] | None = None
    # ``(shared, why)`` for (recipe, padding_free, hidden_size, device_type): whether a pair's prompt is computed
    # once for both completions; the reason is added to the row layout's line. None: no prompts to share.
    prompt_sharing: Callable[[Recipe, bool, int | None, str], tuple[bool, str]] | None = None
    # The task lays each micro-batch out itself in one fixed layout under CUDA graphs (its ``fixed_layout``, a
    # tasks.base.FixedLayout the Trainer calls instead of laying out rows), so graphs replay it whatever
    # data.packing and data.padding_free say; called with the recipe, why they cannot for it (None: they can).
    # None: rows as rows (and the task's fixed_layout is None).
    own_graph_layout: Callable[[Recipe], str | None] | None = None
    # What the task samples of each example before its loss (a :class:`Rollout`) for a recipe: the estimate counts
    # ``sequences`` rows an example (instead of ``sequences_per_example``) and the sampling phase's peak (its KV
    # cache, the decode step's logits and sampling buffers, the no-grad scoring passes). None: it samples nothing.
    rollout: Callable[[Recipe], Rollout] | None = None
    # The loss reads a plain output head chunk by chunk whatever the kernels (not only with them, as fused_head).
    chunked_head: bool = False
    # The task samples through entrenar.generation's decode step, which task.decode_cuda_graphs may replay from a
    # CUDA graph on a static KV cache: the plan decides whether it does (and the dry run says why).
    decode_graphs: bool = False
    # All the model the task starts from is the model folder's tensors by name (no head or other module made on
    # rank 0): the ranks of a full FSDP fine-tune may each read their own shards straight from the safetensors files.
    model_from_folder: bool = False


__all__ = ["Rollout", "TaskLayout"]
