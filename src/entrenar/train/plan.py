"""The run plan: every ``auto`` setting resolved with its reason, every refusal decided, the memory estimated, once.

    plan = plan_run(recipe, device, world, config)

:func:`plan_run` is pure: it reads the recipe, the device this process trains on, the processes of the job and
the model's config.json (no weights), and answers every question the rest of the run would otherwise ask
again: which parallel mode, which weights dtype, whether kernels, CUDA graphs, step overlap and the three
offloads are on, and what the run will hold in memory. ``--dry-run`` prints it (``RunPlan.reasons``);
:mod:`entrenar.train.prepare` and the Trainer only read it.

Refusals live in one table, :data:`REFUSALS`: a combination this version does not run, each with the message a
user sees; the last of them compares the memory estimate with what the device has free (``force`` goes on
anyway). Two facts are known only later and are resolved by pure methods of the plan when they are:
the layout of packed rows needs the examples' mean length (:meth:`RunPlan.rows`), and CUDA graphs need MoE
layers that replay (:meth:`RunPlan.graphs`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from entrenar.adapters.lora import family_targets
from entrenar.config import Recipe
from entrenar.config.recipe import GPU_ONLY
from entrenar.config.sections import MAX_SEQ_LEN
from entrenar.data.batching import CONTEXT_FACTOR, check_seq_len
from entrenar.device import available_memory, resolve_device, resolve_dtype
from entrenar.distributed.context_parallel import check_context_parallel
from entrenar.distributed.materialize import META
from entrenar.distributed.materialize import load_device as sharded_load_device
from entrenar.distributed.shard_read import shard_index
from entrenar.distributed.steps import accumulation as micro_batches_per_rank
from entrenar.distributed.world import BACKENDS, World
from entrenar.errors import ConfigError
from entrenar.kernels import triton_available
from entrenar.kernels.coverage import family_notes
from entrenar.kernels.fused_linear_ce import fused_loss_chunk
from entrenar.kernels.token_logprobs import TOKEN_LOGPROBS_CHUNK
from entrenar.loading import recipe_model_config
from entrenar.loading.runs import resolve_model_and_adapter
from entrenar.models import fa4, random_init
from entrenar.models.classifier import is_classifier_folder
from entrenar.models.config import ModelConfig
from entrenar.models.padding_free import rows_by_document
from entrenar.models.transformer import checkpointed_layer_indices, offloaded_layer_indices
from entrenar.quant.checkpoint import is_quantized_folder
from entrenar.tasks import TaskLayout, layout_of
from entrenar.train.memory import (
    CPU_ALLOCATOR_SLACK,
    PROJECTION_NAMES,
    TOKEN_LOGPROBS_BYTES,
    GiB,
    MemoryEstimate,
    estimate_training_memory,
    generation_memory,
    longest_fitting,
    per_device,
)
from entrenar.train.optim import use_fused

# Fraction of device memory a replica may take for `parallel: auto` to pick DDP (the rest: allocator slack).
AUTO_DDP_FRACTION = 0.85
# DDP with at most this many bytes of gradients reduces them as one flat buffer a step, after backward, outside the
# graph (entrenar.distributed.flat_grads), which keeps CUDA graphs and step overlap; above it torch's
# DistributedDataParallel, whose buckets overlap the all-reduce with backward. LoRA-8B's adapters hold ~170 MB of
# fp32 gradients (about 1-2 ms of an NVLink all-reduce after a step of ~1 s); a full 1B fine-tune ~5 GB, whose
# exposed all-reduce DDP's buckets hide. The line between is a chosen bound, not a measured crossover.
FLAT_GRADIENTS_MAX_BYTES = 512 * 2**20


@dataclass(frozen=True)
class RowLayout:
    """How packed causal-LM rows reach attention: one padding-free row of real tokens (``flat``), packed rows
    read document by document (``by_document``: the variable-length kernel), or padded rows under a mask."""

    flat: bool
    by_document: bool
    reason: str


@dataclass(frozen=True)
class RunPlan:
    """What a run does, decided before anything is loaded. ``reasons`` says why each ``auto`` became what it is."""

    device: torch.device  # this process's
    mode: str  # single, ddp or fsdp
    world_size: int
    accumulation: int  # micro-batches per process and optimizer step
    load_device: torch.device  # where the weights are read to (FSDP: rank 0's CPU, the meta device elsewhere)
    weights_dtype: str  # what the weights are loaded as ("auto": the device's choice)
    quantize: str | None  # lora.quantize_base
    compute_dtype: torch.dtype  # what the products run in
    kernels: bool
    lora_compute_dtype: torch.dtype | None  # training.adapter_math: bf16 adapter products in the fused layer
    offload_weights: bool
    offload_embeddings: bool
    cuda_graphs: bool  # if the MoE layers replay (:meth:`graphs`)
    overlap: bool
    compile: bool
    loss_scaling: bool  # fp16's GradScaler
    method: str  # full, lora, qlora, qat or lora-qat
    memory: MemoryEstimate
    # Bytes free on the device when planned (None: not known here); a reading of the machine, not a decision.
    memory_available: int | None = field(default=None, compare=False)
    notes: tuple[str, ...] = ()  # for the summary (seq_len beyond the model's context)
    reasons: tuple[tuple[str, str], ...] = ()
    flat_gradients: bool = False  # ddp: one flat all-reduce a step instead of DistributedDataParallel
    _recipe: Recipe | None = field(default=None, repr=False, compare=False)
    _config: ModelConfig | None = field(default=None, repr=False, compare=False)
    context_parallel: int = 1  # processes each row is split over (training.context_parallel)
    # fsdp: which safetensors file holds each parameter, when every rank reads its own shards (None: rank 0 reads
    # the whole model and broadcasts it)
    shard_files: dict[str, tuple[Path, str]] | None = field(default=None, repr=False, compare=False)
    # packed rows' variable-length attention kernel on CUDA (training.attention_kernel): fa2 or fa4
    attention_kernel: str = "fa2"

    @property
    def rows_per_step(self) -> int:
        """Rows of the global optimizer step, over every process (a context-parallel group reads one row)."""
        assert self._recipe is not None
        return self._recipe.training.batch_size * self.accumulation * self.world_size // self.context_parallel

    def rows(self, task: str, mean_example_tokens: float) -> RowLayout:
        """``data.padding_free`` resolved once the examples are read. Causal-LM rows attend document by
        document (the variable-length flash kernel on CUDA) instead of under a dense document mask, which keeps
        SDPA off flash and computes the blocks across documents; on a CPU only where the documents outweigh
        their calls (hidden size x mean example length, :func:`rows_by_document`). Padding-free rows: on a CPU
        where rows attend by document, since nothing there gains from fixed shapes; off on a GPU, whose graphs
        replay fixed rows, except for rows no graph replays as rows (``TaskLayout.no_cuda_graphs``, or
        ``own_graph_layout``: preference pairs, which graphs replay in their own fixed layout): a
        LoRA DPO step on the Llama-3.2-1B shape ran 57.7k tokens/s at 9.15 GiB padding-free against 30.2k at
        16.5 GiB under a document mask (one H200, 2026-11-26, bench/bench_dpo.py). ``task``: the task's name
        (``task.type``), whose :class:`~entrenar.tasks.layout.TaskLayout` says what its rows hold."""
        recipe, config = self._recipe, self._config
        assert recipe is not None and config is not None and config.head_dim is not None  # set by ModelConfig
        layout = layout_of(task)
        by_document = layout.documents and rows_by_document(
            config.qk_head_dim if config.is_mla else config.head_dim, self.device, self.compute_dtype,
            config.sliding_window, compiled=self.compile,
            document_work=config.hidden_size * mean_example_tokens)
        setting = recipe.data.padding_free
        flat = setting if isinstance(setting, bool) else by_document and (
            self.device.type == "cpu" or layout.no_cuda_graphs is not None or layout.own_graph_layout is not None)
        flat = flat or self.context_parallel > 1  # context parallelism splits padding-free rows (checked: not false)
        reason = "padding-free rows" if flat else ("packed rows, attention by document" if by_document
                                                   else "rows under a document mask")
        reason = f"{reason} (data.padding_free: {setting})"
        if layout.prompt_sharing is not None:
            reason += "; " + layout.prompt_sharing(recipe, flat, config.hidden_size, self.device.type)[1]
        return RowLayout(flat=flat, by_document=by_document and not flat, reason=reason)

    def steps(self, epoch_rows: int) -> tuple[int, str]:
        """``training.epochs`` resolved once the data is read: ``ceil(epochs x epoch_rows / rows_per_step)``
        optimizer steps (at least one), and the line that says so. An epoch is one pass over the training
        examples as the stream lays them out (``epoch_rows``: packed rows, or one example a row), by the whole
        job: every process together sees each example once."""
        assert self._recipe is not None and self._recipe.training.epochs is not None
        epochs = self._recipe.training.epochs
        steps = max(1, math.ceil(epochs * epoch_rows / self.rows_per_step))
        return steps, (f"epochs {epochs:g} = {steps:,} steps ({epoch_rows:,} rows an epoch, {self.rows_per_step:,} "
                       "rows a step)")

    def graphs(self, moe_replays: bool) -> bool:
        """``training.cuda_graphs`` once the MoE layers are built: a graph replays MoE layers only whose experts
        run as one grouped bf16 product (``moe_replays``: no host read in the step)."""
        assert self._recipe is not None
        if self._recipe.training.cuda_graphs is True and not moe_replays:
            raise ConfigError("training.cuda_graphs: a CUDA graph replays MoE layers whose experts run as one "
                              "grouped bf16 product (moe.experts: auto or grouped, bf16 compute); this run's loop "
                              "over experts reads their token counts back every layer")
        return self.cuda_graphs and moe_replays



@dataclass(frozen=True)
class _Facts:
    """What the refusals and decisions read besides the recipe."""

    recipe: Recipe
    device: torch.device
    world: World
    mode: str = "single"
    memory: MemoryEstimate | None = None  # the plan's estimate, once the decisions that change it are made
    available: tuple[int, str] | None = None  # bytes free on the device, and where the number comes from
    force: bool = False  # `entrenar train --force`: start even when the estimate is above what is free
    flat: bool = False  # ddp reduces one flat gradient buffer a step, outside any graph (FLAT_GRADIENTS_MAX_BYTES)

    @property
    def layout(self) -> TaskLayout:
        """What the recipe's task tells the plan about its batches."""
        return layout_of(self.recipe.task.type)

    @property
    def needed(self) -> float:
        """Bytes the run's processes on this device need: on a CPU, every local process's share of the host."""
        assert self.memory is not None
        sharing = int(os.environ.get("LOCAL_WORLD_SIZE", self.world.size)) if self.device.type == "cpu" else 1
        return self.memory.total * sharing


