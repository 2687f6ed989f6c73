"""The training loop, top to bottom: recipe in, trained adapter or model out.

    result = train(load_recipe("recipes/lora-llama.yaml"))

Each step: schedule the learning rate, run `grad_accum` micro-batches whose
token-summed losses are divided by the target tokens of the whole step,
clip the global gradient norm, step the optimizer, log one metrics line, and
now and then evaluate and checkpoint. A checkpoint holds the trainable
weights, optimizer, RNG and data-stream position, so `resume` continues with
exactly the losses an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import entrenar
from entrenar import quickstart, tasks
from entrenar.config import Recipe, load_recipe, recipe_changes, save_recipe
from entrenar.data import (
    BatchStream,
    check_seq_len,
    eval_batches,
    packed_documents,
    padding_free,
    read_records,
    segment_capacity,
    split_validation,
    tokenize_records,
)
from entrenar.data.report import data_notes, skipped_in_order, write_skipped
from entrenar.distributed import steps as dist_steps
from entrenar.train.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from entrenar.distributed.consistency import check_replicas
from entrenar.distributed.materialize import load_device as sharded_load_device
from entrenar.distributed.parallelize import choose_mode, parallelize, refuse
from entrenar.distributed.state import full_optimizer, full_params, main_writes
from entrenar.distributed.world import join, leave, restarted
from entrenar.errors import AdapterError, CheckpointError, ConfigError, DataError
from entrenar.evaluation.loss import EvalResult, autocast_for, eval_loss
from entrenar.models import random_init as scratch
from entrenar.train.arch import write_arch
from entrenar.export import save_merged
from entrenar.kernels import apply_kernels, triton_available
from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy
from entrenar.kernels.host_embedding import HostEmbedding, offload_embeddings
from entrenar.adapters.lora import apply_lora, lora_config_of, load_lora_state_dict, lora_layers, lora_state_dict, save_adapter
from entrenar.train.memory import FUSED_LOSS_CHUNK, LINEAR_NAMES, GiB, estimate_training_memory
from entrenar.models.padding_free import rows_by_document
from entrenar.quant.nf4.streaming import nf4_in_host_memory, stream_weights
from entrenar.quant.checkpoint import save_qat_model
from entrenar.quant.nf4.format import NF4Linear
from entrenar.quant.qat import apply_qat_recipe, load_qat_state_dict, master_weights, qat_state_dict
from entrenar.train.checkpoint import is_sharded, latest_checkpoint, load_checkpoint, save_checkpoint
from entrenar.train.console import Console
from entrenar.train.cuda_graph import GraphedMicroStep
from entrenar.train.determinism import deterministic_algorithms
from entrenar.train.early_stopping import EarlyStopping
from entrenar.train.faults import NonfiniteGuard, optimizer_step
from entrenar.models.loss import token_cross_entropy
from entrenar.train.metrics import MetricsLogger, plot_loss_curve, tensorboard_writer_class
from entrenar.train.moe import moe_training, plot_expert_load
from entrenar.train.optim import build_optimizer, build_param_groups, lr_at, set_lr
from entrenar.train.overlap import DeferredRead, overlap_unsupported, step_unless_nonfinite
from entrenar.loading import recipe_model_config, require_tokenizer
from entrenar.device import resolve_device, resolve_dtype

RECIPE_FILE = "recipe.yaml"
# Keys a resumed run may change: how long it runs, how often it reports, when it stops on faults or early.
RESUMABLE_CHANGES = ("training.max_steps", "training.eval_every", "training.log_every", "training.save_every",
                     "training.keep_last", "training.eval_batches", "training.cpu_threads", "training.kernels",
                     "training.compile", "training.nonfinite", "training.max_skipped_steps",
                     "training.early_stopping", "training.parallel", "training.global_batch_size",
                     "training.dist_timeout_s", "training.replica_check_every",
                     "training.cuda_graphs", "training.overlap_steps", "training.deterministic",
                     "training.offload_embeddings", "training.offload_weights", "data.padding_free")  # global_batch_size: checked


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    summary: str
    final_loss: float | None = None
    eval_before: EvalResult | None = None
    eval_after: EvalResult | None = None
    checkpoint: Path | None = None
    output: Path | None = None
    quantized: Path | None = None  # QAT runs: the integer model, loadable with entrenar.load
    dry_run: bool = False


def train(
    recipe: Recipe,
    resume: str | Path | bool | None = None,
    dry_run: bool = False,
    progress: bool = True,
    verbose: bool = False,
) -> TrainResult:
    """Run (or resume, or dry-run) the training described by `recipe`.

    ``verbose`` prints the resolved recipe, what the run is doing and each
    evaluation (and, with ``progress=False``, a line every training.log_every
    steps), as ``entrenar train`` does.
    """
    threads = torch.get_num_threads()
    try:
        with deterministic_algorithms(recipe.training.deterministic):  # a resume keeps what this recipe says
            return _train(recipe, resume, dry_run, progress, Console(verbose, log_lines=not progress))
    finally:
        leave()  # the process group of a distributed run, if this run opened one
        torch.set_num_threads(threads)  # training.cpu_threads applies to the run, not to the caller's process


def _train(recipe: Recipe, resume: str | Path | bool | None, dry_run: bool, progress: bool,
           console: Console) -> TrainResult:
    # Under torchrun: this process's rank and device (one per process); a restarted job resumes where it stopped.
    world, rank_device = join(resolve_device(recipe.model.device), recipe.training.dist_timeout_s)
    if not world.is_main:
        console = Console(False)  # one voice: rank 0 prints for the job
    if not resume and not dry_run and restarted() and latest_checkpoint(Path(recipe.output.dir).absolute()):
        resume = True
    run_dir, resume_from = _run_folder(recipe, resume, dry_run)
    is_quickstart = quickstart.is_quickstart(recipe, run_dir)
    if is_quickstart:
        recipe = quickstart.resolve(recipe, run_dir, dry_run)  # a dry run's files go to a temporary folder
    if resume_from is not None:
        recipe = _recipe_for_resume(recipe, run_dir)
    t = recipe.training
    if recipe.schedule.warmup_steps > t.max_steps:
        raise ConfigError(f"schedule.warmup_steps ({recipe.schedule.warmup_steps}) is longer than the run "
                          f"(training.max_steps={t.max_steps}); shorten it too, e.g. --set "
                          f"schedule.warmup_steps={t.max_steps // 10}")
    if t.early_stopping is not None and not t.eval_every:
        raise ConfigError("training.early_stopping: needs evaluations during the run (training.eval_every > 0)")
    if recipe.output.tensorboard:
        tensorboard_writer_class()  # a missing package is found now, not after loading the model
    console.recipe(recipe)
    if is_quickstart:
        world.main_only(quickstart.write_files, recipe)  # only once the recipe is known to be sound
    context_notes = check_seq_len(recipe.data.seq_len, recipe_model_config(recipe)  # model.path or .config
                                  .max_position_embeddings, recipe.model.path or "model.config")  # before any weights
    if t.cpu_threads is not None:
        torch.set_num_threads(t.cpu_threads)
    _seed_everything(t.seed)
    task = tasks.for_recipe(recipe)  # what a batch means and how it is scored (causal_lm or classification)

    # Model, adapters, precision.
    device = rank_device
    if t.precision == "fp16" and device.type != "cuda":
        raise ConfigError("training.precision: fp16 needs a CUDA device (use bf16 or fp32 on the CPU)")
    weights_dtype = recipe.model.dtype
    if weights_dtype == "auto" and recipe.lora is None:
        weights_dtype = "float32"  # full fine-tuning keeps fp32 master weights; compute follows training.precision
    quantize = recipe.lora.quantize_base if recipe.lora is not None else None
    mode = choose_mode(recipe, world, device)  # single, ddp or fsdp
    refuse(mode, t, world)
    accumulation = dist_steps.accumulation(t.batch_size, t.grad_accum, t.global_batch_size, world.size)
    # FSDP: rank 0 reads the weights into CPU memory, the others build on the meta device; fully_shard then
    # gives each rank its shards of rank 0's (entrenar.distributed.materialize), on its device.
    load_device = sharded_load_device(world) if mode == "fsdp" else device
    if weights_dtype == "auto" and load_device != device:
        # What the run's device gives (bf16 on a GPU), not the CPU that reads for it: an fp32 frozen base would
        # hold twice the memory of a one-GPU run in every shard.
        weights_dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
    if t.offload_weights is True and (device.type != "cuda" or mode != "single" or t.compile):
        raise ConfigError("training.offload_weights: the NF4 base weights stream to one CUDA device, block by "
                          f"block, outside torch.compile; this run is {mode} on {device}"
                          + (" with training.compile" if t.compile else ""))
    weights_streamed = _offload_weights(recipe, device, mode)
    console.say(f"loading {recipe.model.path or 'a random model (model.config)'} on {load_device} ...")
    with nf4_in_host_memory(weights_streamed):  # never all on the GPU, not even while loading
        model, tokenizer = build_model(recipe, task, weights_dtype, load_device, quantize)
    if t.cuda_graphs is True and device.type != "cuda":
        raise ConfigError(f"training.cuda_graphs: CUDA graphs replay GPU launches; this run is on {device}")
    if t.offload_activations and device.type != "cuda":
        raise ConfigError(f"training.offload_activations: offloading moves activations from GPU to CPU memory; "
                          f"this run is on {device}")
    if _offload_embeddings(recipe, model, device, mode, task.name):
        if device.type != "cuda":
            raise ConfigError(f"training.offload_embeddings: the table moves from GPU to CPU memory; this run is "
                              f"on {device}")
        try:
            offload_embeddings(model)
        except ConfigError as e:
            raise ConfigError(f"training.offload_embeddings: {e}") from None
    try:
        model.set_activation_checkpointing(t.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"training.activation_checkpointing: {e}") from None
    try:
        model.set_activation_offload(t.offload_activations)
    except ValueError as e:
        raise ConfigError(f"training.offload_activations: {e}") from None
    # auto on a CPU: the fused LoRA node and the chunked loss, in PyTorch (no full logits; docs/PERFORMANCE.md).
    use_kernels = t.kernels is True or (t.kernels == "auto" and mode != "fsdp"
                                        and (device.type == "cpu" or device.type == "cuda" and triton_available()))
    if t.adapter_math == "bf16" and not use_kernels:
        raise ConfigError("training.adapter_math: bf16 adapter products run in the fused LoRA layer, and this run "
                          "has no kernels (training.kernels: true, or auto on a CPU or on a CUDA device with Triton)")
    if use_kernels:
        # Same parameters and names; fused forwards (PyTorch fallbacks off the GPU).
        apply_kernels(model, lora_compute_dtype=torch.bfloat16 if t.adapter_math == "bf16" else None)
    if weights_streamed:
        stream_weights(model, device)
    # Fusing the output projection into the loss never materialises full-vocabulary logits.
    fused_loss = use_kernels and type(getattr(model, "lm_head", None)) is torch.nn.Linear
    # Router losses, balancing and diagnostics (None for a dense model); counts are summed over the ranks.
    moe = moe_training(model, recipe, accumulation, world)
    step_model = parallelize(model, mode, world, device, t.precision)  # DDP / FSDP2 from outside (or the model)
    moe_replays = moe is None or moe.replayable(device, _compute_dtype(model, t.precision))
    if t.cuda_graphs is True and not moe_replays:
        raise ConfigError("training.cuda_graphs: a CUDA graph replays MoE layers whose experts run as one grouped "
                          "bf16 product (moe.experts: auto or grouped, bf16 compute, full-precision experts); "
                          "this run's loop over experts reads their token counts back every layer")
    graphs = _cuda_graphs(recipe, device, mode, task.name, moe_replays)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # Data: records -> masked examples -> a resumable stream of packed batches.
    d = recipe.data
    skipped: list = []  # every record on_error=skip left out, for the run's skipped.jsonl
    console.say(f"reading and tokenizing {d.train} ...")
    examples, validation, notes, stream = build_data(recipe, task, tokenizer, skipped)
    flat_rows, varlen_rows = _row_layout(recipe, model, device, task.name, examples)
    segments: int | None = None  # CUDA graphs' segment capacity, measured once the data position is known
    notes = context_notes + notes

    lr_scale = moe.lr_scale(recipe.optimizer.lr_scale) if moe is not None else recipe.optimizer.lr_scale
    groups = build_param_groups(model, recipe.optimizer.weight_decay, lr_scale)
    o = recipe.optimizer
    optimizer = build_optimizer(groups, o.name, o.lr, o.betas, o.eps, o.momentum, o.fused, device)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    overlap = _overlap_steps(t.overlap_steps, device, optimizer, mode, scaler.is_enabled())

    def loss_sum_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy of one micro-batch's target tokens."""
        if task.name != "causal_lm":
            return task.loss_sum(step_model, batch)  # through DDP / FSDP, so gradients are reduced
        inputs = (batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
        layout = {"cu_seqlens": batch.get("cu_seqlens"), "max_seqlen": batch.get("max_seqlen")}  # padding-free
        if fused_loss:
            hidden = step_model.hidden_states(*inputs, **layout)
            return fused_linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"], FUSED_LOSS_CHUNK)[0]
        return token_cross_entropy(step_model(*inputs, **layout), batch["labels"])[0]

    def micro_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch; its loss is normalised over the whole step's targets."""
        with autocast_for(device, t.precision, cache=not graphs):
            loss = loss_sum_of(batch) / batch["step_targets"]
            total = loss + moe.router_loss(batch) if moe is not None else loss
        scaler.scale(total).backward()
        return loss.detach()

    # With CUDA graphs the gradients stay allocated and are zeroed in place (the graph adds into them).
    run_micro_step = GraphedMicroStep(micro_step, trainable, capturable=lambda b: _fills_capacity(b, segments)) \
        if graphs else micro_step

    if t.compile:
        # Block by block, not the whole step: compiled around torch.utils.checkpoint, the step held 10-22 GiB
        # more at the Llama-8B shape (the recomputation was undone; docs/PERFORMANCE.md). Per block,
        # checkpointing and offload keep their saving.
        for block in model.model.layers:
            block.compile()

    if t.early_stopping is not None and not validation:
        raise ConfigError("training.early_stopping: needs a validation set (data.validation or data.validation_split)")
    if dry_run:
        report = _dry_run_report(recipe, model, trainable, examples, validation, notes, use_kernels, fused_loss,
                                 accumulation * world.size)
        return TrainResult(run_dir=run_dir, steps=0, summary=report, dry_run=True)

    # Resume: weights, optimizer, RNG, data position and metrics continue where the checkpoint left them.
    start_step = 0
    guard = NonfiniteGuard(t.nonfinite, t.max_skipped_steps, run_dir, scaler_handles_grads=scaler.is_enabled())
    early_stopping = EarlyStopping(t.early_stopping)
    if resume_from is not None:
        console.say(f"resuming from {resume_from} ...")
        if is_sharded(resume_from):  # an FSDP run's: each rank reads what its tensors cover, from any world size
            trainer_state = load_sharded_checkpoint(resume_from, model, optimizer, world)
        else:
            with full_params(model, write_back=True):  # FSDP: whole tensors read, then scattered into the shards
                model_state, trainer_state = load_checkpoint(resume_from, full_optimizer(optimizer, gather=False),
                                                             expected_model_state=_trainable_state(model, recipe))
                _load_trainable_state(model, recipe, model_state, str(resume_from))
        start_step = _check_trainer_state(trainer_state, resume_from, t.max_steps, scaler.is_enabled())
        stream.load_state_dict(trainer_state["data"])
        dist_steps.check_resume(trainer_state, resume_from, t.batch_size * accumulation * world.size)
        if scaler.is_enabled():
            scaler.load_state_dict(trainer_state["grad_scaler"])
        guard.load_state_dict(trainer_state.get("nonfinite"))
        early_stopping.load_state_dict(trainer_state.get("early_stopping"))
        if moe is not None:
            moe.load_state_dict(trainer_state.get("moe"), str(resume_from / "trainer.json"))
    if varlen_rows and graphs:  # CUDA graphs replay one layout: packed rows' documents fill a fixed count
        segments = segment_capacity(stream)
    world.main_only(save_recipe, recipe, run_dir / RECIPE_FILE)  # on resume: with the changes the resume made
    world.main_only(write_arch, run_dir, model.config)  # architecture, parameter counts, fingerprint
    world.main_only(write_skipped, run_dir, skipped)

    def evaluate() -> EvalResult | None:
        if not validation:
            return None
        if not progress:
            console.say(f"evaluating on {len(validation):,} validation examples ...")  # the bar says it otherwise
        if task.name != "causal_lm":  # training.eval_batches bounds it as it bounds the token loss
            subset = validation[:t.eval_batches * t.batch_size] if t.eval_batches else validation
            return task.evaluate(model, subset, recipe)
        batches = eval_batches(validation, t.batch_size, d.seq_len, packing=d.packing, pad_id=tokenizer.pad_id or 0)
        # Eager: the last batch is smaller and would make a compiled model recompile.
        return eval_loss(model, batches, precision=t.precision, max_batches=t.eval_batches)

    def checkpoint(step: int, best: bool = False) -> Path:
        trainer_state = {"data": stream.state_dict(), "recipe": recipe.to_dict(), "nonfinite": guard.state_dict(),
                         "early_stopping": early_stopping.state_dict(),
                         "global_batch": t.batch_size * accumulation * world.size, "world_size": world.size}
        if scaler.is_enabled():
            trainer_state["grad_scaler"] = scaler.state_dict()
        if moe is not None:
            trainer_state["moe"] = moe.state_dict()
        if mode == "fsdp":  # each rank writes its shards (torch.distributed.checkpoint); nothing is gathered
            return save_sharded_checkpoint(run_dir, step, model, optimizer, trainer_state, world, t.keep_last, best)
        with full_params(model):  # whole tensors (a sharded model's gathered); rank 0 writes them
            return world.main_only(save_checkpoint, run_dir, step, _trainable_state(model, recipe),
                                   full_optimizer(optimizer), trainer_state, t.keep_last, best=best)

    metrics = MetricsLogger(run_dir, resume_step=start_step if resume_from is not None else None,
                            tensorboard=recipe.output.tensorboard,
                            write=world.is_main)  # rank 0 writes; the others keep the same counts
    with metrics:  # the metrics file is closed however the run ends
        eval_before = None
        if start_step == 0:
            if progress:  # without a bar, evaluate() says it
                console.say("evaluating before training ...")
            eval_before = evaluate()
            if eval_before is not None:
                task.log_eval(metrics, 0, eval_before)
                scalars = task.eval_scalars(eval_before)
                early_stopping.update(0, scalars)
                console.evaluation(0, scalars, best=True)
        accuracy_before = quickstart.accuracy(model, tokenizer, d.validation) if is_quickstart and start_step == 0 else None

        if world.distributed and world.is_main:
            print(dist_steps.describe(mode, world, t.batch_size, accumulation, d.seq_len), flush=True)
        with tqdm(total=t.max_steps, initial=start_step, disable=not progress or not world.is_main, unit="step",
                  dynamic_ncols=True) as bar:
            last_checkpoint: Path | None = None
            loss_value, eval_after = None, None
            pending: _LaunchedStep | None = None  # overlap: a launched step, read after the next one's micro-steps
            last_read = time.perf_counter()

            def log_step(done: int, lr: float, started: float, loss_value: float, norm_value: float, tokens: int,
                         flags: dict, moe_values: list[float] | None) -> None:
                """The metrics line, warnings and progress of a step whose results were read to the host."""
                nonlocal last_read
                now = time.perf_counter()
                elapsed, last_read = now - max(started, last_read), now  # overlapped: between consecutive reads
                moe_record, moe_warnings = moe.diagnose(done, moe_values) if moe is not None else (None, [])
                extra = {"moe": moe_record} if moe_record is not None else {}
                extra.update(dist_steps.peak_memory(world, device))  # each rank's, in a distributed run
                record = metrics.log_step(done, loss_value, norm_value, lr, tokens, step_time_s=elapsed,
                                          flags=flags, extra=extra)
                for warning in moe_warnings:
                    bar.write(warning)
                bar.update(1)
                if done % t.log_every == 0 or done == t.max_steps:
                    bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                if done % t.log_every == 0 or done == t.max_steps or "skipped" in flags:
                    console.step(record, t.max_steps)  # --no-progress: a line every log_every steps

            for step in range(start_step, t.max_steps):
                started = time.perf_counter()
                lr = lr_at(step, o.lr, recipe.schedule.warmup_steps, t.max_steps, recipe.schedule.name,
                           recipe.schedule.min_lr_ratio)
                set_lr(optimizer, lr)

                micro_batches = dist_steps.step_batches(stream, accumulation, world)  # this rank's share
                step_targets, tokens = dist_steps.step_counts(micro_batches, world, device,  # of the global step
                                                              count_targets=task.num_targets)
                step_loss = torch.zeros((), device=device)
                for i, batch in enumerate(micro_batches):
                    if flat_rows:
                        batch = padding_free(batch)
                    elif varlen_rows:
                        batch = packed_documents(batch, segments)
                    batch = {k: _to(v, device) for k, v in batch.items()}
                    # Over world.size: DDP and FSDP average the ranks' gradients, and the step needs their sum.
                    batch["step_targets"] = step_targets / world.size
                    with step_model.sync(last=i == len(micro_batches) - 1):  # no all-reduce on accumulation steps
                        step_loss += run_micro_step(batch)
                if pending is not None:  # the previous step, read while this step's micro-steps run on the GPU
                    values = pending.read.values()
                    # Its update was already dropped on the device if non-finite; stop mode raises here, before
                    # this step's update is launched.
                    flags = guard.check(pending.step, values[0], values[1])
                    log_step(pending.step, pending.lr, pending.started, values[0], values[1], int(values[2]), flags,
                             values[3:] if moe is not None else None)
                    pending = None

                scaler.unscale_(optimizer)
                max_norm = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)  # returns the pre-clip norm
                done = step + 1
                is_last = done == t.max_steps
                evaluates = bool(t.eval_every and done % t.eval_every == 0) or is_last
                saves = bool(t.save_every and done % t.save_every == 0) or is_last
                # The global step's loss on every rank, so every rank takes the same decision below.
                step_loss = world.all_sum(step_loss) / world.size
                if overlap and optimizer.state and not (evaluates or saves):
                    # Read after the next step's micro-steps are launched; steps the host acts on, and those
                    # before the optimizer has state (built by its first step), are read now.
                    found = step_unless_nonfinite(optimizer, step_loss, grad_norm)
                    optimizer.zero_grad(set_to_none=not graphs)
                    values = [step_loss.double().reshape(1), grad_norm.double().reshape(1), tokens.double().reshape(1)]
                    if moe is not None:  # router biases move only with an applied update
                        values.append(moe.close_step(update=1.0 - found).double())
                    pending = _LaunchedStep(done, lr, started, DeferredRead(torch.cat(values)))
                    continue
                # The step's one host read; a NaN/inf loss or gradient norm then stops the run, or drops this
                # step's update (training.nonfinite), before the optimizer applies it.
                loss_value, norm_value = float(step_loss), float(grad_norm)
                flags = guard.check(done, loss_value, norm_value)
                flags |= optimizer_step(scaler, optimizer, skip=bool(flags))  # fp16: the scaler's own skips
                optimizer.zero_grad(set_to_none=not graphs)
                # Router biases move only with an applied update (a skipped step leaves them too).
                moe_values = moe.close_step(update="skipped" not in flags).tolist() if moe is not None else None
                log_step(done, lr, started, loss_value, norm_value, int(tokens), flags, moe_values)
                if t.replica_check_every and (done % t.replica_check_every == 0 or is_last):
                    check_replicas(model, optimizer, world, done)  # every rank holds the same weights

                stop_early = False
                if evaluates:
                    bar.set_description("evaluating")
                    result = eval_after = evaluate()
                    bar.set_description(None)
                    if result is not None:
                        # Rank 0 decides (it alone reads and writes the metrics), so every rank saves alike.
                        is_best = world.all_gather(task.log_eval(metrics, done, result))[0]
                        # Before the checkpoints below, which carry its counter.
                        scalars = task.eval_scalars(result)
                        stop_early = early_stopping.update(done, scalars)
                        console.evaluation(done, scalars, is_best, early_stopping.reason or "")
                        if is_best:  # run/best/ is usable as --adapter / MODEL as it is
                            main_writes(world, model, _save_result, model, tokenizer, recipe, run_dir / "best",
                                        trainable_only=recipe.lora is not None)  # an adapter: no base gathered
                            last_checkpoint = checkpoint(done, best=True)  # after run/best/: never left stale
                if saves or stop_early:
                    if last_checkpoint is None or last_checkpoint.name != f"step-{done}":
                        last_checkpoint = checkpoint(done)
                if stop_early:
                    break

        if eval_after is None:
            eval_after = evaluate()
        console.say("saving ...")
        output = main_writes(world, model, _save_result, model, tokenizer, recipe, run_dir,
                             trainable_only=recipe.lora is not None)  # an adapter: no base gathered
        quantized = (main_writes(world, model, save_qat_model, model, tokenizer, run_dir / "quantized")
                     if recipe.qat is not None else None)
        world.main_only(plot_loss_curve, metrics.path, run_dir / "loss_curve.png")
        if moe is not None:
            world.main_only(plot_expert_load, metrics.path, run_dir / "expert_load.png")
        rows = [("output", str(output)), *[("note", note) for note in notes]]
        if early_stopping.reason is not None and (metrics.last_step or 0) < t.max_steps:
            rows.append(("stopped early", early_stopping.reason))
        if guard.total:
            rows.append(("skipped steps", f"{guard.total} update(s) dropped for NaN/inf (training.nonfinite: skip); "
                                          "see 'skipped' in metrics.jsonl"))
        if quantized is not None:
            rows.append(("quantized", str(quantized)))
        rows += task.finish(model, validation, recipe, run_dir, output)  # a classifier's report
        if eval_before is not None and eval_after is not None and task.name == "causal_lm":
            rows.append(("held-out loss", f"{eval_before.loss:.4f} -> {eval_after.loss:.4f} "
                                          f"(perplexity {eval_before.perplexity:.2f} -> {eval_after.perplexity:.2f})"))
        if is_quickstart:
            after = quickstart.accuracy(model, tokenizer, d.validation)
            before = f"{accuracy_before:.1%} -> " if accuracy_before is not None else ""
            rows.append(("held-out acc.", f"{before}{after:.1%} of unseen sums answered exactly"))
        summary = metrics.summary(checkpoint=last_checkpoint or latest_checkpoint(run_dir), extra=rows)
    return TrainResult(run_dir=run_dir, steps=metrics.last_step or 0, summary=summary, final_loss=loss_value,
                       eval_before=eval_before, eval_after=eval_after, checkpoint=latest_checkpoint(run_dir),
                       output=output, quantized=quantized)


