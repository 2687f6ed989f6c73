"""The Trainer: resume, the loop of steps, evaluation, checkpoints, the result and the summary.

It is built from what the plan decided and :func:`~entrenar.train.prepare.prepare` made, and talks to the task
only through the Task protocol (:mod:`entrenar.tasks.base`): it never asks which task it runs. Each step:
schedule the learning rate, run the step (:mod:`entrenar.train.stepping`), log it, and now and then evaluate
and checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from entrenar.config import Recipe, save_recipe
from entrenar.data import packed_documents, padding_free, segment_capacity
from entrenar.data.report import write_skipped
from entrenar.data.tokenizer import Tokenizer
from entrenar.distributed import steps as dist_steps
from entrenar.distributed import watchdog
from entrenar.distributed.consistency import ReplicaCheck
from entrenar.distributed.context_parallel import ContextParallel
from entrenar.distributed.context_parallel import describe as describe_context
from entrenar.distributed.state import full_optimizer, full_params, main_writes
from entrenar.distributed.world import World
from entrenar.evaluation.loss import EvalResult
from entrenar.io.run_dir import RunDir
from entrenar.quant.checkpoint import save_qat_model
from entrenar.quant.qat import merged_quant_layers, save_quantizer_state, swapped
from entrenar.tasks.base import Batch, Task
from entrenar.train.arch import write_arch
from entrenar.train.checkpoint import is_sharded, latest_checkpoint, load_checkpoint, save_checkpoint
from entrenar.train.console import Console
from entrenar.train.early_stopping import EarlyStopping
from entrenar.train.faults import NonfiniteGuard
from entrenar.train.metrics import MetricsLogger, plot_loss_curve
from entrenar.train.moe import plot_expert_load
from entrenar.train.optim import LRSchedule, build_optimizer, build_param_groups, set_lr
from entrenar.train.plan import RowLayout, RunPlan
from entrenar.train.prepare import Prepared
from entrenar.train.resume import check_trainer_state, load_trainable_state, resumed_schedule, trainable_state
from entrenar.train.run_data import RunData
from entrenar.train.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from entrenar.train.stepping import MicroStep, OverlappedSteps, StepRecord, SyncSteps
from entrenar.train.trackers import open_trackers, run_artifacts


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    summary: str
    final_loss: float | None = None
    eval_before: Any = None
    eval_after: Any = None
    checkpoint: Path | None = None
    output: Path | None = None
    quantized: Path | None = None  # QAT runs: the integer model, loadable with entrenar.load
    dry_run: bool = False


class Trainer:
    """One run's training, from a fresh start or a checkpoint."""

    def __init__(self, recipe: Recipe, plan: RunPlan, rows: RowLayout, world: World, task: Task, run: RunDir,
                 prepared: Prepared, tokenizer: Tokenizer, data: RunData, console: Console, progress: bool) -> None:
        self.recipe, self.plan, self.rows, self.world, self.task, self.run = recipe, plan, rows, world, task, run
        self.model, self.moe, self.tokenizer, self.data = prepared.model, prepared.moe, tokenizer, data
        self.console, self.progress = console, progress
        t, o = recipe.training, recipe.optimizer
        lr_scale = self.moe.lr_scale(o.lr_scale) if self.moe is not None else o.lr_scale
        step_lr = recipe.qat.scale_lr if recipe.qat is not None and recipe.qat.scale_lr is not None else o.lr
        groups = build_param_groups(self.model, o.weight_decay, lr_scale, step_lr_scale=step_lr / o.lr)
        self.optimizer = build_optimizer(groups, o.name, o.lr, o.betas, o.eps, o.momentum, o.fused, plan.device)
        self.scaler = torch.amp.GradScaler(plan.device.type, enabled=plan.loss_scaling)
        self.guard = NonfiniteGuard(t.nonfinite, t.max_skipped_steps, run.root,
                                    scaler_handles_grads=self.scaler.is_enabled())
        self.early_stopping = EarlyStopping(t.early_stopping)
        self.micro_step = MicroStep(task, prepared.step_model, self.moe, plan.device, t.precision, self.scaler,
                                    prepared.trainable, prepared.cuda_graphs, graphs_strict=t.cuda_graphs is True)
        self.trainable = prepared.trainable
        step_model = prepared.step_model  # context parallelism: slices rows, and reads by data-parallel group
        self.context = step_model if isinstance(step_model, ContextParallel) else None
        self.start_step, self.resumed = 0, False
        sched = recipe.schedule
        self.schedule = LRSchedule.of(o.lr, sched.warmup_steps, t.max_steps, sched.name, sched.min_lr_ratio)
        self.schedule_change: str | None = None  # a resume that changed the run's length: how the lr goes on
        self._last_read = time.perf_counter()  # overlapped steps are timed between consecutive reads
        self._last_checkpoint: Path | None = None
        self._replicas_checked: list[int] = []  # the steps whose replica check passed (a distributed run's)

    # -- setup --------------------------------------------------------------------------------------------

    def resume(self, checkpoint: Path) -> None:
        """Weights, optimizer, RNG, data position and counters as the checkpoint left them."""
        self.console.say(f"resuming from {checkpoint} ...")
        model, t = self.model, self.recipe.training
        if is_sharded(checkpoint):  # an FSDP run's: each rank reads what its tensors cover, from any world size
            state = load_sharded_checkpoint(checkpoint, model, self.optimizer, self.world)
        else:
            with full_params(model, write_back=True):  # FSDP: whole tensors read, then scattered into the shards
                model_state, state = load_checkpoint(
                    checkpoint, full_optimizer(self.optimizer, gather=False),
                    expected_model_state=trainable_state(model, self.recipe, self.task))
                load_trainable_state(model, self.recipe, self.task, model_state, str(checkpoint))
        self.start_step = check_trainer_state(state, checkpoint, t.max_steps, self.scaler.is_enabled())
        self.schedule, self.schedule_change = resumed_schedule(state, self.recipe, checkpoint)
        if self.schedule_change is not None:
            self.console.say(self.schedule_change)
        self.data.stream.load_state_dict(state["data"])
        dist_steps.check_resume(state, checkpoint, self.plan.rows_per_step)
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["grad_scaler"])
        self.guard.load_state_dict(state.get("nonfinite"))
        self.early_stopping.load_state_dict(state.get("early_stopping"))
        if self.moe is not None:
            self.moe.load_state_dict(state.get("moe"), str(checkpoint / "trainer.json"))
        self.resumed = True

    def _write_run_files(self) -> None:
        if self.rows.by_document and self.micro_step.graphs and self.task.fixed_layout is None:
            # graphs replay one layout: a fixed segment count
            self.micro_step.segments = segment_capacity(self.data.stream)
        main = self.world.main_only
        main(save_recipe, self.recipe, self.run.recipe)  # on resume: with the changes the resume made
        main(write_arch, self.run.root, self.model.config)  # architecture, parameter counts, fingerprint
        main(write_skipped, self.run.root, self.data.skipped)

    def _layout(self, batch: Batch) -> Batch:
        fixed = self.task.fixed_layout  # a task's own fixed layout (preference pairs)
        if self.micro_step.graphs and fixed is not None and self.context is None:
            return fixed.graph_layout(batch)
        if self.rows.flat:
            flat = padding_free(batch)
            return self.context.shard(flat) if self.context is not None else flat  # this rank's slice of the row
        if self.rows.by_document:
            return packed_documents(batch, self.micro_step.segments)
        return batch

    # -- the run ------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train from :attr:`start_step` to ``training.max_steps`` (or an early stop), save, summarise."""
        self._write_run_files()
        t = self.recipe.training
        resume_step = self.start_step if self.resumed else None
        metrics = MetricsLogger(self.run.root, resume_step=resume_step,
                                write=self.world.is_main)  # rank 0 writes; the others keep the same counts
        with metrics:  # the metrics file and the trackers are closed however the run ends
            if self.world.is_main:  # TensorBoard, MLflow, W&B: one voice for the job, as metrics.jsonl
                metrics.trackers = open_trackers(self.recipe, self.run.root, resume_step)
            before = self._begin(metrics) if self.start_step == 0 else None
            if self.world.distributed and self.world.is_main:
                print(describe_context(self.plan.mode, self.world, self.plan.context_parallel, t.batch_size,
                                       self.plan.accumulation, self.recipe.data.seq_len) if self.context else
                      dist_steps.describe(self.plan.mode, self.world, t.batch_size, self.plan.accumulation,
                                          self.recipe.data.seq_len), flush=True)
                if self.plan.mode == "ddp":  # which reduction, and whether graphs and overlap kept (issue 38)
                    on = {True: "on", False: "off"}
                    print(f"ddp gradients: {dict(self.plan.reasons).get('ddp gradients')}; cuda graphs "
                          f"{on[self.micro_step.graphs]}, step overlap {on[self.plan.overlap]}", flush=True)
            with tqdm(total=t.max_steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                      disable=not self.progress or not self.world.is_main) as bar:
                final_loss, after = self._loop(metrics, bar)
            return self._finish(metrics, before, after, final_loss)

    def _begin(self, metrics: MetricsLogger) -> EvalResult | None:
        """The evaluation before training (the baseline and the first best), then the task's own baseline."""
        if self.progress:  # without a bar, evaluate() says it
            self.console.say("evaluating before training ...")
        before = self.evaluate()
        if before is not None:
            self.task.log_eval(metrics, 0, before)
            scalars = self.task.eval_scalars(before)
            self.early_stopping.update(0, scalars)
            self.console.evaluation(0, scalars, best=True)
        self.task.begin(self.model, self.tokenizer)
        return before

    def _steps(self, log: Callable[[StepRecord], None]) -> SyncSteps:
        """The plan's step strategy; ``log`` takes each step whose results reached the host."""
        strategy = OverlappedSteps if self.plan.overlap else SyncSteps
        return strategy(world=self.world, task=self.task, stream=self.data.stream, accumulation=self.plan.accumulation,
                        layout=self._layout, micro_step=self.micro_step, optimizer=self.optimizer,
                        scaler=self.scaler, guard=self.guard, moe=self.moe, trainable=self.trainable,
                        max_grad_norm=self.recipe.training.max_grad_norm, device=self.plan.device, log=log,
                        data_world=self.context.data_world if self.context is not None else None)

    def _loop(self, metrics: MetricsLogger, bar: tqdm) -> tuple[float | None, Any]:
        """The steps; (the last step's loss, the last evaluation) when they end."""
        t = self.recipe.training
        steps = self._steps(lambda record: self._log_step(record, metrics, bar))
        replicas = ReplicaCheck(self.model, self.optimizer, self.world)  # every rank holds the same weights
        final_loss: float | None = None
        after = None
        for step in range(self.start_step, t.max_steps):
            lr = self.schedule.lr(step)
            set_lr(self.optimizer, lr)
            done = step + 1
            evaluates = bool(t.eval_every and done % t.eval_every == 0) or done == t.max_steps
            saves = bool(t.save_every and done % t.save_every == 0) or done == t.max_steps
            record = steps.run(step, lr, acts=evaluates or saves)
            every = t.replica_check_every
            if every and (done == self.start_step + 1 or done % every == 0 or done == t.max_steps):
                # The first step's check also compares the tensors' layout (a host wait, in the step that warms up
                # anyway). An overlapped step too: the sums read the weights after its update, queued in order. The
                # verdict is read at the next check, unless this step saves or evaluates (then before it does).
                watchdog.beat("collective", done)
                self._replicas_checked += replicas.start(done, wait=evaluates or saves)
            elif evaluates or saves:
                self._replicas_checked += replicas.settle()
            if record is None:  # overlapped: read during the next step
                continue
            final_loss = record.loss
            stop = False
            if evaluates:
                after, stop = self._evaluate_at(done, metrics, bar)
            if (saves or stop) and (self._last_checkpoint is None or self._last_checkpoint.name != f"step-{done}"):
                self._last_checkpoint = self.checkpoint(done)
            if stop:
                break
        steps.finish()
        self._replicas_checked += replicas.settle()
        return final_loss, after

    def _log_step(self, record: StepRecord, metrics: MetricsLogger, bar: tqdm) -> None:
        """The metrics line, warnings and progress of a step whose results were read to the host."""
        now = time.perf_counter()
        elapsed, self._last_read = now - max(record.started, self._last_read), now
        max_steps, done = self.recipe.training.max_steps, record.step
        moe_record, warnings = self.moe.diagnose(done, record.moe_values) \
            if self.moe is not None and record.moe_values is not None else (None, [])
        extra: dict[str, Any] = {"moe": moe_record} if moe_record is not None else {}
        extra.update(record.metrics)  # the task's own (a preference task's rewards/chosen...), as it names them
        log_every = self.recipe.training.log_every
        if record.peaks is not None and (done % log_every == 0 or done == max_steps):  # came with the step's loss
            extra["peak_mem_gb_ranks"] = [round(p, 3) for p in record.peaks]
        line = metrics.log_step(done, record.loss, record.grad_norm, record.lr, record.tokens,
                                step_time_s=elapsed, flags=record.flags, extra=extra)
        notice = self.micro_step.notice()
        for warning in warnings + ([notice] if notice else []):
            bar.write(warning)
        bar.update(1)
        if done % log_every == 0 or done == max_steps:
            bar.set_postfix(loss=f"{record.loss:.4f}", lr=f"{record.lr:.2e}")
        if done % log_every == 0 or done == max_steps or "skipped" in record.flags:
            self.console.step(line, max_steps)  # --no-progress: a line every log_every steps

    # -- evaluation and saving ----------------------------------------------------------------------------

    def evaluate(self) -> Any:
        """The task's held-out evaluation, or None without validation data."""
        if not self.data.validation:
            return None
        watchdog.beat("evaluation")
        if not self.progress:
            self.console.say(f"evaluating on {len(self.data.validation):,} validation examples ...")
        return self.task.evaluate(self.model, self.data.validation, self.tokenizer)

    def _evaluate_at(self, done: int, metrics: MetricsLogger, bar: tqdm) -> tuple[Any, bool]:
        """Evaluate after step ``done``; save run/best/ (and its checkpoint) when it is the best so far.
        Returns (the evaluation, whether early stopping says stop)."""
        bar.set_description("evaluating")
        result = self.evaluate()
        bar.set_description(None)
        if result is None:
            return None, False
        # Rank 0 decides (it alone reads and writes the metrics), so every rank saves alike.
        is_best = self.world.all_gather(self.task.log_eval(metrics, done, result))[0]
        scalars = self.task.eval_scalars(result)  # before the checkpoints below, which carry its counter
        stop = self.early_stopping.update(done, scalars)
        self.console.evaluation(done, scalars, is_best, self.early_stopping.reason or "")
        if is_best:  # run/best/ is usable as --adapter / MODEL as it is
            self._save_result(self.run.best)
            self._last_checkpoint = self.checkpoint(done, best=True)  # after run/best/: never left stale
        return result, stop

    def checkpoint(self, step: int, best: bool = False) -> Path:
        """Save a checkpoint of step ``step`` (rank 0 writes whole tensors; under FSDP each rank its shards)."""
        t, world = self.recipe.training, self.world
        watchdog.beat("checkpoint", step)
        state: dict[str, Any] = {"data": self.data.stream.state_dict(), "recipe": self.recipe.to_dict(),
                                 "nonfinite": self.guard.state_dict(),
                                 "early_stopping": self.early_stopping.state_dict(),
                                 "global_batch": self.plan.rows_per_step, "world_size": world.size,
                                 "schedule": self.schedule.state_dict()}
        if self.scaler.is_enabled():
            state["grad_scaler"] = self.scaler.state_dict()
        if self.moe is not None:
            state["moe"] = self.moe.state_dict()
        if self.plan.mode == "fsdp":  # each rank writes its shards (torch.distributed.checkpoint); nothing gathered
            return save_sharded_checkpoint(self.run.root, step, self.model, self.optimizer, state, world,
                                           t.keep_last, best)
        with full_params(self.model):  # whole tensors (a sharded model's gathered); rank 0 writes them
            return world.main_only(save_checkpoint, self.run.root, step,
                                   trainable_state(self.model, self.recipe, self.task),
                                   full_optimizer(self.optimizer), state, t.keep_last, best=best)

    def _distributed_rows(self) -> list[tuple[str, str]]:
        """A distributed run's replica check and each rank's peak memory, for the summary (none on one process):
        the peaks gathered now, once (every rank runs this), so they include the final save."""
        if not self.world.distributed:
            return []
        checked = self._replicas_checked
        rows = [("replica check", f"identical on {self.world.size} ranks at {len(checked)} check(s), steps "
                                  f"{checked[0]:,}-{checked[-1]:,}" if checked else
                 "not run (training.replica_check_every: 0)" if not self.recipe.training.replica_check_every else
                 "not reached in this run's steps")]
        peaks = dist_steps.peak_memory(self.world, self.plan.device)["peak_mem_gb_ranks"]
        rows.append(("peak memory", ", ".join(f"rank {r} {gb:.2f} GB" for r, gb in enumerate(peaks))))
        return rows

    def _merged_report(self, unmerged: Any) -> list[tuple[str, str]]:
        """LoRA-QAT: the held-out loss of the merged integer model ``Q(W + BA)`` against the unmerged pair the run
        saved (``quantized/`` with ``adapter/``). With ``qat.quantize_lora`` the two are the same model."""
        loss = getattr(unmerged, "loss", None)
        if self.recipe.lora is None or loss is None or self.plan.mode == "fsdp":  # FSDP: sharded weights
            return []
        with swapped(self.model, merged_quant_layers(self.model)):
            merged = self.evaluate()
        change = merged.loss - loss
        what = ("what quantized/ holds" if self.recipe.qat is not None and self.recipe.qat.quantize_lora
                else "re-quantized; quantized/ with adapter/ is the unmerged model")
        return [("merged integer", f"held-out loss {merged.loss:.4f} against {loss:.4f} unmerged "
                                   f"({change:+.4f}; Q(W + BA), {what})")]

    def _save_result(self, folder: Path) -> Path:
        streamed = getattr(self.task, "save_streamed", None)  # FSDP full fine-tune: one file's tensors at a time
        out = streamed(self.world, self.model, self.tokenizer, folder) if streamed is not None else None
        if out is not None:
            return cast(Path, out)
        return main_writes(self.world, self.model, self.task.save, self.model, self.tokenizer, folder,
                           trainable_only=self.recipe.lora is not None)  # an adapter: no base gathered

    def _finish(self, metrics: MetricsLogger, before: Any, after: Any, final_loss: float | None) -> TrainResult:
        """Save the result (and a QAT run's integer model), plot, and summarise."""
        if after is None:
            after = self.evaluate()
        self.console.say("saving ...")
        watchdog.beat("checkpoint")
        output = self._save_result(self.run.root)
        quantized = (main_writes(self.world, self.model, save_qat_model, self.model, self.tokenizer,
                                 self.run.quantized) if self.recipe.qat is not None else None)
        if self.recipe.qat is not None and self.recipe.lora is not None:  # the adapter's base learned its steps
            main_writes(self.world, self.model, save_quantizer_state, self.model, output)
        main = self.world.main_only
        main(plot_loss_curve, metrics.path, self.run.loss_curve)
        if self.moe is not None:
            main(plot_expert_load, metrics.path, self.run.expert_load)
        rows = [("output", str(output)), *[("note", note) for note in [*self.plan.notes, *self.data.notes]]]
        if self.early_stopping.reason is not None and (metrics.last_step or 0) < self.recipe.training.max_steps:
            rows.append(("stopped early", self.early_stopping.reason))
        if self.schedule_change is not None:
            rows.append(("schedule", self.schedule_change))
        if self.guard.total:
            rows.append(("skipped steps", f"{self.guard.total} update(s) dropped for NaN/inf "
                                          "(training.nonfinite: skip); see 'skipped' in metrics.jsonl"))
        if quantized is not None:
            size = sum(f.stat().st_size for f in quantized.glob("*.safetensors")) / 2**20
            qat = self.recipe.qat
            assert qat is not None
            rows.append(("quantized", f"{quantized} ({qat.bits}-bit codes; weights {size:.2f} MiB on disk)"))
            rows += self._merged_report(after)
        rows += self._distributed_rows()
        rows += self.task.finish(self.model, self.tokenizer, self.data.validation, self.run.root, output, before,
                                 after)
        metrics.log_artifacts(run_artifacts(self.run.root))  # rank 0's trackers: the plots and report, now written
        summary = metrics.summary(checkpoint=self._last_checkpoint or latest_checkpoint(self.run.root), extra=rows,
                                  perplexity=self.task.perplexity)
        return TrainResult(run_dir=self.run.root, steps=metrics.last_step or 0, summary=summary,
                           final_loss=final_loss, eval_before=before, eval_after=after,
                           checkpoint=latest_checkpoint(self.run.root), output=output, quantized=quantized)


__all__ = ["TrainResult", "Trainer"]