@dataclass(frozen=True)
class Refusal:
    """A combination this version does not run: ``applies`` to the facts, and the message a user sees."""

    key: str
    applies: Callable[[_Facts], bool]
    message: Callable[[_Facts], str]
    needs_mode: bool = False  # checked once the parallel mode is chosen
    needs_memory: bool = False  # checked last, on the plan's memory estimate


def _gpu_only(key: str) -> Refusal:
    """A GPU-only setting asked for on another device, in the recipe's words (:data:`GPU_ONLY`)."""
    return Refusal(f"training.{key}", lambda f: getattr(f.recipe.training, key) not in (False, 0, "auto")
                   and f.device.type != "cuda",
                   lambda f: f"training.{key}: {GPU_ONLY[key]}; this run is on {f.device}")


def _own_layout_refusal(layout: TaskLayout, recipe: Recipe) -> str | None:
    """Why graphs cannot replay a task's own fixed layout for this recipe (None: they can, or it has none)."""
    return layout.own_graph_layout(recipe) if layout.own_graph_layout is not None else None


# Checked in order; the first that applies is raised. Pure recipe checks come first, then the device's, then
# the parallel mode's (each needs the one before).
REFUSALS: tuple[Refusal, ...] = (
    Refusal("schedule.warmup_steps", lambda f: f.recipe.training.max_steps is not None  # epochs: once resolved
            and f.recipe.schedule.warmup_steps > f.recipe.training.max_steps,
            lambda f: f"schedule.warmup_steps ({f.recipe.schedule.warmup_steps}) is longer than the run "
                      f"(training.max_steps={f.recipe.training.max_steps}); shorten it too, e.g. --set "
                      f"schedule.warmup_steps={f.recipe.training.max_steps // 10}"),
    Refusal("training.early_stopping", lambda f: f.recipe.training.early_stopping is not None
            and not f.recipe.training.eval_every,
            lambda f: "training.early_stopping: needs evaluations during the run (training.eval_every > 0)"),
    Refusal("training.precision", lambda f: f.recipe.training.precision == "fp16" and f.device.type != "cuda",
            lambda f: "training.precision: fp16 needs a CUDA device (use bf16 or fp32 on the CPU)"),
    _gpu_only("cuda_graphs"),
    _gpu_only("offload_activations"),
    _gpu_only("offload_embeddings"),
    Refusal("task.decode_cuda_graphs", lambda f: f.recipe.task.decode_cuda_graphs is True
            and f.device.type != "cuda",
            lambda f: f"task.decode_cuda_graphs: the decode step replays from a CUDA graph on a CUDA device; this "
                      f"run is on {f.device} (leave it auto)"),
    Refusal("training.cuda_graphs",
            lambda f: f.layout.no_cuda_graphs is not None and f.recipe.training.cuda_graphs is True,
            lambda f: f"training.cuda_graphs: graphs replay causal-LM micro-batches of fixed rows; "
                      f"{f.layout.no_cuda_graphs} (turn cuda_graphs off or leave it auto)"),
    Refusal("training.cuda_graphs",
            lambda f: f.recipe.training.cuda_graphs is True and _own_layout_refusal(f.layout, f.recipe) is not None,
            lambda f: f"training.cuda_graphs: {_own_layout_refusal(f.layout, f.recipe)} (turn cuda_graphs off or "
                      "leave it auto)"),
    Refusal("training.cuda_graphs", lambda f: f.mode != "single" and not f.flat
            and f.recipe.training.cuda_graphs is True,
            lambda f: f"training.cuda_graphs: the gradient reduction of {f.mode} runs outside a captured graph; "
                      f"turn cuda_graphs off to train on {f.world.size} processes"
                      + (f" (ddp keeps graphs with at most {FLAT_GRADIENTS_MAX_BYTES // 2**20} MiB of gradients, "
                         "e.g. LoRA)" if f.mode == "ddp" else ""), needs_mode=True),
    Refusal("training.kernels", lambda f: f.mode == "fsdp" and f.recipe.training.kernels is True,
            lambda f: "training.kernels: the fused kernels read weights outside the module's forward, which "
                      "FSDP2 has not gathered; use training.kernels: false with parallel: fsdp", needs_mode=True),
    Refusal("training.offload_embeddings", lambda f: f.mode == "fsdp" and f.recipe.training.offload_embeddings
            is True, lambda f: "training.offload_embeddings: a host-memory table cannot be sharded; use "
                               "training.parallel: ddp", needs_mode=True),
    Refusal("training.offload_weights", lambda f: f.recipe.training.offload_weights is True
            and (f.device.type != "cuda" or f.mode != "single" or f.recipe.training.compile),
            lambda f: "training.offload_weights: the NF4 base weights stream to one CUDA device, block by block, "
                      f"outside torch.compile; this run is {f.mode} on {f.device}"
                      + (" with training.compile" if f.recipe.training.compile else ""), needs_mode=True),
    # Under a CUDA graph the tiles replay when they draw no random numbers: with LoRA dropout their rerun restores
    # the generator's state, which is read through the host (models/tiled.py).
    Refusal("training.tiled_mlp", lambda f: bool(f.recipe.training.tiled_mlp) and (
        f.recipe.training.compile or f.recipe.training.offload_weights is True
        or f.recipe.training.cuda_graphs is True and _lora_dropout(f.recipe) > 0),
            lambda f: "training.tiled_mlp: the tiles rerun in backward outside torch.compile, read the block's "
                      "weights where they are (not streamed), and under CUDA graphs only without LoRA dropout; "
                      "turn off " + ", ".join(k for k in ("compile", "cuda_graphs", "offload_weights")
                                              if getattr(f.recipe.training, k) is True)
                      + (f" (or set lora.dropout: 0, now {_lora_dropout(f.recipe)})"
                         if f.recipe.training.cuda_graphs is True and _lora_dropout(f.recipe) > 0 else "")),
    Refusal("memory", lambda f: not f.force and f.available is not None and f.needed > f.available[0],
            lambda f: _memory_refusal(f), needs_mode=True, needs_memory=True),
)