# -- the pieces the loop reads as one line each ------------------------------------------------


def build_model(recipe: Recipe, task, dtype: str, device: torch.device, quantize: str | None):
    """(model, tokenizer) as the loop trains them: loaded by the task, QAT and LoRA applied, in train mode.
    Also what ``entrenar diagnose`` builds (entrenar.experiments.diagnose)."""
    model, tokenizer = task.load(recipe.model.path, dtype=dtype, device=device, quantize=quantize)
    tokenizer = require_tokenizer(tokenizer, recipe.model.path)  # the data needs one
    model.train()
    if recipe.qat is not None:
        apply_qat_recipe(model, recipe.qat)  # before LoRA, which then wraps the fake-quantized layers (LoRA-QAT)
    lora_config = lora_config_of(recipe.lora)
    if lora_config is not None:
        try:
            apply_lora(model, lora_config)
        except AdapterError as e:
            raise AdapterError(f"lora.target_modules: {e}") from None
    task.prepare(model)  # a classifier's head stays trainable beside the adapters
    return model, tokenizer


def build_data(recipe: Recipe, task, tokenizer, skipped: list) -> tuple[list, list, list[str], BatchStream]:
    """(train examples, validation examples, notes, the stream of training batches) of a recipe; appends what
    on_error=skip left out to ``skipped``."""
    d, t = recipe.data, recipe.training
    read_examples = functools.partial(_examples if task.name == "causal_lm" else task.examples, skipped=skipped)
    examples, notes = read_examples(d.train, "train", recipe, tokenizer)
    if d.validation:
        validation, validation_notes = read_examples(d.validation, "validation", recipe, tokenizer)
        notes += validation_notes
    else:
        examples, validation = split_validation(examples, d.validation_split, seed=t.seed)
    if task.name == "causal_lm":
        stream = BatchStream(examples, t.batch_size, d.seq_len, packing=d.packing, shuffle=d.shuffle, seed=t.seed,
                             pad_id=tokenizer.pad_id or 0)
    else:  # a task's stream may weigh the rows it trains on (class weights)
        stream, stream_notes = task.stream(examples, recipe)
        notes += stream_notes
    return examples, validation, notes, stream


