"""The Task protocol: what a batch is and how it is scored, the one seam between the Trainer and a task.

The Trainer reads data, steps, evaluates, checkpoints and saves through these methods and never asks which
task it runs. A new task (preference optimisation, RL) implements them; nothing in ``entrenar.train`` changes.

The order the Trainer calls them in: ``load`` -> (QAT, LoRA) -> ``prepare`` -> ``read`` (train, validation) ->
``stream`` -> per micro-batch ``num_targets`` and ``loss_sum``, per step ``step_metrics`` -> per evaluation
``evaluate``, ``log_eval``, ``eval_scalars`` -> ``save`` (``run/best/`` and the result) -> ``finish``. ``begin``
runs once before the first step of a fresh (not resumed) run.

A capability only some tasks have is a declared member that is None where a task lacks it (``fixed_layout``), so
the Trainer reads it without probing the task and the type checker holds every task to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from entrenar.tasks.layout import TaskLayout

if TYPE_CHECKING:
    import torch

    from entrenar.data.batching import BatchStream
    from entrenar.data.sources import Skip
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer
    from entrenar.train.metrics import MetricsLogger

Batch = dict[str, Any]  # tensors (and a few ints), keyed as the task's stream lays them out
SummaryRow = tuple[str, str]  # (label, value): a line of the run's summary

ModelT = TypeVar("ModelT", bound="Transformer")  # the model a task loads: a decoder, or a classifier on one


class FixedLayout(Protocol):
    """A task that lays each micro-batch out itself in one fixed layout a CUDA graph replays (its
    :class:`TaskLayout` declares ``own_graph_layout``; preference pairs), and hands its metrics of a micro-batch
    back through the graph's output, since a replayed graph runs none of the task's Python."""

    def graph_layout(self, batch: Batch) -> Batch:
        """A micro-batch as collated, in the fixed layout: what the Trainer steps under ``training.cuda_graphs``
        instead of laying out its rows."""
        ...

    def micro_stats(self) -> torch.Tensor | None:
        """The metrics (sums and counts, on the device) of the micro-batch ``loss_sum`` just scored in the fixed
        layout, handed over once (None otherwise): the micro-step returns them beside its loss."""
        ...

    def add_micro_stats(self, stats: torch.Tensor) -> None:
        """Add a micro-step's :meth:`micro_stats`, as the (possibly replayed) step returned them, to the step's
        metrics."""
        ...


class Task(Protocol[ModelT]):
    """A training objective on the one loop, over the model it loads (``Task`` alone: any task)."""

    name: str  # "causal_lm", "classification": recorded, never branched on by the Trainer
    perplexity: bool  # exp(eval loss) means something (a language model's loss per token): the summary shows it
    layout: ClassVar[TaskLayout]  # what the run plan reads of its batches, never its name (entrenar.tasks.layout)

    @property
    def fixed_layout(self) -> FixedLayout | None:
        """The task's own fixed layout under CUDA graphs (:class:`FixedLayout`), or None: its rows are laid out
        as rows. A task declares it ``fixed_layout: ClassVar[None] = None`` where it has none."""
        ...

    def load(self, dtype: str, device: torch.device, quantize: str | None) -> tuple[ModelT, Tokenizer | None]:
        """The model this task trains (the recipe's ``model`` section) and its tokenizer (None: the folder has
        none), before adapters."""
        ...

    def prepare(self, model: ModelT) -> None:
        """After adapters are applied: make trainable what the task trains whole (a classifier's head)."""
        ...

    def head_state(self, model: ModelT) -> dict[str, torch.Tensor]:
        """Weights the task trains whole beside adapters, kept in checkpoints of a LoRA run (none for a LM)."""
        ...

    def read(self, path: str, role: str, tokenizer: Tokenizer, skipped: list[Skip],
             format: str | None = None) -> tuple[list, list[str]]:
        """(examples, notes) of one data file (``role``: train or validation); appends what was skipped.
        ``format``: the file's data.format where a mix names one (default: the recipe's)."""
        ...

    def stream(self, examples: list, tokenizer: Tokenizer) -> tuple[BatchStream, list[str]]:
        """The resumable stream of training batches over ``examples`` (after the validation split), and notes."""
        ...

    def num_targets(self, batch: Batch) -> float:
        """How many targets a batch holds: the loss of a step is its summed loss over its targets."""
        ...

    def loss_sum(self, model: Any, batch: Batch) -> torch.Tensor:
        """The summed loss of one micro-batch (on the device), through ``model``: the model or its parallel wrapper
        (:class:`~entrenar.distributed.parallelize.Single`), called as the model is and with ``hidden_states``."""
        ...

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The task's own metrics of the micro-batches since the last call (one optimizer step), as 0-dim device
        tensors, logged beside the step's loss under these names (none for a LM); read once per step."""
        ...

    def evaluate(self, model: ModelT, examples: list, tokenizer: Tokenizer) -> Any:
        """A held-out evaluation of ``examples`` (bounded by training.eval_batches)."""
        ...

    def log_eval(self, metrics: MetricsLogger, step: int, result: Any) -> bool:
        """Write an evaluation to the metrics; True when it is the best so far (run/best/ is then saved)."""
        ...

    def eval_scalars(self, result: Any) -> dict[str, float]:
        """What early stopping and the console read of an evaluation, the headline first."""
        ...

    def save(self, model: ModelT, tokenizer: Tokenizer, folder: Path) -> Path:
        """Write the trained result into ``folder`` (a run folder or its best/): the path written."""
        ...

    def begin(self, model: ModelT, tokenizer: Tokenizer) -> None:
        """Once, before the first step of a fresh run (a baseline the summary compares with)."""
        ...

    def finish(self, model: ModelT, tokenizer: Tokenizer, validation: list, run_dir: Path, output: Path,
               before: Any, after: Any) -> list[SummaryRow]:
        """After the result is saved: what the task adds to the run (a report) and to its summary."""
        ...