def _lora_dropout(recipe: Recipe) -> float:
    return recipe.lora.dropout if recipe.lora is not None else 0.0


def _memory_refusal(f: _Facts) -> str:
    """The estimate, what is free, and the settings of this run that would lower the estimate."""
    assert f.memory is not None and f.available is not None
    t, lora, e = f.recipe.training, f.recipe.lora, f.memory
    levers = []
    if t.batch_size > 1:
        levers.append(f"a smaller micro-batch (training.batch_size={max(1, t.batch_size // 2)}, with "
                      f"training.grad_accum to keep the batch)")
    if f.layout.rollout is not None:  # every sampled sequence of a micro-batch is held at once
        rollout = f.layout.rollout(f.recipe)
        levers.append(f"fewer completions of a prompt (task.num_generations, now {rollout.sequences}) or shorter "
                      f"ones (task.max_new_tokens, now {rollout.new_tokens})")
    levers.append(f"a shorter data.seq_len (now {f.recipe.data.seq_len})")
    if t.activation_checkpointing is not True and e.activations + e.logits > 0.1 * e.total:
        levers.append("training.activation_checkpointing: true")
    if f.device.type == "cuda" and not t.offload_activations:
        levers.append("training.offload_activations: true")
    if lora is None:
        levers.append("LoRA (a lora: section) instead of full fine-tuning")
    if lora is not None and not lora.quantize_base:
        levers.append("QLoRA (lora.quantize_base: nf4)")
    sharing = f.needed / e.total
    processes = f" for {sharing:.0f} processes on this host" if sharing > 1 else ""
    return (f"memory: the run needs about {f.needed / GiB:.2f} GiB{processes} (its memory estimate) and "
            f"{f.device} has {f.available[0] / GiB:.2f} GiB available ({f.available[1]}); lower it with "
            f"{'; '.join(levers)}; or pass --force (train(..., force=True)) to start anyway")