def _run_folder(recipe: Recipe, resume: str | Path | bool | None, dry_run: bool) -> tuple[Path, Path | None]:
    """The run folder, and the checkpoint to resume from. Refuses to train over an earlier run's checkpoints."""
    # Absolute, so paths the run records (the quickstart's) hold from any working directory.
    run_dir = (Path(resume) if isinstance(resume, (str, Path)) else Path(recipe.output.dir)).absolute()
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise CheckpointError(f"{run_dir}: no checkpoint to resume from")
        return run_dir, ckpt
    if not dry_run and latest_checkpoint(run_dir) is not None:
        raise CheckpointError(f"{run_dir} already holds a run with checkpoints; pass --resume to continue it, "
                              "or set output.dir to a new folder")
    return run_dir, None


def _recipe_for_resume(recipe: Recipe, run_dir: Path) -> Recipe:
    """The saved recipe of the run, with only the changes a resume may make."""
    saved_path = run_dir / RECIPE_FILE
    if not saved_path.is_file():
        raise CheckpointError(f"{run_dir}: {RECIPE_FILE} is missing; cannot check that the resumed run is the same")
    saved = load_recipe(saved_path)
    changes = [c for c in recipe_changes(saved, recipe) if not c.startswith(RESUMABLE_CHANGES + ("output.",))]
    if changes:
        raise CheckpointError(f"{run_dir}: the recipe differs from the run being resumed: " + "; ".join(changes)
                              + f" (a resume may change only {', '.join(RESUMABLE_CHANGES)})")
    def allowed(section: str) -> dict:
        return {key.split(".")[1]: getattr(getattr(recipe, section), key.split(".")[1])
                for key in RESUMABLE_CHANGES if key.startswith(section + ".")}

    return dataclasses.replace(saved, training=dataclasses.replace(saved.training, **allowed("training")),
                               data=dataclasses.replace(saved.data, **allowed("data")))


