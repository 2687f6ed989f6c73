"""Sequence classification and regression as a :class:`~entrenar.tasks.base.Task`: a head on the decoder,
CE / BCE / MSE, the best checkpoint by ``task.metric``, calibration and a report at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from entrenar.adapters.lora import lora_config_of
from entrenar.data import read_records
from entrenar.data.formats import split_format
from entrenar.errors import ConfigError
from entrenar.evaluation.report import build_report, write_report
from entrenar.loading import load as load_model
from entrenar.loading.classifier import padding_id
from entrenar.models import random_init
from entrenar.models.classifier import SequenceClassifier, from_backbone
from entrenar.tasks.base import SummaryRow
from entrenar.tasks.classification.calibration import calibrate
from entrenar.tasks.classification.data import (
    LabeledStream,
    LabeledText,
    class_weights,
    read_labeled,
)
from entrenar.tasks.classification.evaluation import (
    METRICS,
    ClassificationEval,
    metric_direction,
    predict_logits,
    score,
    targets_array,
    thresholds_of,
)
from entrenar.tasks.classification.labels import LabelSpec, label_spec
from entrenar.tasks.classification.loss import loss_sum
from entrenar.tasks.classification.saving import save_result, update_classifier_file
from entrenar.tasks.layout import TaskLayout
from entrenar.train.metrics import read_metrics

if TYPE_CHECKING:
    from entrenar.data.sources import Skip
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.train.metrics import MetricsLogger


@dataclass
class ClassificationTask:
    """What a classification batch means and how it is scored, for the Trainer (the Task protocol)."""

    recipe: Any
    spec: LabelSpec | None = None
    weights: list[float] | None = None
    pad_id: int = 0
    best: float | None = None  # the best evaluation so far, by task.metric, signed so that higher is better
    best_step: int | None = None
    name: str = "classification"
    perplexity: bool = False  # exp(cross-entropy over labels) is no perplexity; the metrics rows say how it did
    layout: ClassVar[TaskLayout] = TaskLayout(no_cuda_graphs="a classification task's batches vary in layout")
    fixed_layout: ClassVar[None] = None  # rows laid out as rows (tasks.base.FixedLayout)
    _weight_tensor: dict = field(default_factory=dict)
    _step_counts: torch.Tensor | None = field(default=None, repr=False)  # (correct, total) of this step so far

    @property
    def problem_type(self) -> str:
        return self.recipe.task.problem_type

    @property
    def metric(self) -> str:
        t = self.recipe.task
        return t.metric or ("rmse" if t.problem_type == "regression" else "macro_f1")

    @property
    def _labels(self) -> LabelSpec:
        """The labels, known once :meth:`load` ran (the Trainer calls it first)."""
        assert self.spec is not None
        return self.spec

    def load(self, dtype: str, device: torch.device, quantize: str | None) -> tuple[SequenceClassifier, Tokenizer]:
        """A classifier on the recipe's ``model.path`` or a random-init ``model.config`` (a fresh head drawn from
        training.seed) and its tokenizer;
        the labels come from the recipe or, when it names neither them nor their number, the training data."""
        t, d = self.recipe.task, self.recipe.data
        if self.metric != "loss" and self.metric not in METRICS[t.problem_type]:
            raise ConfigError(f"task.metric: {self.metric!r} is not a {t.problem_type} metric (one of: loss, "
                              f"{', '.join(sorted(METRICS[t.problem_type]))})")
        if d.padding_free is True:
            raise ConfigError("data.padding_free: a classification batch is one padded text per row; turn it off")
        names = list(t.labels) if t.labels else None
        num = len(names) if names else (t.num_labels or (1 if t.problem_type == "regression" else None))
        if num is None:  # collected from the training data
            records, _ = read_records([path for path, _, _ in d.sources()], format=split_format(d.format)[0],
                                      on_error=d.on_error,
                                      seed=self.recipe.training.seed, query=d.query, attach=d.attach)
            self.spec = label_spec(t, records, d.label_field)
            num = self.spec.num_labels
        if random_init.is_random(self.recipe):  # a decoder drawn from model.config, a head on it (from scratch)
            if quantize is not None:
                raise ConfigError("lora.quantize_base: a random-init model has no pretrained base to quantize")
            lm, tokenizer = random_init.build(self.recipe, dtype, device)
            model = from_backbone(lm, num, t.pooling, seed=self.recipe.training.seed)
        else:
            model, tokenizer = load_model(self.recipe.model.path, dtype=dtype, device=device, quantize=quantize,
                                          task="classification", num_labels=num, pooling=t.pooling,
                                          seed=self.recipe.training.seed)
        self.spec = self.spec or label_spec(t)
        self.pad_id = padding_id(tokenizer)
        model.info.update(labels=self.spec.names or [str(i) for i in range(num)], problem_type=t.problem_type,
                          pad_token_id=self.pad_id)
        return model, tokenizer

    def prepare(self, model: SequenceClassifier) -> None:
        """After adapters: the head is trained whole (PEFT's modules_to_save)."""
        model.score.weight.requires_grad_(True)

    def head_state(self, model: SequenceClassifier) -> dict[str, torch.Tensor]:
        """The head, trained whole beside a LoRA run's adapters, so its checkpoints keep it."""
        return {"score.weight": model.score.weight}

    def read(self, path: str, role: str, tokenizer: Tokenizer, skipped: list[Skip],
             format: str | None = None) -> tuple[list[LabeledText], list[str]]:
        """The labeled texts of one data file (read as ``format``, default data.format) and notes; bad labels name
        their file and line."""
        return read_labeled(path, role, self.recipe, tokenizer, self._labels, skipped, format=format)

    def stream(self, examples: list[LabeledText], tokenizer: Tokenizer) -> tuple[LabeledStream, list[str]]:
        """The training batches and a note on the class weights, counted on ``examples``: the rows trained on,
        after the validation split is taken out."""
        d, t = self.recipe.data, self.recipe.training
        notes = []
        if self.problem_type == "single_label":
            self.weights = class_weights(self.recipe.task.class_weights, examples, self._labels.num_labels)
            if self.weights is not None:
                notes.append("class weights: " + ", ".join(f"{w:.3g}" for w in self.weights))
        stream = LabeledStream(examples, t.batch_size, d.seq_len, shuffle=d.shuffle, seed=t.seed, pad_id=self.pad_id,
                               problem_type=self.problem_type, weights=self.weights)
        return stream, notes

    def num_targets(self, batch: dict[str, torch.Tensor]) -> float:
        """Rows weighted by their class weight (single_label), label entries otherwise."""
        return float(batch["row_weight"].sum())

    def loss_sum(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed loss of the micro-batch, through ``model`` (the classifier or its parallel wrapper)."""
        logits = model(batch["input_ids"], batch["attention_mask"])
        self._count_correct(logits.detach(), batch["labels"])
        weights = None
        if self.weights is not None:
            device = logits.device
            if device not in self._weight_tensor:
                self._weight_tensor[device] = torch.tensor(self.weights, dtype=torch.float32, device=device)
            weights = self._weight_tensor[device]
        return loss_sum(logits, batch["labels"], self.problem_type, weights, self.recipe.task.label_smoothing)

    def _count_correct(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a training micro-batch's correct predictions to the step's count, on the device (no host read):
        rows whose top class is the label, or for multi_label the label entries on the right side of 0.5."""
        if self.problem_type == "regression":
            return
        right = logits.argmax(-1) == labels if self.problem_type == "single_label" else (logits > 0) == (labels > 0.5)
        total = torch.full((), float(right.numel()), device=logits.device)  # a fill on the device: no host copy
        counts = torch.stack([right.sum().float(), total])
        self._step_counts = counts if self._step_counts is None else self._step_counts + counts

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The step's training accuracy (``train_accuracy``, on the device; none for regression): correct
        predictions over the training micro-batches since the last call."""
        counts, self._step_counts = self._step_counts, None
        return {} if counts is None else {"train_accuracy": counts[0] / counts[1]}

    def evaluate(self, model: SequenceClassifier, examples: list[LabeledText],
                 tokenizer: Tokenizer) -> ClassificationEval:
        """Mean loss and metrics on ``examples``, the first training.eval_batches batches of them when set."""
        t = self.recipe.training
        examples = examples[:t.eval_batches * t.batch_size] if t.eval_batches else examples
        logits = self._logits(model, examples)
        targets = targets_array(examples)
        thresholds = thresholds_of(self.recipe.task.threshold, self._labels.num_labels)
        metrics = score(self.problem_type, logits, targets, thresholds=thresholds)
        labels = torch.as_tensor(targets, dtype=torch.long if self.problem_type == "single_label" else torch.float32)
        total = float(loss_sum(torch.as_tensor(logits), labels, self.problem_type))
        count = len(examples) * (1 if self.problem_type == "single_label" else self._labels.num_labels)
        return ClassificationEval(loss=total / count, metrics=metrics, examples=len(examples))

    def log_eval(self, metrics: MetricsLogger, step: int, result: ClassificationEval) -> bool:
        """Log the evaluation; True when it is the best so far by the recipe's metric."""
        if self.best is None:  # a resumed run: the best so far is in the metrics kept up to the resumed step
            self.best, self.best_step = self._best_logged(metrics.path)
        metrics.log_eval(step, result.loss)
        value = result.loss if self.metric == "loss" else result.metrics[self.metric]
        scalars = {f"eval_{k}": v for k, v in result.metrics.items() if isinstance(v, float)}
        metrics._write({"step": int(step), **scalars})
        signed = metric_direction(self.metric) * value
        if self.best is not None and signed <= self.best:
            return False
        self.best, self.best_step = signed, int(step)
        return True

    def eval_scalars(self, result: ClassificationEval) -> dict[str, float]:
        """What early stopping and the console read of an evaluation: the loss, then the recipe's metric first."""
        scalars = {f"eval_{k}": v for k, v in result.metrics.items() if isinstance(v, float)}
        key = f"eval_{self.metric}"
        first = {key: scalars.pop(key)} if key in scalars else {}
        return {"eval_loss": result.loss, **first, **scalars}

    def save(self, model: SequenceClassifier, tokenizer: Tokenizer, folder: Path) -> Path:
        """The adapter with the head (LoRA), or the whole classifier folder, in ``folder``."""
        return save_result(model, tokenizer, self.recipe, folder, lora_config_of(self.recipe.lora))

    def begin(self, model: SequenceClassifier, tokenizer: Tokenizer) -> None:
        """Nothing: the evaluation at step 0 is the baseline a classification run compares with."""

    def finish(self, model: SequenceClassifier, tokenizer: Tokenizer, validation: list[LabeledText], run_dir: Path,
               output: Path, before: ClassificationEval | None, after: ClassificationEval | None) -> list[SummaryRow]:
        """End of training: calibrate on validation, save the calibration with the model (``output``), write the
        report into ``run_dir``; the summary's rows."""
        if not validation:
            return [("report", "no validation data: no report (set data.validation or data.validation_split)")]
        logits = self._logits(model, validation)
        targets = targets_array(validation)
        calibration = calibrate(self.problem_type, logits, targets, self.recipe.task.threshold)
        model.info.update(calibration)
        update_classifier_file(output, calibration)
        report = build_report(self.problem_type, logits, targets, model.info["labels"], calibration,
                              seed=self.recipe.training.seed, source=f"validation ({len(validation)} examples)")
        write_report(report, run_dir)
        headline = report["headline"]
        best = []
        if self.best is not None:
            value = metric_direction(self.metric) * self.best
            # run/best/ is written when training beats the evaluation before it, not for step 0.
            where = " (run/best/)" if self.best_step else " (before training; no run/best/)"
            best = [(f"best {self.metric}", f"{value:.4f} at step {self.best_step}{where}")]
        return [*best, ("report", str(run_dir / "report.md")),
                *[(name, f"{v['value']:.4f} [{v['ci'][0]:.4f}, {v['ci'][1]:.4f}]") for name, v in headline.items()]]

    def _logits(self, model: SequenceClassifier, examples: list[LabeledText]) -> np.ndarray:
        """Logits of ``examples`` in batches of training.batch_size, under training's precision."""
        t = self.recipe.training
        return predict_logits(model, examples, t.batch_size, self.pad_id, t.precision)

    def _best_logged(self, path: Path) -> tuple[float | None, int | None]:
        """The best signed value of task.metric in a metrics file, and its step (None, None: none yet)."""
        if not Path(path).is_file():
            return None, None
        key = f"eval_{self.metric}"
        values = [(metric_direction(self.metric) * r[key], -r["step"]) for r in read_metrics(path)
                  if r.get(key) is not None]
        if not values:
            return None, None
        value, step = max(values)  # the earliest step among equal values, as the live comparison keeps it
        return value, -step