def _refuse(facts: _Facts, needs_mode: bool, needs_memory: bool = False) -> None:
    """Raise the first refusal of the table that applies (those that need the mode, or those that do not; those
    that need the memory estimate)."""
    for refusal in REFUSALS:
        if refusal.needs_mode == needs_mode and refusal.needs_memory == needs_memory and refusal.applies(facts):
            raise ConfigError(refusal.message(facts))


def check_recipe(recipe: Recipe, device: torch.device, world: World) -> None:
    """The refusals that need neither the model nor the parallel mode: checked before anything is written or
    loaded (and again by :func:`plan_run`, which makes every check)."""
    _refuse(_Facts(recipe, device, world), needs_mode=False)


def plan_for(recipe: Recipe, device: str | None = None, processes: int = 1, gpu_memory_gib: float = 80.0
             ) -> tuple[RunPlan, bool]:
    """The plan of ``recipe`` on ``device`` ("cpu", "cuda"; default the recipe's ``model.device`` here) with
    ``processes`` processes, reading config.json only: what ``entrenar inspect RECIPE`` prints. A CUDA device this
    machine lacks is planned as a ``gpu_memory_gib`` GPU with Triton; the second value says whether the device
    is here. A run that does not fit is planned all the same (its ``memory`` line says so)."""
    if recipe.model.path is None and recipe.model.init != "random":
        raise ConfigError("the bundled quickstart generates its model when it runs; `entrenar train --dry-run` "
                          "plans it")
    where = torch.device(device) if device else resolve_device(recipe.model.device)
    here = where.type != "cuda" or torch.cuda.is_available()
    backend = None if processes == 1 else BACKENDS.get(where.type, "gloo")
    memory = None if here else (int(gpu_memory_gib * 2**30), f"a {gpu_memory_gib:g} GiB GPU, as planned")
    plan = plan_run(recipe, where, World(size=processes, backend=backend), recipe_model_config(recipe),
                    device_memory=None if here else int(gpu_memory_gib * 2**30), triton=None if here else True,
                    available=memory, force=True)
    return plan, here


