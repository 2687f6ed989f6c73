"""PreferenceTask: DPO, IPO, SimPO, ORPO or KTO on the one training loop (the Task protocol, tasks/base.py).

It loads and saves as :class:`~entrenar.tasks.causal_lm.CausalLMTask` does (a language model, its adapter or its
folder), reads preference data (:mod:`entrenar.data.preference`), and scores a micro-batch by the summed loss of
its pairs (or KTO's examples, :mod:`.scoring`): the step divides by the step's pairs, so accumulation gives one
large batch's mean. The reference model (:mod:`.reference`) is the same model with its adapters switched off under
LoRA/QLoRA, or a frozen copy under full fine-tuning. TRL's metrics (:mod:`.metrics`) are logged per step and per
evaluation; the held-out ``rewards/accuracies`` picks the best checkpoint. Under CUDA graphs the task lays each
micro-batch out itself in one fixed layout (:meth:`PreferenceTask.graph_layout`, its ``fixed_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from entrenar.config import Recipe
from entrenar.data.formats import split_format
from entrenar.data.preference import PreferenceStream, preference_eval_batches, read_preference_file
from entrenar.data.preference_static import StaticCapacity, is_static, static_capacity, static_preference_batch
from entrenar.data.sources import Skip
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ConfigError
from entrenar.evaluation.loss import autocast_for
from entrenar.models.transformer import Transformer, compute_device
from entrenar.tasks.base import Batch, FixedLayout, SummaryRow
from entrenar.tasks.causal_lm import CausalLMTask
from entrenar.tasks.layout import TaskLayout
from entrenar.tasks.preference.logprobs import plain_head, sequence_logprobs
from entrenar.tasks.preference.metrics import (
    ACCURACY,
    MetricSums,
    PreferenceEval,
    accuracy_rows,
    best_logged,
    score,
)
from entrenar.tasks.preference.reference import Reference, graphs_refusal, reference_of
from entrenar.tasks.preference.scoring import batch_losses
from entrenar.tasks.preference.sharing import SHARE_PROMPT_MIN_HIDDEN, may_share, share_prompt_of, shares_prompt

if TYPE_CHECKING:
    from entrenar.train.metrics import MetricsLogger


@dataclass
class PreferenceTask:
    """The Task protocol for preference optimisation; ``load`` and ``save`` are the language model's
    (:class:`~entrenar.tasks.causal_lm.CausalLMTask`'s, which it holds)."""

    recipe: Recipe
    kernels: bool = False  # the plan's; log-probabilities are chunked either way
    name: str = "preference"
    perplexity: bool = False
    # Two sequences an example; log-probabilities read the head chunk by chunk; pairs vary in layout, so graphs
    # replay them in the task's own fixed layout (graph_layout) and auto rows are padding-free on a GPU too.
    layout: ClassVar[TaskLayout] = TaskLayout(
        sequences_per_example=2, documents=True, fused_head=True, reference=reference_of,
        prompt_sharing=share_prompt_of, own_graph_layout=lambda recipe: graphs_refusal(recipe))
    reference: Reference = field(init=False, repr=False)  # the reference model (task.reference)
    _lm: CausalLMTask = field(init=False, repr=False)
    _head: nn.Linear | None = field(default=None, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)
    _step: MetricSums = field(default_factory=MetricSums, repr=False)
    _best: tuple[float, float] | None = field(default=None, repr=False)  # the score of the best evaluation
    _train: list = field(default_factory=list, repr=False)
    # tokens of the training batches: as counted (each sequence whole, TRL's count) and as computed (shared prompts)
    _counted: int = field(default=0, repr=False)
    _computed: int = field(default=0, repr=False)
    # CUDA graphs (:meth:`graph_layout`): the fixed layout's capacities, and the metrics of the last micro-step
    _capacity: StaticCapacity | None = field(default=None, repr=False)
    _pending: torch.Tensor | None = field(default=None, repr=False)
    _pending_names: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._lm = CausalLMTask(self.recipe, kernels=self.kernels)
        self.reference = Reference(self.recipe)

    @property
    def fixed_layout(self) -> FixedLayout:
        """This task: it lays its pairs out in one fixed layout under CUDA graphs (:meth:`graph_layout`)."""
        return self

    # -- model ------------------------------------------------------------------------------------------

    def load(self, dtype: str, device: torch.device, quantize: str | None) -> tuple[Transformer, Tokenizer | None]:
        """The recipe's model, as a language-model run loads it."""
        return self._lm.load(dtype, device, quantize)

    def save(self, model: Transformer, tokenizer: Tokenizer, folder: Path) -> Path:
        """The adapter (LoRA) or the whole model folder, as a language-model run saves it."""
        return self._lm.save(model, tokenizer, folder)

    def head_state(self, model: Transformer) -> dict[str, torch.Tensor]:
        return {}

    def begin(self, model: Transformer, tokenizer: Tokenizer) -> None:
        """Nothing: the evaluation before training is the baseline."""

    def prepare(self, model: Transformer, reference: nn.Module | None = None) -> None:
        """The output head the log-probabilities are gathered through, and the reference model (``reference``: a
        separate one to compare with instead of what ``task.reference`` makes of ``model``, for ``entrenar
        eval``)."""
        self._head = plain_head(model)
        self._model = model
        self.reference.prepare(model, reference)

    # -- data -------------------------------------------------------------------------------------------

    def read(self, path: str, role: str, tokenizer: Tokenizer, skipped: list[Skip],
             format: str | None = None) -> tuple[list, list[str]]:
        """Pairs (or KTO's unpaired examples) of one data file, as TRL's formats hold them."""
        d = self.recipe.data
        file_format, _ = split_format(format or d.format)
        columns = {"prompt": d.prompt_field, "chosen": d.chosen_field, "rejected": d.rejected_field,
                   "completion": d.completion_field, "label": d.label_field}
        examples, left_out, notes = read_preference_file(
            path, tokenizer, seq_len=d.seq_len, kind="unpaired" if self.recipe.task.loss == "kto" else "pairs",
            columns=columns, on_error=d.on_error, seed=self.recipe.training.seed, query=d.query, format=file_format,
            key=f"data.{role}")
        skipped.extend(left_out)
        self.reference.examples.extend(examples)
        return list(examples), notes

    def stream(self, examples: list, tokenizer: Tokenizer) -> tuple[Any, list[str]]:
        d, t = self.recipe.data, self.recipe.training
        self._train = examples
        return PreferenceStream(examples, t.batch_size, d.seq_len, packing=d.packing, shuffle=d.shuffle,
                                seed=t.seed, pad_id=tokenizer.pad_id or 0, kl=self.recipe.task.loss == "kto",
                                share_prompt=self._may_share()), []

    def _may_share(self) -> bool:
        """Whether batches carry the shared-prompt layout (``task.share_prompt`` may pick it)."""
        return may_share(self.recipe, self._model)

    def _shared(self, batch: Batch) -> bool:
        """Whether this batch runs with each prompt once (:func:`~.sharing.shares_prompt`)."""
        return shares_prompt(self.recipe, batch, self._model)

    def num_targets(self, batch: Batch) -> float:
        """Pairs (or KTO examples): the loss of a step is the mean over its pairs."""
        return float(len(batch["example_index"]))

    # -- loss -------------------------------------------------------------------------------------------

    def _losses(self, model: Any, batch: Batch, sums: MetricSums, examples: list) -> torch.Tensor:
        """The per-pair (per-example) losses of a batch, their metrics added to ``sums``; ``examples``: the list
        the batch's example_index points into."""
        shared = self._shared(batch)
        # The reference first: its no-grad pass is done (and its transients, a tied table's copy among them, freed)
        # before the policy's forward keeps what its backward needs.
        ref = self.reference.logprobs(batch, examples, shared)
        logps, tokens = sequence_logprobs(model, batch, self._head, shared=shared)
        return batch_losses(self.recipe.task, batch, logps, tokens, ref, sums)

    def loss_sum(self, model: Any, batch: Batch) -> torch.Tensor:
        """The summed loss of the micro-batch's pairs (or KTO examples), through ``model`` or its wrapper. A batch in
        the fixed layout (:meth:`graph_layout`) keeps its metrics for :meth:`micro_stats` instead of adding them:
        a replayed graph runs none of this Python."""
        if is_static(batch):
            sums = MetricSums()
            per_pair = self._losses(model, batch, sums, self._train)
            self._pending_names, self._pending = sums.packed()
            return per_pair.sum()
        self._count_tokens(batch, self._shared(batch))
        return self._losses(model, batch, self._step, self._train).sum()

    def _count_tokens(self, batch: Batch, shared: bool) -> None:
        if "shared_tokens" in batch:  # host ints: the tokens of the rows (each sequence whole) and of the layout
            counted = int(batch["shared_counted_tokens"])
            self._counted += counted
            self._computed += int(batch["shared_tokens"]) if shared else counted

    def graph_layout(self, batch: Batch) -> Batch:
        """A micro-batch as collated, in the one fixed layout a CUDA graph replays (the trainer's layout under
        ``training.cuda_graphs``, :mod:`entrenar.data.preference_static`): capacities from the training examples,
        padded pairs weighted zero, its prompts shared as ``task.share_prompt`` says for padding-free rows."""
        if self._capacity is None:
            d, t = self.recipe.data, self.recipe.training
            if not self._train:
                raise ConfigError("preference graph layout: no training examples read (stream() first)")
            self._capacity = static_capacity(self._train, t.batch_size, d.seq_len, kl=self.recipe.task.loss == "kto")
        shared = "shared_input_ids" in batch and self._may_share()
        self._count_tokens(batch, shared)
        return static_preference_batch(batch, self._capacity, shared)

    def micro_stats(self) -> torch.Tensor | None:
        """The metrics' sums and counts of the micro-batch :meth:`loss_sum` just scored in the fixed layout (None
        otherwise): the micro-step returns them beside its loss, so a replayed graph hands back its own."""
        pending, self._pending = self._pending, None
        return pending

    def add_micro_stats(self, stats: torch.Tensor) -> None:
        """Add a micro-step's :meth:`micro_stats` (as the step returned them) to the step's metrics."""
        self._step.merge(self._pending_names, stats)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """TRL's metrics of the step's micro-batches (means over its pairs)."""
        means, self._step = self._step.means(), MetricSums()
        return means

    # -- evaluation -------------------------------------------------------------------------------------

    def evaluate(self, model: Transformer, examples: list, tokenizer: Tokenizer) -> PreferenceEval:
        """Mean loss and TRL's metrics over held-out pairs (the first training.eval_batches micro-batches)."""
        d, t = self.recipe.data, self.recipe.training
        batches = preference_eval_batches(examples, t.batch_size, d.seq_len, packing=d.packing,
                                          pad_id=tokenizer.pad_id or 0, kl=self.recipe.task.loss == "kto",
                                          share_prompt=self._may_share())
        return self.evaluate_batches(model, batches[:t.eval_batches] if t.eval_batches else batches, examples)

    @torch.no_grad()
    def evaluate_batches(self, model: Transformer, batches: list[Batch], examples: list) -> PreferenceEval:
        """:meth:`evaluate` over batches of ``examples`` already laid out."""
        if self._model is None:
            self.prepare(model)
        device = compute_device(model)
        was_training = model.training
        model.eval()
        sums, total, count = MetricSums(), torch.zeros((), dtype=torch.float64, device=device), 0
        try:
            for batch in batches:
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                with autocast_for(device, self.recipe.training.precision):
                    per_pair = self._losses(model, batch, sums, examples)
                total += per_pair.double().sum()
                count += len(batch["example_index"])
        finally:
            model.train(was_training)
        metrics = {k: float(v) for k, v in sums.means().items() if bool(torch.isfinite(v))}
        return PreferenceEval(loss=float(total) / max(count, 1), metrics=metrics, examples=count)

    def log_eval(self, metrics: MetricsLogger, step: int, result: PreferenceEval) -> bool:
        """Log the evaluation with TRL's names; True when its preference accuracy is the best so far (ties: the
        lower loss)."""
        if self._best is None:  # a resumed run: the best so far is in the metrics kept up to the resumed step
            self._best = best_logged(metrics.path, self.recipe.task.loss == "kto")
        metrics.log_eval(step, result.loss)
        metrics._write({"step": int(step), **{f"eval_{k}": v for k, v in result.metrics.items()}})
        now = score(result, self.recipe.task.loss == "kto")
        if now != now or (self._best is not None and now <= self._best):  # NaN: never the best
            return False
        self._best = now
        return True

    def eval_scalars(self, result: PreferenceEval) -> dict[str, float]:
        """The loss, then the preference accuracy (pairs), then the other metrics (``eval_`` prefixed, as TRL)."""
        return {"eval_loss": result.loss, **{f"eval_{k}": v for k, v in sorted(
            result.metrics.items(), key=lambda item: item[0] != ACCURACY)}}

    def finish(self, model: Transformer, tokenizer: Tokenizer, validation: list, run_dir: Path, output: Path,
               before: PreferenceEval | None, after: PreferenceEval | None) -> list[SummaryRow]:
        """The held-out preference accuracy and margin before and after training, and the tokens computed where
        pairs shared their prompt."""
        rows = accuracy_rows(run_dir, before, after, self.recipe.task.loss == "kto")
        if self._computed < self._counted:
            rows.append(("tokens computed", f"{self._computed:,} of the {self._counted:,} the throughput counts "
                                            "(each pair's prompt once; throughput counts it twice, as TRL "
                                            "computes it)"))
        return rows


# Re-exported where they were defined before the package split them out (imported from here).
__all__ = ["ACCURACY", "SHARE_PROMPT_MIN_HIDDEN", "PreferenceEval", "PreferenceTask", "reference_of",
           "share_prompt_of"]