def _cuda_graphs(recipe: Recipe, device: torch.device, mode: str, task: str, moe_replays: bool = True) -> bool:
    """``training.cuda_graphs``, with ``auto`` resolved: on where graphs are known to replay and pay (one CUDA
    device, LoRA/QLoRA on packed causal-LM rows of one shape, a dense model or an MoE one whose experts run
    grouped (``moe_replays``: no host read in the step), no compile, no fp16 loss scaling).
    Full fine-tuning measured no faster under graphs and 4 GiB heavier (docs/PERFORMANCE.md), so auto leaves
    it eager; QAT's step-size initialisation reads the device once, which a graph cannot."""
    t, d = recipe.training, recipe.data
    if t.cuda_graphs != "auto":
        return t.cuda_graphs
    return (device.type == "cuda" and mode == "single" and task == "causal_lm" and moe_replays and d.packing
            and recipe.lora is not None and recipe.qat is None and d.padding_free is not True and not t.compile
            and t.precision != "fp16")  # padding_free: auto is never on for a CUDA device


def _offload_embeddings(recipe: Recipe, model: torch.nn.Module, device: torch.device, mode: str, task: str) -> bool:
    """``training.offload_embeddings``, with ``auto`` resolved: on for a causal-LM LoRA/QLoRA run on one CUDA
    device with every layer checkpointed (the run trades speed for memory already; the GPU reads a batch's rows
    over PCIe in well under a millisecond) whose frozen input table is not tied to the output head."""
    setting = recipe.training.offload_embeddings
    if setting != "auto":
        return setting
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    return (device.type == "cuda" and mode == "single" and task == "causal_lm" and recipe.lora is not None
            and recipe.training.activation_checkpointing is True and triton_available()
            and type(embedding) is torch.nn.Embedding and not embedding.weight.requires_grad
            and head is not None and getattr(head, "weight", None) is not embedding.weight)