def plan_run(recipe: Recipe, device: torch.device, world: World, config: ModelConfig,
             device_memory: int | None = None, triton: bool | None = None,
             available: tuple[int, str] | None = None, force: bool = False) -> RunPlan:
    """Resolve ``recipe`` for this process (on ``device``, one of ``world``'s) and a model of ``config``.

    ``device_memory`` (bytes; default: the CUDA device's) is what ``parallel: auto`` compares a replica with;
    ``triton`` (default: whether Triton runs here) is what ``kernels: auto`` needs on CUDA. ``available`` (bytes,
    and where the number comes from; default: :func:`~entrenar.device.available_memory` of ``device``) is what
    the memory estimate must fit in, or the run is refused unless ``force``."""
    t, lora = recipe.training, recipe.lora
    triton = triton_available() if triton is None else triton
    check_recipe(recipe, device, world)
    for key, layers in (("activation_checkpointing", checkpointed_layer_indices),
                        ("offload_activations", offloaded_layer_indices)):
        try:
            layers(config.num_layers, getattr(t, key))
        except ValueError as e:
            raise ConfigError(f"training.{key}: {e}") from None
    notes = tuple(check_seq_len(recipe.data.seq_len, config.max_position_embeddings, recipe.model.path
                                or "model.config"))
    reasons: list[tuple[str, str]] = []

    method = "full" if lora is None else ("qlora" if lora.quantize_base else "lora")
    if recipe.qat is not None:
        method = "qat" if lora is None else "lora-qat"
    replica = _decide(recipe, device, "ddp" if world.distributed else "single", config, triton, method)
    mode = _choose_mode(t.parallel, world, device, replica.memory.total, device_memory)
    reasons.append(("training.parallel", _mode_reason(t.parallel, mode, world, replica.memory.total)))
    flat = mode == "ddp" and replica.flat_gradients  # replica: planned as ddp
    _refuse(_Facts(recipe, device, world, mode, flat=flat), needs_mode=True)
    cp = t.context_parallel
    if cp > 1:  # each row split over cp processes: world.size / cp data-parallel groups
        reasons.append(("training.context_parallel", check_context_parallel(
            cp, world, config, recipe.task.type, recipe.data.padding_free, moe=config.num_experts > 0,
            compile=t.compile, cuda_graphs=t.cuda_graphs is True)))
    accumulation = micro_batches_per_rank(t.batch_size, t.grad_accum, t.global_batch_size, world.size // cp)
    decided = replica if mode == replica.mode else _decide(recipe, device, mode, config, triton, method)
    if mode == "fsdp":  # each rank holds its shard of the weights, gradients and optimizer state
        decided = dataclasses.replace(decided, memory=per_device(
            decided.memory, config, world.size, "fsdp", dtype_bytes=2 if t.precision != "fp32" else 4,
            accumulation=accumulation))
    reasons += decided.reasons
    attention_kernel, why = _attention_kernel(recipe, device, config)
    reasons.append(("training.attention_kernel", why))
    available = available if available is not None else available_memory(device)
    facts = _Facts(recipe, device, world, mode, decided.memory, available, force, flat=flat)
    reasons.append(("memory", _memory_reason(facts)))
    _refuse(facts, needs_mode=True, needs_memory=True)

    load_device = sharded_load_device(world) if mode == "fsdp" else device
    shard_files = None
    if mode == "fsdp" and world.size > 1:
        shard_files, why = _shard_files(recipe, method, config)
        reasons.append(("fsdp loading", why))
        if shard_files is not None:
            load_device = META  # every rank: the structure only, then its shards from the files
    weights_dtype = recipe.model.dtype
    if weights_dtype == "auto" and lora is None:
        weights_dtype = "float32"  # full fine-tuning keeps fp32 master weights; compute follows training.precision
    if weights_dtype == "auto" and load_device != device:
        # What the run's device gives (bf16 on a GPU), not the CPU that reads for it: an fp32 frozen base would
        # hold twice the memory of a one-GPU run in every shard.
        weights_dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
    return RunPlan(
        device=device, mode=mode, world_size=world.size, accumulation=accumulation, load_device=load_device,
        weights_dtype=weights_dtype, quantize=lora.quantize_base if lora is not None else None,
        compute_dtype=decided.compute_dtype, kernels=decided.kernels,
        lora_compute_dtype=torch.bfloat16 if t.adapter_math == "bf16" else None,
        offload_weights=decided.offload_weights, offload_embeddings=decided.offload_embeddings,
        cuda_graphs=decided.cuda_graphs, overlap=decided.overlap, compile=t.compile,
        loss_scaling=t.precision == "fp16", method=method, memory=decided.memory,
        memory_available=available[0] if available else None, notes=notes,
        reasons=tuple(reasons), flat_gradients=flat, _recipe=recipe, _config=config, context_parallel=cp,
        shard_files=shard_files, attention_kernel=attention_kernel)


def _attention_kernel(recipe: Recipe, device: torch.device, config: ModelConfig) -> tuple[str, str]:
    """``training.attention_kernel`` resolved, and the dry run's line for it. ``auto`` takes FlashAttention-4 where
    it runs (the extra installed, a Hopper GPU): through ``entrenar train`` it ran LoRA-1B 1.04-1.05x FA2 with the
    same losses (H200, docs/PERFORMANCE.md), its kernels 1.23-1.55x FA2's on packed rows; FA2 elsewhere. ``fa4``
    is refused where it cannot run, except when planning for a CUDA device this machine lacks (``entrenar
    inspect``), which cannot be checked here."""
    setting = recipe.training.attention_kernel
    if setting == "fa2":
        return "fa2", "fa2 (as set)"
    unchecked = device.type == "cuda" and fa4.device_capability(device) is None
    why = "not checked: no CUDA device on this machine" if unchecked else fa4.fa4_unavailable(device)
    if setting == "auto" and why is not None:
        return "fa2", (f"fa2 (auto: FlashAttention-2's variable-length kernel; FlashAttention-4 runs where the extra "
                       f"is installed on a Hopper GPU ({fa4.INSTALL}): {why})")
    if unchecked:
        return "fa4", "fa4 (as set; not checked: no CUDA device on this machine)"
    if why is not None:
        raise ConfigError(f"training.attention_kernel: fa4: {why} (or set training.attention_kernel: fa2)")
    kept = [note for cond, note in (
        (config.attention_sinks, "attention sinks (FA2)"),
        (config.attn_logit_softcapping is not None, "soft-capped scores (per document)"),
        (config.qk_head_dim > 256, f"head size {config.qk_head_dim} (FA4 takes 8-256)"),
        (recipe.training.compile, "blocks under torch.compile (FA2)")) if cond]
    return "fa4", (f"fa4 ({'auto' if setting == 'auto' else 'as set'}): FlashAttention-4 for the variable-length "
                   "attention of packed and padding-free rows in bf16/fp16 on this Hopper GPU"
                   + (f"; not for {', '.join(kept)}" if kept else ""))


@dataclass(frozen=True)
class _Decided:
    """The decisions that depend on the parallel mode."""

    mode: str
    kernels: bool
    offload_weights: bool
    offload_embeddings: bool
    cuda_graphs: bool
    overlap: bool
    compute_dtype: torch.dtype
    memory: MemoryEstimate
    reasons: list[tuple[str, str]]
    flat_gradients: bool = False


def _offload_embeddings(recipe: Recipe, config: ModelConfig, layout: TaskLayout, one_gpu: bool,
                        streamed_base: bool) -> tuple[bool, str]:
    """``training.offload_embeddings`` decided, and its line. ``auto``: where the run trades speed for memory already
    (LoRA, every layer checkpointed, one GPU with Triton; the GPU reads a batch's rows over PCIe in well under a
    millisecond). A table tied to the output head too, eager or under CUDA graphs (its head copies it in for each
    loss, during the forward: 0.19 GiB less at the peak on the Llama-1B and Qwen3-1.7B shapes, 1.5-2% slower than
    those rows in earlier calls, docs/PERFORMANCE.md), but not compiled, nor beside a QLoRA base streamed from CPU
    memory (``streamed_base``: its blocks cross the same PCIe link the same way during the forward): neither
    measured. Never for a task that samples (the head is read at every token)."""
    t = recipe.training
    tied_unmeasured = config.tie_word_embeddings and (bool(t.compile) or streamed_base)
    offload = t.offload_embeddings if isinstance(t.offload_embeddings, bool) else (
        one_gpu and layout.auto_offload_embeddings and recipe.lora is not None and t.activation_checkpointing is True
        and not tied_unmeasured)
    tied_head = config.tie_word_embeddings and (layout.fused_head or layout.chunked_head)  # the task reads the head
    if offload and tied_head and layout.rollout is not None:
        raise ConfigError("training.offload_embeddings: this model's output head is its embedding table, which in CPU "
                          "memory is copied to the GPU at each use of the head, and sampling uses it at every token; "
                          "set training.offload_embeddings: false")
    return offload, (_auto(t.offload_embeddings, offload, "LoRA on one GPU with every layer checkpointed; a tied "
                                                          "table not under compile or a streamed QLoRA base")
                     + ("; tied to the output head, which copies the table to the GPU for each loss"
                        if offload and tied_head else ""))


def _decide(recipe: Recipe, device: torch.device, mode: str, config: ModelConfig, triton: bool,
            method: str) -> _Decided:
    t, lora = recipe.training, recipe.lora
    cuda, single, layout = device.type == "cuda", mode == "single", layout_of(recipe.task.type)
    reasons: list[tuple[str, str]] = []

    # auto on a CPU: the fused LoRA node and the chunked loss, in PyTorch (no full logits; docs/PERFORMANCE.md).
    kernels = t.kernels is True or (t.kernels == "auto" and mode != "fsdp" and (device.type == "cpu"
                                                                              or cuda and triton))
    if t.adapter_math == "bf16" and not kernels:
        raise ConfigError("training.adapter_math: bf16 adapter products run in the fused LoRA layer, and this run "
                          "has no kernels (training.kernels: true, or auto on a CPU or on a CUDA device with Triton)")
    reasons.append(("training.kernels", _auto(t.kernels, kernels, "a CPU (their PyTorch paths) or CUDA with "
                                                                  "Triton, without FSDP")
                    + "".join(f"; {note}" for note in (family_notes(config) if kernels else []))))

    # The NF4 base streams from pinned CPU memory a block ahead: QLoRA Llama-8B shape 12.06k against 12.16k
    # tokens/s at 3.27 against 6.41 GiB (H100, docs/PERFORMANCE.md). NF4 experts load outside the stream.
    offload_weights = t.offload_weights if isinstance(t.offload_weights, bool) else (
        cuda and single and lora is not None and lora.quantize_base == "nf4" and t.activation_checkpointing is True
        and not t.compile and not config.is_moe and not t.tiled_mlp)
    reasons.append(("training.offload_weights", _auto(t.offload_weights, offload_weights,
                                                      "QLoRA on one GPU with every layer checkpointed, MLP whole")))

    offload_embeddings, why = _offload_embeddings(recipe, config, layout, cuda and single and triton,
                                                   offload_weights)
    reasons.append(("training.offload_embeddings", why))

    memory = _estimate(recipe, config, device, method, kernels, offload_weights, offload_embeddings, mode)
    flat = mode == "ddp" and memory.gradients <= FLAT_GRADIENTS_MAX_BYTES
    if mode == "ddp":
        reasons.append(("ddp gradients", _flat_reason(flat, memory.gradients)))
    # Full fine-tuning measured no faster under graphs and 4 GiB heavier (docs/PERFORMANCE.md); QAT's step-size
    # initialisation reads the device once, which a graph cannot. Flat DDP gradients reduce outside the graph.
    # A task that lays its micro-batches out itself (preference pairs: entrenar.data.preference_static) replays
    # them whatever the rows are; other rows replay when packed into fixed rows.
    own = layout.own_graph_layout
    fixed_rows = layout.no_cuda_graphs is None and (own(recipe) is None if own is not None else
                                                    recipe.data.packing and recipe.data.padding_free is not True)
    # QLoRA of an MoE model replays too (NF4 experts grouped, gpt-oss's sinks through the varlen kernel): captured
    # on an H200, 2026-11-27, 4.7x its eager rate (docs/PERFORMANCE.md).
    cuda_graphs = t.cuda_graphs if isinstance(t.cuda_graphs, bool) else (
        cuda and (single or flat) and fixed_rows and lora is not None and recipe.qat is None and not t.compile
        and t.precision != "fp16" and not t.tiled_mlp and t.context_parallel == 1)  # split rows are padding-free
    reasons.append(("training.cuda_graphs", _auto(t.cuda_graphs, cuda_graphs,
                                                  "LoRA or QLoRA on packed rows or preference pairs on one GPU "
                                                  "or under ddp, eager, bf16/fp32, MLP whole")))
    if t.tiled_mlp:
        reasons.append(("training.tiled_mlp", f"{t.tiled_mlp:,} tokens a tile (as set): each MLP forward runs "
                                              "twice, its activations one tile's"))

    unsupported = _overlap_unsupported("single" if flat else mode, t.precision == "fp16",
                                       use_fused(recipe.optimizer.fused, device))
    if t.overlap_steps is True and unsupported is not None:
        raise ConfigError(f"training.overlap_steps: {unsupported}")
    overlap = unsupported is None and (t.overlap_steps is True or t.overlap_steps == "auto" and cuda)
    reasons.append(("training.overlap_steps", f"off ({unsupported})" if unsupported and t.overlap_steps == "auto"
                    else _auto(t.overlap_steps, overlap, "CUDA with a fused optimizer, one process or ddp")))

    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision) or \
        _weights_dtype(recipe, device, lora is None)
    if layout.reference is not None:  # the reference model, and what it costs
        reference, why = layout.reference(recipe)
        if reference == "copy" and mode == "fsdp":  # the copy is made before sharding: a whole model per rank
            raise ConfigError("task.reference: a frozen copy is not sharded under FSDP (each rank would hold the "
                              "whole model); use task.reference: precomputed, or LoRA (adapters_off)")
        reasons.append(("task.reference", f"{reference} ({why})"))
        if reference == "copy":
            memory = dataclasses.replace(memory, reference=memory.weights)
    if layout.decode_graphs:  # the task samples through the decode step
        reasons.append(("task.decode_cuda_graphs", _decode_graphs(recipe, device, mode, offload_weights,
                                                                  offload_embeddings)))
    return _Decided(mode, kernels, offload_weights, offload_embeddings, cuda_graphs, overlap, compute_dtype, memory,
                    reasons, flat)


