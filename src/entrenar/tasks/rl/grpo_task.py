"""GRPOTask: GRPO on the one training loop (the Task protocol, tasks/base.py), around the :class:`GRPO` engine.

Its examples are prompts with the data's other columns (handed to the reward functions); its stream yields
``training.batch_size`` prompts a micro-batch, resumably, and carries the sampler's RNG in its state (so the
Trainer's checkpoint of the stream keeps it). The sampler is seeded for each micro-batch from ``training.seed`` and
the micro-batch's number in the stream (:func:`sampler_seed`): ranks, which take different micro-batches, draw
different completions, and a resumed run (the number is in the stream's state) draws the same ones. ``loss_sum`` is
one rollout (``task.num_generations`` completions of each prompt, scored, group-relative advantages) then its
loss. With ``task.num_iterations`` 1 (TRL's default) that is one optimisation step per generation batch (the
clipped ratio equals 1 in value and clips nothing, the gradient is the policy gradient); with k > 1 the stream
gives each step's micro-batches k times and the task reuses their rollouts, the ratio taken against the sampling
policy's log-probabilities. Each micro-batch's loss is normalised within its
generation batch (``task.loss_type``), and the step averages its micro-batches. Loading and saving are the
language model's (:class:`~entrenar.tasks.causal_lm.CausalLMTask`); the reference of ``task.kl_beta`` is the
model with its adapters off. The evaluation is the mean reward of greedy completions of held-out prompts.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from entrenar.config import Recipe
from entrenar.data import read_records
from entrenar.data.batching import EpochCursor, check_stream_state
from entrenar.data.formats import split_format
from entrenar.data.sources import Skip
from entrenar.data.tokenizer import Tokenizer
from entrenar.distributed.steps import accumulation
from entrenar.errors import CheckpointError, ConfigError, DataError
from entrenar.generation.batched import SamplingConfig, generate_batch
from entrenar.loading.runs import brings_adapter
from entrenar.models.transformer import Transformer, compute_device
from entrenar.tasks.base import Batch, SummaryRow
from entrenar.tasks.causal_lm import CausalLMTask
from entrenar.tasks.layout import Rollout, TaskLayout
from entrenar.tasks.rl.logprobs import completion_logprobs, plain_head
from entrenar.tasks.rl.objective import Objective, grpo_loss
from entrenar.tasks.rl.rewards import Reward, resolve, score
from entrenar.tasks.rl.task import GRPO, GRPOSettings, write_samples
from entrenar.train.metrics import read_metrics

if TYPE_CHECKING:
    from entrenar.train.metrics import MetricsLogger

SAMPLES_FILE = "samples.jsonl"  # in the run folder: sample completions with their rewards, every samples_every steps
REWARD = "reward"  # the held-out metric that picks the best checkpoint (higher is better)


@dataclass(frozen=True)
class PromptExample:
    """A prompt's token ids and the data's other columns (the reward functions' keyword arguments)."""

    prompt_ids: tuple[int, ...]
    columns: dict[str, Any]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _encode_state(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _decode_state(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())


class PromptStream:
    """An endless, deterministic stream of micro-batches of ``batch_size`` prompts, epoch after epoch in an order
    drawn from ``(seed, epoch)``; its state (``state_dict``, JSON) holds the position and the sampler's RNG.

    With ``num_iterations`` k > 1, each optimizer step's micro-batches (``per_step`` of them over all ranks) are
    given again for the next k - 1 steps (TRL's repeated sampler): the task samples on the first and reuses the
    generation batch on the others. A batch carries ``batch_number`` (1, 2, ... over ranks and steps),
    ``iteration`` (0 to k - 1), ``slot`` (its place in the step) and ``generation`` (the number of the fresh
    micro-batch it repeats, which seeds its sampler)."""

    def __init__(self, examples: Sequence[PromptExample], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 generator: torch.Generator | None = None, num_iterations: int = 1, per_step: int = 1) -> None:
        if not examples:
            raise DataError("data.train: no prompts to train on")
        if batch_size < 1:
            raise ConfigError(f"training.batch_size must be >= 1, got {batch_size}")
        self.examples, self.batch_size, self.shuffle, self.seed = examples, batch_size, shuffle, seed
        self.generator = generator if generator is not None else torch.Generator().manual_seed(seed)
        self.cursor = EpochCursor(len(examples), shuffle, seed)  # the seeded order the other streams visit
        self.batches = 0
        self.num_iterations, self.per_step = num_iterations, per_step
        self.group: dict[int, list[int]] = {}  # slot -> prompt indices of this rank's micro-batches of the group

    def __iter__(self) -> PromptStream:
        return self

    def _place(self, number: int) -> tuple[int, int, int]:
        """(iteration, slot, generation) of micro-batch ``number``."""
        step, slot = divmod(number - 1, self.per_step)
        group, iteration = divmod(step, self.num_iterations)
        return iteration, slot, group * self.per_step + slot + 1

    def __next__(self) -> Batch:
        self.batches += 1
        iteration, slot, generation = self._place(self.batches)
        if iteration == 0:
            self.group[slot] = list(self.cursor.take(self.batch_size))
        batch = prompt_batch(self.examples, self.group[slot], self.batches)
        batch.update(iteration=iteration, slot=slot, generation=generation)
        return batch

    def rows_per_epoch(self) -> int:
        """Prompts of one epoch (what ``training.batch_size`` counts), each given ``num_iterations`` times."""
        return len(self.examples) * self.num_iterations

    def skip(self, batches: int) -> None:
        """Move past ``batches`` micro-batches (another rank's share of a step)."""
        for _ in range(batches):
            self.batches += 1
            if self._place(self.batches)[0] == 0:
                self.cursor.take(self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is and the sampler's RNG, as JSON-able values."""
        state: dict[str, Any] = {"epoch": self.cursor.epoch, "position": self.cursor.position,
                                 "batches": self.batches, "num_examples": len(self.examples), "seed": self.seed,
                                 "stream": "grpo", "sampler": _encode_state(self.generator)}
        if self.num_iterations > 1:  # a checkpoint within a group: the prompts its next steps repeat
            state["group"] = {str(k): v for k, v in self.group.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, the sampler's RNG included; refuses a state of other data or another seed."""
        try:
            epoch, position, batches = int(state["epoch"]), int(state["position"]), int(state["batches"])
            sampler = _decode_state(str(state["sampler"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"data stream state lacks integer 'epoch', 'position', 'batches' or the "
                                  f"'sampler' RNG of a GRPO run: {e}") from e
        check_stream_state(state, {"num_examples": len(self.examples), "seed": self.seed, "stream": "grpo"},
                           epoch, position, unit="prompts")
        try:
            self.generator.set_state(sampler)
        except RuntimeError as e:
            raise CheckpointError(f"data stream state: the sampler's RNG state is not one: {e}") from e
        self.cursor.seek(epoch, position)
        self.batches = batches
        try:
            self.group = {int(k): [int(i) for i in v] for k, v in dict(state.get("group") or {}).items()}
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"data stream state: 'group' is not the prompts of a generation batch: {e}") from e
        if any(not 0 <= i < len(self.examples) for v in self.group.values() for i in v):
            raise CheckpointError("data stream state: 'group' names prompts this data does not have")


def prompt_batch(examples: Sequence[PromptExample], indices: Sequence[int], number: int = 0) -> Batch:
    """A micro-batch: the prompts' ids (lists), their columns, ``example_index`` and ``document_ids`` (0 on each
    prompt token, -1 on padding: what the loop counts as the step's tokens)."""
    prompts = [list(examples[i].prompt_ids) for i in indices]
    width = max(len(p) for p in prompts)
    documents = torch.tensor([[0] * len(p) + [-1] * (width - len(p)) for p in prompts])
    keys = dict.fromkeys(k for i in indices for k in examples[i].columns)
    columns = {k: [examples[i].columns.get(k) for i in indices] for k in keys}
    return {"prompt_ids": prompts, "columns": columns, "example_index": torch.tensor(list(indices)),
            "document_ids": documents, "batch_number": number}


def sampler_seed(seed: int, batch_number: int) -> int:
    """The sampler's seed for micro-batch ``batch_number`` of the stream (numbered across ranks and steps).

    Each micro-batch samples from its own seed, so ranks (which take different micro-batches of a step) draw
    different completions, and the completions depend on neither the number of processes nor what ran before:
    a resumed run, whose stream state holds the micro-batch count, draws the same ones.
    """
    return (seed * 0x9E3779B97F4A7C15 + batch_number * 0xBF58476D1CE4E5B9) % (1 << 63)


def rewards_of(recipe: Recipe) -> list[Reward]:
    """The recipe's reward functions (``reward`` section) with their weights."""
    r = recipe.reward
    weights = r.weights or (1.0,) * len(r.functions)
    return [Reward(name, resolve(name, answer_marker=r.answer_marker, format_regex=r.format_regex,
                                 target_length=r.target_length), weight)
            for name, weight in zip(r.functions, weights, strict=True)]


def settings_of(recipe: Recipe, stop_ids: Sequence[int] = ()) -> GRPOSettings:
    """The engine's settings from the recipe's ``task`` section."""
    t = recipe.task
    sampling = SamplingConfig(max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_k=t.top_k,
                              top_p=t.top_p, min_p=t.min_p, cuda_graphs=t.decode_cuda_graphs)
    objective = Objective(loss_type=t.loss_type, beta=t.kl_beta, epsilon=t.epsilon, epsilon_high=t.epsilon_high,
                          importance_sampling_level=t.importance_sampling_level,
                          max_completion_length=t.max_new_tokens, scale_rewards=t.scale_rewards)
    return GRPOSettings(num_generations=t.num_generations, num_iterations=t.num_iterations, sampling=sampling,
                        objective=objective, stop_ids=tuple(stop_ids))


def rollout_of(recipe: Recipe) -> Rollout:
    """What a micro-batch samples before its loss (the memory estimate's :class:`Rollout`): ``task.num_generations``
    completions of each prompt in one batch of up to ``task.max_new_tokens`` tokens; the reference's (``kl_beta``
    > 0) and the sampling policy's (``num_iterations`` > 1) log-probabilities are no-grad passes over all of them."""
    t = recipe.task
    filtered = t.top_k > 0 or t.top_p < 1.0 or t.min_p > 0.0
    return Rollout(sequences=t.num_generations, new_tokens=t.max_new_tokens, filtered=filtered,
                   scoring_passes=int(t.kl_beta > 0) + int(t.num_iterations > 1))


@dataclass
class GRPOEval:
    """A held-out evaluation: the mean total reward of greedy completions, and each function's mean."""

    reward: float
    metrics: dict[str, float]
    examples: int


@dataclass
class GRPOTask:
    """The Task protocol for GRPO; ``load`` and ``save`` are the language model's."""

    recipe: Recipe
    kernels: bool = False
    name: str = "grpo"
    perplexity: bool = False
    # One forward reads every completion of the micro-batch's prompts; a plain head is read chunk by chunk
    # (tasks.rl.logprobs) whatever the kernels; the sampler's decode step may replay from a CUDA graph.
    layout: ClassVar[TaskLayout] = TaskLayout(no_cuda_graphs="a grpo task's batches vary in layout",
                                              rollout=rollout_of, chunked_head=True, decode_graphs=True)
    fixed_layout: ClassVar[None] = None  # rows laid out as rows (tasks.base.FixedLayout)
    _lm: CausalLMTask = field(init=False, repr=False)
    _engine: GRPO | None = field(default=None, repr=False)
    _model: Transformer | None = field(default=None, repr=False)
    _tokenizer: Tokenizer | None = field(default=None, repr=False)
    _generator: torch.Generator = field(init=False, repr=False)
    _device_generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _step: list[dict[str, float]] = field(default_factory=list, repr=False)
    _best: float | None = field(default=None, repr=False)
    _rollouts: dict[int, Any] = field(default_factory=dict, repr=False)  # slot -> the generation batch reused

    def __post_init__(self) -> None:
        k, t = self.recipe.task.num_iterations, self.recipe.training
        for key, every in (("save_every", t.save_every), ("eval_every", t.eval_every)):
            if k > 1 and every % k:  # a checkpoint amid a generation batch's steps could not resume it exactly
                raise ConfigError(f"training.{key} ({every}) must be a multiple of task.num_iterations ({k}): "
                                  "checkpoints fall between generation batches")
        self._lm = CausalLMTask(self.recipe, kernels=self.kernels)
        self._generator = torch.Generator().manual_seed(self.recipe.training.seed)
        rewards_of(self.recipe)  # a reward that cannot be imported is refused before the model loads

    # -- model ------------------------------------------------------------------------------------------

    def load(self, dtype: str, device: torch.device, quantize: str | None) -> tuple[Transformer, Tokenizer | None]:
        return self._lm.load(dtype, device, quantize)

    def save(self, model: Transformer, tokenizer: Tokenizer, folder: Path) -> Path:
        """The adapter (LoRA) or the whole model folder, as a language-model run saves it."""
        return self._lm.save(model, tokenizer, folder)

    def head_state(self, model: Transformer) -> dict[str, torch.Tensor]:
        return {}

    def prepare(self, model: Transformer) -> None:
        if self.recipe.task.kl_beta > 0 and brings_adapter(self.recipe.model.path):
            raise ConfigError(f"task.kl_beta: the KL reference is the model with its adapters off, and "
                              f"{self.recipe.model.path} brings the adapter training starts from, so it would be the "
                              "bare base, not that policy; merge the adapter into its base (entrenar export --merge) "
                              "and train a new one from there, or set task.kl_beta: 0")
        self._model = model

    def begin(self, model: Transformer, tokenizer: Tokenizer) -> None:
        """Nothing: the evaluation before training is the baseline."""

    def _sampler(self, seed: int) -> torch.Generator:
        """The RNG a rollout samples with, seeded per generation batch: the stream's (CPU) one on a CPU, one on the
        model's GPU there, so that each token is drawn where its probabilities are (a copy of them to the host and
        a host draw every token ran the H100's GRPO step at a third of TRL's)."""
        device = compute_device(self._model) if self._model is not None else torch.device("cpu")
        if device.type == "cpu":
            return self._generator
        if self._device_generator is None or self._device_generator.device != device:
            self._device_generator = torch.Generator(device=device)
        return self._device_generator.manual_seed(seed)

    def engine(self, model: Transformer, tokenizer: Tokenizer) -> GRPO:
        """The GRPO engine over ``model`` (built once), sampling with the stream's RNG."""
        if self._engine is None:
            self._engine = GRPO(model, rewards_of(self.recipe), settings_of(self.recipe, tokenizer.eos_ids),
                                tokenizer.decode, seed=self.recipe.training.seed)
            self._engine.generator = self._generator
        return self._engine

    # -- data -------------------------------------------------------------------------------------------

    def read(self, path: str, role: str, tokenizer: Tokenizer, skipped: list[Skip],
             format: str | None = None) -> tuple[list, list[str]]:
        """Prompts (data.prompt_field) of one data file with the record's other columns; reward.answer_field is
        handed to the rewards as ``answer``."""
        d, r = self.recipe.data, self.recipe.reward
        self._tokenizer = tokenizer
        file_format, _ = split_format(format or d.format)
        records, stats = read_records(path, format=file_format, on_error=d.on_error, seed=self.recipe.training.seed,
                                      query=d.query, attach=d.attach)
        skipped.extend(stats.skipped_records)
        examples, cut = [], 0
        limit = d.seq_len - self.recipe.task.max_new_tokens
        if limit < 1:
            raise ConfigError(f"data.seq_len ({d.seq_len}) must exceed task.max_new_tokens "
                              f"({self.recipe.task.max_new_tokens}): a prompt and its completion fit in seq_len")
        for record in records:
            prompt = record.fields.get(d.prompt_field)
            if not isinstance(prompt, str) or not prompt:
                raise DataError(f"data.{role} ({record.file} {record.location}): no text in the prompt field "
                                f"{d.prompt_field!r} (data.prompt_field)")
            ids = tokenizer.encode(prompt)
            if len(ids) > limit:
                ids, cut = ids[-limit:], cut + 1  # the end of a prompt is what the completion continues
            columns = {k: v for k, v in record.fields.items() if k != d.prompt_field}
            if r.answer_field in columns and r.answer_field != "answer":
                columns["answer"] = columns[r.answer_field]
            examples.append(PromptExample(tuple(ids), columns))
        if not examples:
            raise DataError(f"data.{role} ({path}): no prompts")
        notes = [f"data.{role}: {cut} prompt(s) cut to their last {limit} tokens (data.seq_len - task.max_new_tokens)"
                 ] if cut else []
        if stats.skipped:
            notes.append(f"data.{role}: {stats.skipped} malformed record(s) skipped")
        return examples, notes

    def stream(self, examples: list, tokenizer: Tokenizer) -> tuple[Any, list[str]]:
        d, t = self.recipe.data, self.recipe.training
        self._tokenizer = tokenizer
        return PromptStream(examples, t.batch_size, shuffle=d.shuffle, seed=t.seed, generator=self._generator,
                            num_iterations=self.recipe.task.num_iterations, per_step=self._batches_per_step()), []

    def num_targets(self, batch: Batch) -> float:
        """1 per micro-batch: each is a generation batch whose loss is normalised within it; a step averages
        them."""
        return 1.0

    # -- loss -------------------------------------------------------------------------------------------

    def loss_sum(self, model: Any, batch: Batch) -> torch.Tensor:
        """A rollout of the micro-batch's prompts (with the model itself: the KV cache), then its loss through
        ``model`` (or its parallel wrapper)."""
        assert self._model is not None and self._tokenizer is not None  # prepare() and stream() ran
        engine = self.engine(self._model, self._tokenizer)
        number = int(batch.get("batch_number", 0))
        slot = int(batch.get("slot", 0))
        rollout = self._rollouts.get(slot) if int(batch.get("iteration", 0)) > 0 else None
        if rollout is None:  # a fresh generation batch (or one whose rollout a resume did not keep: sampled anew)
            seed = sampler_seed(self.recipe.training.seed, int(batch.get("generation", number)))
            self._generator.manual_seed(seed)
            engine.generator = self._sampler(seed)
            with torch.autocast(compute_device(self._model).type, enabled=False):
                rollout = engine.rollout(batch["prompt_ids"], batch["columns"])
            if engine.settings.num_iterations > 1:
                self._rollouts[slot] = rollout
        length = rollout.generated.completion_ids.shape[1]
        logps = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, length,
                                    plain_head(self._model), temperature=engine._temperature)
        parts = grpo_loss(logps, rollout.advantages, rollout.generated.completion_mask, engine.settings.objective,
                          old_logps=rollout.old_logps, ref_logps=rollout.ref_logps)
        self._step.append(engine.metrics(rollout, parts))
        every, per_step = self.recipe.task.samples_every, self._batches_per_step()
        step, first = (number - 1) // per_step + 1, (number - 1) % per_step == 0  # rank 0's first of its step
        if every and step % every == 0 and first:
            run = Path(self.recipe.output.dir)
            run.mkdir(parents=True, exist_ok=True)
            write_samples(run / SAMPLES_FILE, step, rollout)
        return parts.loss

    def _batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over all ranks (the stream numbers them 1, 2, ... across ranks)."""
        t, world = self.recipe.training, int(os.environ.get("WORLD_SIZE", "1"))
        return accumulation(t.batch_size, t.grad_accum, t.global_batch_size, world) * world

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The engine's metrics of the step's rollouts (means over its micro-batches): rewards per function and in
        total, completion lengths, KL and clip fractions."""
        step, self._step = self._step, []
        if not step:
            return {}
        device = compute_device(self._model) if self._model is not None else torch.device("cpu")
        return {k: torch.tensor(sum(m[k] for m in step) / len(step), device=device) for k in step[0]}

    # -- evaluation -------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: Transformer, examples: list, tokenizer: Tokenizer) -> GRPOEval:
        """Mean reward of greedy completions of the held-out prompts (the first training.eval_batches
        micro-batches)."""
        t = self.recipe.training
        rewards, settings = rewards_of(self.recipe), settings_of(self.recipe, tokenizer.eos_ids)
        greedy = SamplingConfig(max_new_tokens=settings.sampling.max_new_tokens, temperature=0.0,
                                cuda_graphs=settings.sampling.cuda_graphs)
        starts = list(range(0, len(examples), t.batch_size))
        starts = starts[:t.eval_batches] if t.eval_batches else starts
        totals: list[torch.Tensor] = []
        per: list[torch.Tensor] = []
        for start in starts:
            batch = prompt_batch(examples, range(start, min(start + t.batch_size, len(examples))))
            out = generate_batch(model, batch["prompt_ids"], greedy, 1, settings.stop_ids)
            completions = [tokenizer.decode(row[: int(m.sum())].tolist())
                           for row, m in zip(out.completion_ids, out.completion_mask, strict=True)]
            prompts = [tokenizer.decode(p) for p in batch["prompt_ids"]]
            total, each = score(rewards, prompts, completions, batch["columns"])
            totals.append(total)
            per.append(each)
        total, each = torch.cat(totals), torch.cat(per)
        metrics = {REWARD: float(total.mean()),
                   **{f"rewards/{r.name}/mean": float(each[:, j].mean()) for j, r in enumerate(rewards)}}
        return GRPOEval(reward=float(total.mean()), metrics=metrics, examples=int(total.numel()))

    def log_eval(self, metrics: MetricsLogger, step: int, result: GRPOEval) -> bool:
        """Log the evaluation (``eval_reward``, ``eval_rewards/NAME/mean``); True when its mean reward is the
        highest so far."""
        if self._best is None:  # a resumed run: the best so far is in the metrics kept up to the resumed step
            logged = read_metrics(metrics.path) if metrics.path.is_file() else []
            self._best = max((r[f"eval_{REWARD}"] for r in logged if r.get(f"eval_{REWARD}") is not None),
                             default=None)
        metrics._write({"step": int(step), **{f"eval_{k}": v for k, v in result.metrics.items()}})
        if self._best is not None and result.reward <= self._best:
            return False
        self._best = result.reward
        return True

    def eval_scalars(self, result: GRPOEval) -> dict[str, float]:
        """The mean reward first, then each function's."""
        return {f"eval_{k}": v for k, v in result.metrics.items()}

    def finish(self, model: Transformer, tokenizer: Tokenizer, validation: list, run_dir: Path, output: Path,
               before: GRPOEval | None, after: GRPOEval | None) -> list[SummaryRow]:
        """The held-out mean reward of greedy completions before and after training."""
        if after is None:
            return []
        start = f"{before.reward:.3f} -> " if before is not None else ""
        return [("held-out mean reward", f"{start}{after.reward:.3f} (greedy, {after.examples} prompts)")]


__all__ = ["GRPOEval", "GRPOTask", "PromptExample", "PromptStream", "prompt_batch", "rewards_of", "rollout_of",
           "sampler_seed", "settings_of"]