def _offload_weights(recipe: Recipe, device: torch.device, mode: str) -> bool:
    """``training.offload_weights``, with ``auto`` resolved: on for QLoRA (an NF4 base) on one CUDA device with
    every layer checkpointed, without compile. Each block's NF4 weights then cross PCIe twice a step (forward,
    and the rerun before its backward) while the block before it computes: QLoRA Llama-8B shape 12.06k against
    12.16k tokens/s at 3.27 against 6.41 GiB (H100, docs/PERFORMANCE.md)."""
    t = recipe.training
    if t.offload_weights != "auto":
        return t.offload_weights
    return (device.type == "cuda" and mode == "single" and recipe.lora is not None
            and recipe.lora.quantize_base == "nf4" and t.activation_checkpointing is True and not t.compile
            and not recipe_model_config(recipe).is_moe)  # NF4 experts load on the GPU, outside the stream


def _row_layout(recipe: Recipe, model: torch.nn.Module, device: torch.device, task: str,
                examples: list) -> tuple[bool, bool]:
    """(padding-free batches, packed rows read as documents) for this run. Causal-LM rows attend document by
    document (the variable-length flash kernel on CUDA) instead of under a dense document mask, which keeps SDPA
    off flash and computes the blocks across documents; on a CPU only where the documents outweigh their calls
    (hidden size x mean example length, :func:`rows_by_document`)."""
    by_document = task == "causal_lm" and rows_by_document(
        model.config.head_dim, device, _compute_dtype(model, recipe.training.precision), model.config.sliding_window,
        compiled=recipe.training.compile,
        document_work=model.config.hidden_size * sum(len(e) for e in examples) / len(examples))
    flat_rows = _padding_free(recipe, device, by_document)
    return flat_rows, by_document and not flat_rows