def _decode_graphs(recipe: Recipe, device: torch.device, mode: str, offload_weights: bool,
                   offload_embeddings: bool) -> str:
    """The dry run's line for GRPO's sampler: whether its decode step replays from a CUDA graph
    (:func:`entrenar.generation.graphed.graph_refusal` decides again on the built model: MoE experts, hooks)."""
    setting = recipe.task.decode_cuda_graphs
    why = _decode_eager(recipe, device, mode, offload_weights, offload_embeddings)
    if setting is True and why is not None and device.type == "cuda":
        raise ConfigError(f"task.decode_cuda_graphs: true, but the decode step cannot replay from a CUDA graph: "
                          f"{why} (set it to auto or false)")
    on = setting is not False and why is None
    if setting == "auto" and why is not None:
        return f"off (auto: {why})" if device.type == "cuda" else "off (auto: on only on a CUDA device)"
    return _auto(setting, on, "a CUDA device; eager where the built model cannot replay (docs/RL.md)")


def _decode_eager(recipe: Recipe, device: torch.device, mode: str, offload_weights: bool,
                  offload_embeddings: bool) -> str | None:
    """Why the sampler's decode step cannot replay from a CUDA graph in this plan (None: it can)."""
    return ("a CUDA device" if device.type != "cuda" else
            "FSDP gathers the weights in forward hooks" if mode == "fsdp" else
            "the NF4 base streams from CPU memory (training.offload_weights)" if offload_weights else
            "the blocks run through torch.compile (training.compile)" if recipe.training.compile else
            "the input-embedding table stays in CPU memory (training.offload_embeddings)" if offload_embeddings
            else None)


