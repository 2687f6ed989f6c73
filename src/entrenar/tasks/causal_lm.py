"""Causal language modelling: next-token loss on the target tokens of packed rows.

The default task. Its examples are tokenized records with -100 on the tokens that carry no loss
(``data.train_on``); its batches are packed rows (or padded ones) from a resumable :class:`BatchStream`; its loss
is the summed cross-entropy of the target tokens, through the output projection fused with the loss where the
kernels are on (no ``[tokens, vocab]`` logits); its evaluation is the held-out loss and perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from entrenar.adapters.lora import lora_config_of, save_adapter
from entrenar.config import Recipe
from entrenar.data import BatchStream, eval_batches, num_target_tokens, read_records, tokenize_records
from entrenar.data.formats import split_format
from entrenar.data.report import data_notes, skipped_in_order
from entrenar.data.sources import Skip
from entrenar.data.tokenizer import Tokenizer
from entrenar.distributed.stream_save import save_model_folder_streamed, streams
from entrenar.errors import ConfigError, DataError
from entrenar.evaluation.loss import EvalResult, eval_loss
from entrenar.io import hub
from entrenar.io.run_dir import ADAPTER_DIR, METRICS_FILE, MODEL_DIR
from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy, fused_loss_chunk
from entrenar.kernels.host_embedding import head_weight, plain_head, prefetch_head
from entrenar.loading import load
from entrenar.loading.runs import base_model_name
from entrenar.models import random_init
from entrenar.models.loss import token_cross_entropy
from entrenar.models.saving import save_model_folder
from entrenar.models.transformer import Transformer
from entrenar.quant.qat import master_weights
from entrenar.tasks.base import Batch, SummaryRow
from entrenar.tasks.layout import TaskLayout
from entrenar.train.metrics import read_metrics

if TYPE_CHECKING:
    from entrenar.distributed.world import World
    from entrenar.train.metrics import MetricsLogger


@dataclass
class CausalLMTask:
    recipe: Recipe
    kernels: bool = False  # the plan's: the output projection fused with the loss when the head is plain
    name: str = "causal_lm"
    perplexity: bool = True
    layout: ClassVar[TaskLayout] = TaskLayout(documents=True, fused_head=True, auto_offload_embeddings=True,
                                              model_from_folder=True)
    fixed_layout: ClassVar[None] = None  # rows laid out as rows (tasks.base.FixedLayout)
    _head: nn.Linear | None = field(default=None, repr=False)  # set by prepare() when the loss is fused
    _logits_scaling: float = field(default=1.0, repr=False)  # the model's logits divisor (Granite), set by prepare()
    _softcap: float | None = field(default=None, repr=False)  # the model's final-logit soft cap (Gemma)

    def load(self, dtype: str, device: torch.device, quantize: str | None) -> tuple[Transformer, Tokenizer | None]:
        """The recipe's model: a checkpoint, GGUF file or run (``model.path``), or drawn from ``model.config``."""
        if random_init.is_random(self.recipe):
            if quantize is not None:
                raise ConfigError("lora.quantize_base: a random-init model has no pretrained base to quantize")
            return random_init.build(self.recipe, dtype, device)
        path = self.recipe.model.path
        assert path is not None  # a pretrained recipe names it (Recipe checks; the quickstart resolves its own)
        return load(path, dtype=dtype, device=device, quantize=quantize)

    def prepare(self, model: Transformer) -> None:
        """Nothing to make trainable beyond the adapters; the fused loss needs a plain output head."""
        self._head = plain_head(model) if self.kernels else None
        self._logits_scaling = model.config.logits_scaling  # Granite's, inside the fused loss too
        self._softcap = getattr(model.config, "final_logit_softcapping", None)  # Gemma: inside the fused loss

    def head_state(self, model: Transformer) -> dict[str, torch.Tensor]:
        return {}

    def read(self, path: str, role: str, tokenizer: Tokenizer, skipped: list[Skip],
             format: str | None = None) -> tuple[list, list[str]]:
        """Masked examples of one data file (in ``format``, default data.format), and notes on what was skipped,
        cut or odd."""
        d = self.recipe.data
        file_format, record_format = split_format(format or d.format)
        records, read_stats = read_records(path, format=file_format, on_error=d.on_error,
                                           seed=self.recipe.training.seed,
                                           query=d.query, attach=d.attach)  # synth: from the seed; SQLite: the query
        columns = {"text": d.text_field, "prompt": d.prompt_field, "completion": d.completion_field,
                   "messages": d.messages_field}
        try:
            examples, stats = tokenize_records(records, tokenizer, d.seq_len, kind=record_format, train_on=d.train_on,
                                               add_eos=d.add_eos,
                                               columns=columns, on_error=d.on_error)
        except DataError as e:
            if str(e).startswith("no training examples"):
                raise DataError(f"data.{role} ({path}): {str(e).replace('no training examples', 'no examples', 1)}"
                                ) from None
            raise
        left_out = skipped_in_order(read_stats, stats)
        skipped.extend(left_out)
        notes = data_notes(f"data.{role}", left_out, stats)
        if stats.truncated_examples:
            notes.append(f"data.{role}: {stats.truncated_examples} example(s) cut to seq_len={d.seq_len} "
                         f"({stats.truncated_tokens:,} tokens dropped)")
        if stats.dropped_no_targets:
            notes.append(f"data.{role}: {stats.dropped_no_targets} example(s) left out: nothing to train on within "
                         "seq_len")
        return examples, notes

    def stream(self, examples: list, tokenizer: Tokenizer) -> tuple[BatchStream, list[str]]:
        d, t = self.recipe.data, self.recipe.training
        return BatchStream(examples, t.batch_size, d.seq_len, packing=d.packing, shuffle=d.shuffle, seed=t.seed,
                           pad_id=tokenizer.pad_id or 0), []

    def num_targets(self, batch: Batch) -> float:
        return num_target_tokens(batch)

    def loss_sum(self, model: Any, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy of the micro-batch's target tokens, through ``model`` (or its parallel wrapper)."""
        inputs = (batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
        layout = {"cu_seqlens": batch.get("cu_seqlens"), "max_seqlen": batch.get("max_seqlen")}  # padding-free
        if self._head is not None:  # never the full-vocabulary logits
            prefetch_head(self._head, batch["input_ids"].device)  # a tied table in CPU memory: copied during forward
            hidden = model.hidden_states(*inputs, **layout)
            weight = head_weight(self._head, hidden.device)
            return fused_linear_cross_entropy(hidden, weight, batch["labels"], fused_loss_chunk(weight.shape[0]),
                                              self._logits_scaling, softcap=self._softcap)[0]
        return token_cross_entropy(model(*inputs, **layout), batch["labels"])[0]

    def step_metrics(self) -> dict[str, torch.Tensor]:
        return {}  # the loss is the step's metric

    def evaluate(self, model: Transformer, examples: list, tokenizer: Tokenizer) -> EvalResult:
        d, t = self.recipe.data, self.recipe.training
        batches = eval_batches(examples, t.batch_size, d.seq_len, packing=d.packing, pad_id=tokenizer.pad_id or 0)
        # Eager: the last batch is smaller and would make a compiled model recompile.
        return eval_loss(model, batches, precision=t.precision, max_batches=t.eval_batches)

    def log_eval(self, metrics: MetricsLogger, step: int, result: EvalResult) -> bool:
        """Log the held-out loss; True when it is the lowest so far."""
        return metrics.log_eval(step, result.loss)

    def eval_scalars(self, result: EvalResult) -> dict[str, float]:
        return {"eval_loss": result.loss, "eval_ppl": result.perplexity}

    def save(self, model: Transformer, tokenizer: Tokenizer, folder: Path) -> Path:
        """The adapter (PEFT format) of a LoRA run, or the whole model folder of a full fine-tune."""
        recipe = self.recipe
        lora = lora_config_of(recipe.lora)
        if lora is not None:
            out = folder / ADAPTER_DIR
            save_adapter(model, out, lora, base_model_name_or_path=base_model_name(recipe.model.path))
            return out
        out = folder / MODEL_DIR
        base = hub.resolve(recipe.model.path) if recipe.model.path else None  # a random-init model has none
        with master_weights(model):  # QAT: the full-precision weights it trained, as a plain model folder
            # base: its generation config is kept
            save_model_folder(model, tokenizer, out, base=base if base and base.is_dir() else None)
        return out

    def save_streamed(self, world: World, model: Transformer, tokenizer: Tokenizer, folder: Path) -> Path | None:
        """A sharded full fine-tune's model folder as :meth:`save` writes it, gathered one file's tensors at a time
        (a collective); None where that does not apply (an adapter, QAT, MoE expert layouts): use :meth:`save`."""
        recipe = self.recipe
        if lora_config_of(recipe.lora) is not None or recipe.qat is not None or not streams(model):
            return None
        out = folder / MODEL_DIR
        base = hub.resolve(recipe.model.path) if recipe.model.path else None
        return save_model_folder_streamed(world, model, tokenizer, out, base=base if base and base.is_dir() else None)

    def begin(self, model: Transformer, tokenizer: Tokenizer) -> None:
        """Nothing: the held-out loss before training is the baseline."""

    def finish(self, model: Transformer, tokenizer: Tokenizer, validation: list, run_dir: Path, output: Path,
               before: EvalResult | None, after: EvalResult | None) -> list[SummaryRow]:
        if after is None:
            return []
        # A resumed run evaluated before training in its first part: the metrics kept up to the resumed step say how.
        baseline = (before.loss, before.perplexity) if before is not None else _logged_baseline(run_dir)
        if baseline is None:
            return []
        return [("held-out loss", f"{baseline[0]:.4f} -> {after.loss:.4f} "
                                  f"(perplexity {baseline[1]:.2f} -> {after.perplexity:.2f})")]


def _logged_baseline(run_dir: Path) -> tuple[float, float] | None:
    """(loss, perplexity) of the evaluation before training, as the run's metrics.jsonl logged it (None: none was)."""
    path = run_dir / METRICS_FILE
    logged = [r["eval_loss"] for r in read_metrics(path) if r.get("step") == 0 and r.get("eval_loss") is not None] \
        if path.is_file() else []
    return (logged[0], math.exp(min(logged[0], 700.0))) if logged else None  # as eval_loss computes it


__all__ = ["CausalLMTask"]