def _padding_free(recipe: Recipe, device: torch.device, by_document: bool) -> bool:
    """``data.padding_free``, with ``auto`` resolved: on a CPU where causal-LM rows attend document by document
    (``by_document``, :func:`rows_by_document`: not compiled, documents big enough for their calls), since
    nothing there gains from fixed shapes and a padded position costs what a real one does; off on a GPU, whose
    graphs replay fixed rows."""
    setting = recipe.data.padding_free
    return setting if setting != "auto" else device.type == "cpu" and by_document


@dataclass
class _LaunchedStep:
    """An overlapped step whose update is launched and whose results (loss, gradient norm, tokens, MoE
    counters) are on their way to the host."""

    step: int
    lr: float
    started: float
    read: DeferredRead


def _overlap_steps(setting: str | bool, device: torch.device, optimizer: torch.optim.Optimizer, mode: str,
                   scaled: bool) -> bool:
    """``training.overlap_steps`` resolved: auto is on for one CUDA device when the optimizer can drop a
    non-finite update itself (a CPU runs each step to its end anyway); true where that is impossible says why."""
    reason = overlap_unsupported(optimizer, mode, scaled)
    if setting is True and reason is not None:
        raise ConfigError(f"training.overlap_steps: {reason}")
    return reason is None and (setting is True or setting == "auto" and device.type == "cuda")