def _flat_reason(flat: bool, gradient_bytes: float) -> str:
    """The dry run's line for how DDP reduces gradients, and why (FLAT_GRADIENTS_MAX_BYTES)."""
    size, bound = f"{gradient_bytes / 2**20:,.1f} MiB of gradients", f"{FLAT_GRADIENTS_MAX_BYTES // 2**20} MiB"
    if flat:
        return (f"one flat all-reduce a step after backward, outside any graph ({size} <= {bound}): CUDA graphs "
                "and step overlap stay available")
    return (f"torch DistributedDataParallel, buckets reduced during backward ({size} > {bound}: overlapping the "
            "all-reduce with backward pays more than graphs)")


def _overlap_unsupported(mode: str, scaled: bool, fused: bool) -> str | None:
    """Why this run cannot read a step's results while the next runs, or None when it can (``mode``: single
    for flat DDP gradients too, whose reduction is queued in order before the update). Both optimizers
    (AdamW, SGD) take a ``found_inf`` flag in their fused kernels (:mod:`entrenar.train.overlap`)."""
    if mode != "single":
        return "several processes reduce the loss and gradients across ranks before each update"
    if scaled:
        return "fp16's GradScaler decides its skips on the host"
    if not fused:
        return "only a fused optimizer drops a non-finite update on the device (optimizer.fused)"
    return None


def _weights_dtype(recipe: Recipe, device: torch.device, full: bool) -> torch.dtype:
    """The dtype the model's weights are held in on ``device``."""
    dtype = recipe.model.dtype
    return resolve_dtype("float32" if dtype == "auto" and full else dtype, device)


def _estimate(recipe: Recipe, config: ModelConfig, device: torch.device, method: str, kernels: bool,
              offload_weights: bool, offload_embeddings: bool, mode: str = "single") -> MemoryEstimate:
    """The training memory of one process (:mod:`entrenar.train.memory`) with this plan's settings."""
    t, lora = recipe.training, recipe.lora
    targets: str | list[str] = "all-linear"
    chosen = family_targets(lora.target_modules, config.fused_qkv) if lora is not None else "all-linear"
    if not isinstance(chosen, str):
        targets = sorted(set(chosen) & set(PROJECTION_NAMES))
    elif chosen != "all-linear":
        targets = [name for name in PROJECTION_NAMES if name in chosen]  # a regex: the names it spells
    layout = layout_of(recipe.task.type)
    plain = lora is None or "lm_head" not in lora.target_modules
    chunked = plain and (layout.chunked_head or layout.fused_head and kernels)
    rollout = layout.rollout(recipe) if layout.rollout is not None else None
    rows = t.batch_size * (rollout.sequences if rollout is not None else layout.sequences_per_example)
    tokens = -(-recipe.data.seq_len // t.context_parallel)  # context parallelism: each rank's slice of the row
    dtype_bytes = 2 if t.precision != "fp32" else 4
    param_bytes = _weights_dtype(recipe, device, lora is None).itemsize
    chunk = (TOKEN_LOGPROBS_CHUNK if layout.chunked_head else fused_loss_chunk(config.vocab_size)) if chunked else None
    cpu = device.type == "cpu"
    memory = estimate_training_memory(
        config, method, rows, tokens, dtype_bytes=dtype_bytes, param_bytes=param_bytes,
        lora_r=lora.r if lora else 16,
        lora_targets=targets, lora_target_parameters=list(lora.target_parameters or []) if lora else [],
        activation_checkpointing=t.activation_checkpointing, offload_activations=t.offload_activations,
        offload_embeddings=offload_embeddings, offload_weights=offload_weights, optimizer=recipe.optimizer.name,
        fused_loss_chunk=chunk, fused_loss_bytes=TOKEN_LOGPROBS_BYTES if chunked and layout.chunked_head else None,
        # On a CPU the kernels run their PyTorch specifications, which save what eager PyTorch saves.
        kernels=kernels and not cpu, cpu=cpu, lora_dropout=lora.dropout if lora else 0.0,
        tiled_mlp=t.tiled_mlp, **_qat_settings(recipe))
    if rollout is None:
        return memory
    # The rollout (sampling and the scoring passes) runs with autocast off, in the weights' dtype (an NF4 base
    # computes in the compute dtype); prompts are cut to what data.seq_len leaves the completion.
    new = min(rollout.new_tokens, recipe.data.seq_len - 1)
    sampling = generation_memory(
        config, rows, recipe.data.seq_len - new, new, dtype_bytes if method == "qlora" else param_bytes,
        filtered=rollout.filtered, static_cache=recipe.task.decode_cuda_graphs is not False
        and _decode_eager(recipe, device, mode, offload_weights, offload_embeddings) is None,
        scoring_passes=rollout.scoring_passes,
        head_chunk=TOKEN_LOGPROBS_CHUNK if plain else None)
    # On a CPU glibc keeps a share of the freed step memory as it does the training step's (CPU_ALLOCATOR_SLACK)
    return dataclasses.replace(memory, generation=sampling * (1 + CPU_ALLOCATOR_SLACK if cpu else 1))


def longest_context(plan: RunPlan, memory_bytes: float) -> int:
    """The longest sequence a step of one row (batch 1) of ``plan``'s recipe fits in ``memory_bytes``, by the same
    memory estimate as the plan's (:func:`entrenar.train.memory.longest_fitting`); at most what ``data.seq_len``
    may be for this model (8x its context)."""
    recipe, config = plan._recipe, plan._config
    assert recipe is not None and config is not None
    one_row = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, batch_size=1))

    def fits(seq_len: int) -> bool:
        row = dataclasses.replace(one_row, data=dataclasses.replace(one_row.data, seq_len=seq_len))
        return _estimate(row, config, plan.device, plan.method, plan.kernels, plan.offload_weights,
                         plan.offload_embeddings, plan.mode).total <= memory_bytes

    return longest_fitting(fits, min(MAX_SEQ_LEN, CONTEXT_FACTOR * config.max_position_embeddings), shortest=2)


def _qat_settings(recipe: Recipe) -> dict[str, Any]:
    """The estimate's QAT arguments from the recipe's ``qat`` section (none without one)."""
    qat = recipe.qat
    if qat is None:
        return {}
    return {"qat_group_size": qat.group_size if qat.granularity == "group" else None,
            "qat_activations": qat.activations is not False}


def _choose_mode(parallel: str, world: World, device: torch.device, replica_bytes: float,
                 device_memory: int | None) -> str:
    """``single`` for one process; otherwise ``training.parallel``, with ``auto`` meaning DDP when a replica
    (weights, gradients, optimizer state, activations) fits one device."""
    if not world.distributed:
        return "single"
    if parallel != "auto":
        return parallel
    if device.type != "cuda":
        return "ddp"  # CPU memory is the host's, shared by its ranks: sharding saves nothing per process
    capacity = device_memory if device_memory is not None else torch.cuda.get_device_properties(device).total_memory
    return "ddp" if replica_bytes <= AUTO_DDP_FRACTION * capacity else "fsdp"


def _memory_reason(f: _Facts) -> str:
    """The memory decision's line: the estimate against what the device has free."""
    if f.available is None:
        return f"not checked ({f.device} does not say how much memory is free)"
    needed, free = f.needed / GiB, f.available[0] / GiB
    if f.needed <= f.available[0]:
        return f"fits: {needed:.2f} GiB needed, {free:.2f} GiB available ({f.available[1]})"
    return (f"does not fit: {needed:.2f} GiB needed, {free:.2f} GiB available ({f.available[1]}); `entrenar train` "
            "refuses it unless --force")


def _shard_files(recipe: Recipe, method: str, config: ModelConfig) -> tuple[dict[str, tuple[Path, str]] | None, str]:
    """An FSDP run's loading: every rank reading its own shards from the Hugging Face folder (the parameters'
    files), where all the model starts from is that folder's tensors by name (a full fine-tune of a task whose
    TaskLayout declares ``model_from_folder``); else rank 0 reads and broadcasts."""
    general = "rank 0 reads the model and broadcasts it"
    if method != "full" or not layout_of(recipe.task.type).model_from_folder:
        return None, f"{general} (adapters, quantizers or a task's head are made on rank 0)"
    if recipe.model.path is None or random_init.is_random(recipe):
        return None, f"{general} (no model folder)"
    source = resolve_model_and_adapter(recipe.model.path)
    folder = source.model
    if source.adapter is not None or source.checkpoint is not None or not folder.is_dir() or \
            is_quantized_folder(folder) or is_classifier_folder(folder):
        return None, f"{general} ({folder} is not a plain Hugging Face folder)"
    if not any(folder.glob("*.safetensors")):  # a config read alone (`entrenar inspect`); loading says what is missing
        return None, f"{general} (no safetensors weights in {folder})"
    index, why = shard_index(folder, config)
    return index, why if index is not None else f"{general} ({why})"


def _mode_reason(parallel: str, mode: str, world: World, replica_bytes: float) -> str:
    if not world.distributed:
        return f"{mode} (one process)"
    if parallel != "auto":
        return f"{mode} (as set)"
    return f"{mode} (auto: a replica needs {replica_bytes / 2**30:.2f} GiB)"



def _auto(setting: Any, value: bool, rule: str) -> str:
    """A decision's line: what it became, and the rule when ``auto`` decided it."""
    if setting != "auto":
        return f"{'on' if value else 'off'} (as set)"
    return f"on (auto: {rule})" if value else f"off (auto: on only for {rule})"


__all__ = ["REFUSALS", "Refusal", "RowLayout", "RunPlan", "check_recipe", "longest_context", "plan_for", "plan_run"]