def _fills_capacity(batch: dict, segments: int | None) -> bool:
    """Whether a micro-batch has the layout a CUDA graph may be captured with (packed rows padded to the
    segment capacity, not a batch over it that kept its own)."""
    cu = batch.get("cu_seqlens")
    return cu is None or segments is None or len(cu) == segments + 1


def _compute_dtype(model: torch.nn.Module, precision: str) -> torch.dtype:
    """The dtype the products run in: autocast's, or the model's own (what flash and grouped kernels take)."""
    if precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    weight = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return weight.dtype if weight is not None else torch.float32


def _to(value: torch.Tensor | int, device: torch.device) -> torch.Tensor | int:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _examples(path: str, role: str, recipe: Recipe, tokenizer, skipped: list) -> tuple[list, list[str]]:
    """Masked examples of one data file, and notes on what was skipped, cut or odd (for the report); appends
    the skipped records to ``skipped``."""
    d = recipe.data
    records, read_stats = read_records(path, format=d.format, on_error=d.on_error, seed=recipe.training.seed,
                                       query=d.query)  # synth: sources draw from the seed; SQLite files run the query
    columns = {"text": d.text_field, "prompt": d.prompt_field, "completion": d.completion_field,
               "messages": d.messages_field}
    try:
        examples, stats = tokenize_records(records, tokenizer, d.seq_len, train_on=d.train_on, add_eos=d.add_eos,
                                           columns=columns, on_error=d.on_error)
    except DataError as e:
        if str(e).startswith("no training examples"):
            raise DataError(f"data.{role} ({path}): {str(e).replace('no training examples', 'no examples', 1)}") from None
        raise
    left_out = skipped_in_order(read_stats, stats)
    skipped.extend(left_out)
    notes = data_notes(f"data.{role}", left_out, stats)
    if stats.truncated_examples:
        notes.append(f"data.{role}: {stats.truncated_examples} example(s) cut to seq_len={d.seq_len} "
                     f"({stats.truncated_tokens:,} tokens dropped)")
    if stats.dropped_no_targets:
        notes.append(f"data.{role}: {stats.dropped_no_targets} example(s) left out: nothing to train on within seq_len")
    return examples, notes


def _check_trainer_state(state: dict, checkpoint: Path, max_steps: int, needs_scaler: bool) -> int:
    """The step a checkpoint was taken at, after checking trainer.json holds what resuming needs."""
    step, data = state.get("step"), state.get("data")
    where = checkpoint / "trainer.json"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: 'data' (the data stream position) is missing or not a mapping")
    if needs_scaler and not isinstance(state.get("grad_scaler"), dict):
        raise CheckpointError(f"{where}: 'grad_scaler' is missing; it is needed to resume fp16 training")
    if step > max_steps:
        raise CheckpointError(f"{checkpoint} is at step {step}, past training.max_steps={max_steps}; "
                              f"resume with --set training.max_steps={step} or more")
    return step


def _trainable_state(model: torch.nn.Module, recipe: Recipe) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps: the adapters in a LoRA run, every weight otherwise; and QAT's quantizer state."""
    if recipe.lora is not None:  # with a classifier's head, trained whole beside the adapters
        return {**lora_state_dict(model), **_head_state(model), **qat_state_dict(model)}
    return {**dict(model.named_parameters()), **qat_state_dict(model)}


def _head_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A classifier's head (trained whole in a LoRA run); nothing for a language model."""
    return {"score.weight": model.score.weight} if hasattr(model, "score") else {}


def _load_trainable_state(model: torch.nn.Module, recipe: Recipe, state: dict[str, torch.Tensor], source: str) -> None:
    state = load_qat_state_dict(model, state, source)  # takes the quantizer state, leaves the rest
    if recipe.lora is not None:
        head = {name: state.pop(name) for name in list(state) if name in _head_state(model)}
        load_lora_state_dict(model, state, source=source)
        with torch.no_grad():
            for name, tensor in head.items():
                model.get_parameter(name).copy_(tensor)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def _save_result(model, tokenizer, recipe: Recipe, run_dir: Path) -> Path:
    """The adapter (PEFT format) of a LoRA run, or the whole model folder of a full fine-tune."""
    if recipe.task.type == "classification":  # the head in the adapter as PEFT saves SEQ_CLS, or a classifier folder
        from entrenar.tasks.classification import save_result

        return save_result(model, tokenizer, recipe, run_dir, lora_config_of(recipe.lora))
    if recipe.lora is not None:
        out = run_dir / "adapter"
        save_adapter(model, out, lora_config_of(recipe.lora), base_model_name_or_path=str(recipe.model.path))
        return out
    out = run_dir / "model"
    base = Path(recipe.model.path) if recipe.model.path else None  # a random-init model has no base folder
    with master_weights(model):  # QAT: the full-precision weights it trained, as a plain model folder
        save_merged(model, tokenizer, out, base=base if base and base.is_dir() else None)  # keeps generation config
    return out


def _weights_streamed(model: torch.nn.Module) -> bool:
    """Whether the model's NF4 block weights live in CPU memory (``training.offload_weights``)."""
    return any(isinstance(m, NF4Linear) and m.weight_codes.device.type == "cpu" and m.quantize_on is not None
               and m.quantize_on.type == "cuda" for m in model.modules())


def _dry_run_report(recipe: Recipe, model, trainable, examples, validation, notes: list[str], kernels: bool,
                    fused_loss: bool, micro_batches: int) -> str:
    """What a dry run prints; ``micro_batches`` per optimizer step over every process."""
    total = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in trainable)
    t, d = recipe.training, recipe.data
    method = "full" if recipe.lora is None else ("qlora" if recipe.lora.quantize_base else "lora")
    stored_bytes = next(p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")).element_size()
    lora = recipe.lora
    wrapped = {name.rsplit(".", 1)[-1] for name, _ in lora_layers(model)} if lora else set()
    estimate = estimate_training_memory(
        model.config, method, t.batch_size, d.seq_len,
        dtype_bytes=2 if t.precision != "fp32" else 4, param_bytes=stored_bytes,
        lora_r=lora.r if lora else 16, lora_targets=sorted(wrapped & set(LINEAR_NAMES)),
        lora_target_parameters=list(lora.target_parameters or []) if lora else [],
        activation_checkpointing=sorted(model.checkpointed_layers), offload_activations=t.offload_activations,
        offload_embeddings=isinstance(getattr(getattr(model, "model", None), "embed_tokens", None), HostEmbedding),
        offload_weights=_weights_streamed(model),
        optimizer=recipe.optimizer.name,
        fused_loss_chunk=FUSED_LOSS_CHUNK if fused_loss else None, kernels=kernels,
        cpu=next(model.parameters()).device.type == "cpu", lora_dropout=lora.dropout if lora else 0.0,
    )
    tokens = sum(len(e) for e in examples)
    return "\n".join([
        f"dry run: recipe valid, model and data built, nothing trained ({recipe.output.dir})",
        f"{'model':<22}{recipe.model.path} ({model.config.model_type}, {model.config.num_layers} layers)",
        f"{'parameters':<22}{total:,} total, {n_trainable:,} trainable ({n_trainable / total:.2%})",
        f"{'method':<22}{method}",
        f"{'train examples':<22}{len(examples):,} ({tokens:,} tokens)",
        f"{'validation examples':<22}{len(validation):,}",
        *[f"{'note':<22}{note}" for note in notes],
        f"{'step':<22}{t.batch_size} x {d.seq_len} tokens x {micro_batches} micro-batches, {t.max_steps} steps",
        f"{'memory estimate':<22}{estimate.total / GiB:.2f} GiB (weights {estimate.weights / GiB:.2f}, "
        f"grads {estimate.gradients / GiB:.2f}, optimizer {estimate.optimizer / GiB:.2f}, "
        f"activations {estimate.activations / GiB:.2f}, logits {estimate.logits / GiB:.2f}{_cpu_terms(estimate)})",
        *([f"{'':<22}{CPU_ESTIMATE_NOTE}"] if estimate.runtime else []),
    ])


CPU_ESTIMATE_NOTE = ("the peak resident memory of this process: measured peaks were within 25% of it "
                     "(docs/PERFORMANCE.md, CPU memory); left out: loading (the file is mapped while the weights "
                     "are converted; a GGUF is dequantized), evaluation, the OS page cache")


def _cpu_terms(estimate) -> str:
    if not estimate.runtime:
        return ""
    return (f", runtime {estimate.runtime / GiB:.2f}, autocast copies {estimate.casts / GiB:.2f}, "
            f"allocator {estimate.allocator / GiB:.2f}")
