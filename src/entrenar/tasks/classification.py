"""Sequence classification and regression: what a batch means and how it is scored.

A record's ``text_field`` is tokenized (special tokens as the tokenizer adds
them, no EOS, cut to ``seq_len``), its ``label_field`` parsed by the problem
type: a label name or class id (single_label), a list of them (multi_label,
or one string of names joined by commas), a number or list of numbers
(regression). A batch is padded rows (right padding, to the longest row),
``attention_mask``, and ``labels``; it is never packed. The loss is summed
over the batch and divided by the step's targets (rows, weighted by their class
weight, for single_label; label entries otherwise), so a step's loss is the
mean that transformers' ``*ForSequenceClassification`` computes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from entrenar.data import BatchStream, read_records
from entrenar.data.batching import PAD_DOCUMENT
from entrenar.data.sources import Skip
from entrenar.errors import ConfigError, DataError
from entrenar.evaluation import metrics as M
from entrenar.models.classifier import CLASSIFIER_FILE
from entrenar.loading import load
from entrenar.loading.classifier import padding_id as _pad_id

# The scalar metrics each problem type reports (what task.metric may name, besides loss).
METRICS = {
    "single_label": {"accuracy", "macro_f1", "weighted_f1", "mcc", "kappa", "ece", "mce", "brier", "log_loss",
                     "top2_accuracy", "top3_accuracy", "top5_accuracy"},
    "multi_label": {"micro_f1", "macro_f1", "subset_accuracy", "hamming_loss"},
    "regression": {"rmse", "mae", "r2", "spearman"},
}
HIGHER_IS_BETTER = {"accuracy", "macro_f1", "weighted_f1", "micro_f1", "mcc", "kappa", "r2", "spearman",
                    "subset_accuracy", "top2_accuracy", "top3_accuracy", "top5_accuracy"}
LOWER_IS_BETTER = {"loss", "rmse", "mae", "ece", "mce", "brier", "log_loss", "hamming_loss"}


# -- data --------------------------------------------------------------------------------------


@dataclass
class LabeledText:
    """One tokenized text and its target: a class id, a 0/1 vector, or real values."""

    input_ids: list[int]
    target: int | list[float]
    origin: str = ""
    text: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class LabelSpec:
    """What labels mean for one run: the problem type, names (or None) and how many."""

    problem_type: str
    names: list[str] | None
    num_labels: int

    def parse(self, value: Any, where: str) -> int | list[float]:
        """A record's label value as a target, or DataError naming ``where``."""
        if self.problem_type == "regression":
            values = value if isinstance(value, list) else [value]
            try:
                out = [float(v) for v in values]
            except (TypeError, ValueError):
                raise DataError(f"{where}: regression target {value!r} is not a number") from None
            if len(out) != self.num_labels or not all(math.isfinite(v) for v in out):
                raise DataError(f"{where}: expected {self.num_labels} finite number(s), got {value!r}")
            return out
        if self.problem_type == "multi_label":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise DataError(f"{where}: a multi-label target is a list of labels, got {value!r}")
            vector = [0.0] * self.num_labels
            for v in value:
                vector[self._class(v, where)] = 1.0
            return vector
        return self._class(value, where)

    def _class(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or value is None:
            raise DataError(f"{where}: label {value!r} is not a label name or class id")
        if self.names is not None and str(value) in self.names:
            return self.names.index(str(value))
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, int):
            if 0 <= value < self.num_labels:
                return value
            raise DataError(f"{where}: class id {value} is out of range 0..{self.num_labels - 1}")
        known = f" (labels: {', '.join(self.names)})" if self.names else ""
        raise DataError(f"{where}: unknown label {value!r}{known}")


def label_spec(task, records: list | None = None, label_field: str = "label") -> LabelSpec:
    """The labels of a run: named in the recipe, counted there, or (names only) collected from the records."""
    names = list(task.labels) if task.labels else None
    num = len(names) if names else task.num_labels
    if num is None and task.problem_type == "regression":
        num = 1
    if num is None and records is not None:
        found = set()
        for r in records:
            v = r.fields.get(label_field)
            for item in (v if isinstance(v, list) else [v]):
                found.add(str(item))
        names = sorted(found)
        num = len(names)
    if not num:
        raise ConfigError("task: name the labels (task.labels) or their number (task.num_labels)")
    return LabelSpec(task.problem_type, names, num)


def read_labeled(path: str, role: str, recipe, tokenizer, spec: LabelSpec,
                 skipped_out: list[Skip] | None = None) -> tuple[list[LabeledText], list[str]]:
    """The labeled texts of one data file, and notes on what was skipped or cut (every skipped record is also
    appended to ``skipped_out``, for the run's skipped.jsonl)."""
    d = recipe.data
    return read_texts(path, tokenizer, spec, d.text_field, d.label_field, d.seq_len, d.format, d.on_error,
                      f"data.{role}", skipped_out, seed=recipe.training.seed, query=d.query)


def read_texts(path: str, tokenizer, spec: LabelSpec | None, text_field: str = "text", label_field: str = "label",
               seq_len: int = 512, fmt: str = "auto", on_error: str = "raise",
               role: str = "data", skipped_out: list[Skip] | None = None, seed: int = 0,
               query: str | None = None) -> tuple[list[LabeledText], list[str]]:
    """Tokenized texts of a data file with their targets (``spec`` None: no labels read, for prediction)."""
    records, stats = read_records(path, format=fmt, on_error=on_error, seed=seed, query=query)
    if skipped_out is not None:
        skipped_out.extend(stats.skipped_records)
    examples, skipped, cut = [], [], 0
    for record in records:
        fields = record.fields
        try:
            text = fields.get(text_field)
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{record.where}: field '{text_field}' must be non-empty text")
            target: Any = None
            if spec is not None:
                if label_field not in fields:
                    raise DataError(f"{record.where}: no field '{label_field}' (the label)")
                target = spec.parse(fields[label_field], record.where)
        except DataError as e:
            if on_error == "raise":
                raise
            skipped.append(str(e))
            if skipped_out is not None:
                skipped_out.append(Skip(record.file, record.location, "bad label or text", str(e)))
            continue
        ids = tokenizer.encode(text)
        if len(ids) > seq_len:
            ids, cut = ids[:seq_len], cut + 1
        examples.append(LabeledText(ids, target, record.where, text))
    if not examples:
        raise DataError(f"{role} ({path}): no examples")
    notes = []
    if skipped or stats.skipped:
        first = (stats.skip_reasons or skipped)[0]
        notes.append(f"{role}: {len(skipped) + stats.skipped} record(s) skipped (first: {first})")
    if cut:
        notes.append(f"{role}: {cut} text(s) cut to seq_len={seq_len}")
    return examples, notes


def class_weights(setting, examples: list[LabeledText], num_labels: int) -> list[float] | None:
    """Per-class loss weights: none, inverse_freq (n / (C * count)), sqrt_inverse, a list, or auto
    (inverse_freq when the largest class has more than twice the examples of the smallest)."""
    if setting in (None, "none"):
        return None
    if isinstance(setting, (list, tuple)):
        if len(setting) != num_labels:
            raise ConfigError(f"task.class_weights: {len(setting)} weights for {num_labels} labels")
        return [float(w) for w in setting]
    counts = np.bincount([e.target for e in examples], minlength=num_labels).astype(np.float64)
    if setting == "auto":
        present = counts[counts > 0]
        if present.max() <= 2 * present.min():
            return None
        setting = "inverse_freq"
    inverse = counts.sum() / (num_labels * np.maximum(counts, 1))
    return (np.sqrt(inverse) if setting == "sqrt_inverse" else inverse).tolist()


def pad_rows(examples: list[LabeledText], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` right-padded to the longest row, and the attention mask."""
    width = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, : len(e)] = torch.tensor(e.input_ids)
        mask[i, : len(e)] = 1
    return input_ids, mask


def collate(examples: list[LabeledText], pad_id: int, problem_type: str, weights: list[float] | None) -> dict:
    """Right-padded rows to the longest, with attention mask, labels and each row's loss weight."""
    n = len(examples)
    input_ids, mask = pad_rows(examples, pad_id)
    if problem_type == "single_label":
        labels = torch.tensor([e.target for e in examples], dtype=torch.long)
        row_weight = torch.tensor([weights[e.target] if weights else 1.0 for e in examples])
    else:
        labels = torch.tensor([e.target for e in examples], dtype=torch.float32)
        row_weight = torch.full((n,), float(labels.shape[1]))
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "row_weight": row_weight,
            "document_ids": torch.where(mask == 1, 0, PAD_DOCUMENT)}


class LabeledStream(BatchStream):
    """BatchStream's order and exact resume, with classification batches (one text per row, never packed)."""

    def __init__(self, examples, batch_size, seq_len, *, shuffle, seed, pad_id, problem_type, weights) -> None:
        super().__init__(examples, batch_size, seq_len, packing=False, shuffle=shuffle, seed=seed, pad_id=pad_id,
                         pad_to="longest")
        self.problem_type, self.weights = problem_type, weights

    def __next__(self) -> dict:
        rows = [self._next_row()[0] for _ in range(self.batch_size)]
        return collate(rows, self.pad_id, self.problem_type, self.weights)


# -- scoring -----------------------------------------------------------------------------------


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, problem_type: str, weights: torch.Tensor | None = None,
             label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed loss of a batch: CE (weights, label smoothing), BCE with logits, or MSE."""
    logits = logits.float()
    if problem_type == "single_label":
        return F.cross_entropy(logits, labels, weight=weights, label_smoothing=label_smoothing, reduction="sum")
    if problem_type == "multi_label":
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return F.mse_loss(logits, labels.to(logits.dtype), reduction="sum")


@torch.no_grad()
def predict_logits(model, examples: list[LabeledText], batch_size: int, pad_id: int,
                   precision: str = "fp32") -> np.ndarray:
    """Logits [N, num_labels] of ``examples`` in order (eval mode, autocast as training's precision)."""
    from entrenar.evaluation.loss import autocast_for
    from entrenar.models.transformer import compute_device

    device = compute_device(model)
    was_training = model.training
    model.eval()
    out = []
    try:
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))  # similar lengths pad little
        for start in range(0, len(order), batch_size):
            chunk = [examples[i] for i in order[start:start + batch_size]]
            input_ids, mask = pad_rows(chunk, pad_id)
            with autocast_for(device, precision):
                logits = model(input_ids.to(device), mask.to(device))
            out.append(logits.float().cpu())
    finally:
        model.train(was_training)
    logits = torch.cat(out).numpy().astype(np.float64)
    result = np.empty_like(logits)
    result[np.array(order)] = logits
    return result


def targets_array(examples: list[LabeledText]) -> np.ndarray:
    return np.array([e.target for e in examples])


def score(problem_type: str, logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0,
          thresholds: np.ndarray | None = None) -> dict:
    """The metrics of one set of logits against targets."""
    if problem_type == "single_label":
        return M.single_label(targets, M.softmax(logits, temperature))
    if problem_type == "multi_label":
        thresholds = np.full(logits.shape[1], 0.5) if thresholds is None else thresholds
        return M.multi_label(targets, M.sigmoid(logits, temperature), thresholds)
    return M.regression(targets, logits)


def metric_direction(name: str) -> int:
    """+1 when higher is better, -1 when lower is."""
    if name in HIGHER_IS_BETTER:
        return 1
    if name in LOWER_IS_BETTER:
        return -1
    raise ConfigError(f"task.metric: unknown metric {name!r} (higher is better: {', '.join(sorted(HIGHER_IS_BETTER))}; "
                      f"lower: {', '.join(sorted(LOWER_IS_BETTER))})")


@dataclass
class ClassificationEval:
    """One evaluation: mean loss and the metrics (what the loop logs and chooses the best checkpoint by)."""

    loss: float
    metrics: dict
    examples: int = 0


@dataclass
class ClassificationTask:
    """The task object the training loop asks what a batch means and how it is scored."""

    recipe: Any
    spec: LabelSpec | None = None
    weights: list[float] | None = None
    pad_id: int = 0
    best: float | None = None  # the best evaluation so far, by task.metric, signed so that higher is better
    best_step: int | None = None
    name: str = "classification"
    _weight_tensor: dict = field(default_factory=dict)

    @property
    def problem_type(self) -> str:
        return self.recipe.task.problem_type

    @property
    def metric(self) -> str:
        t = self.recipe.task
        return t.metric or ("rmse" if t.problem_type == "regression" else "macro_f1")

    def load(self, path, dtype, device, quantize):
        """The model: a classifier on the recipe's checkpoint (a fresh head drawn from training.seed)."""
        import entrenar

        t = self.recipe.task
        if self.metric != "loss" and self.metric not in METRICS[t.problem_type]:
            raise ConfigError(f"task.metric: {self.metric!r} is not a {t.problem_type} metric (one of: loss, "
                              f"{', '.join(sorted(METRICS[t.problem_type]))})")
        if self.recipe.data.padding_free is True:
            raise ConfigError("data.padding_free: a classification batch is one padded text per row; turn it off")
        names = list(t.labels) if t.labels else None
        num = len(names) if names else (t.num_labels or (1 if t.problem_type == "regression" else None))
        if num is None:  # collected from the training data
            records, _ = read_records(self.recipe.data.train, format=self.recipe.data.format,
                                      on_error=self.recipe.data.on_error, seed=self.recipe.training.seed,
                                      query=self.recipe.data.query)
            self.spec = label_spec(t, records, self.recipe.data.label_field)
            num = self.spec.num_labels
        model, tokenizer = load(path, dtype=dtype, device=device, quantize=quantize, task="classification",
                                         num_labels=num, pooling=t.pooling, seed=self.recipe.training.seed)
        self.spec = self.spec or label_spec(t)
        self.pad_id = _pad_id(tokenizer)
        model.info.update(labels=self.spec.names or [str(i) for i in range(num)], problem_type=t.problem_type,
                          pad_token_id=self.pad_id)
        return model, tokenizer

    def prepare(self, model) -> None:
        """After adapters: the head is trained whole (PEFT's modules_to_save)."""
        model.score.weight.requires_grad_(True)

    def examples(self, path: str, role: str, recipe, tokenizer, skipped: list[Skip] | None = None):
        return read_labeled(path, role, recipe, tokenizer, self.spec, skipped)

    def stream(self, examples, recipe) -> tuple[LabeledStream, list[str]]:
        """The training batches and a note on the class weights, counted on ``examples``: the rows trained on,
        after the validation split is taken out."""
        d, t = recipe.data, recipe.training
        notes = []
        if self.problem_type == "single_label":
            self.weights = class_weights(recipe.task.class_weights, examples, self.spec.num_labels)
            if self.weights is not None:
                notes.append("class weights: " + ", ".join(f"{w:.3g}" for w in self.weights))
        stream = LabeledStream(examples, t.batch_size, d.seq_len, shuffle=d.shuffle, seed=t.seed, pad_id=self.pad_id,
                               problem_type=self.problem_type, weights=self.weights)
        return stream, notes

    def num_targets(self, batch) -> float:
        return float(batch["row_weight"].sum())

    def loss_sum(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])
        weights = None
        if self.weights is not None:
            device = logits.device
            if device not in self._weight_tensor:
                self._weight_tensor[device] = torch.tensor(self.weights, dtype=torch.float32, device=device)
            weights = self._weight_tensor[device]
        return loss_sum(logits, batch["labels"], self.problem_type, weights, self.recipe.task.label_smoothing)

    def evaluate(self, model, validation, recipe) -> ClassificationEval:
        logits = predict_logits(model, validation, recipe.training.batch_size, self.pad_id, recipe.training.precision)
        targets = targets_array(validation)
        thresholds = _thresholds(recipe.task.threshold, self.spec.num_labels)
        metrics = score(self.problem_type, logits, targets, thresholds=thresholds)
        labels = torch.as_tensor(targets, dtype=torch.long if self.problem_type == "single_label" else torch.float32)
        total = float(loss_sum(torch.as_tensor(logits), labels, self.problem_type))
        count = len(validation) * (1 if self.problem_type == "single_label" else self.spec.num_labels)
        return ClassificationEval(loss=total / count, metrics=metrics, examples=len(validation))

    def log_eval(self, metrics_log, step: int, result: ClassificationEval) -> bool:
        """Log the evaluation; True when it is the best so far by the recipe's metric."""
        if self.best is None:  # a resumed run: the best so far is in the metrics kept up to the resumed step
            self.best, self.best_step = self._best_logged(metrics_log.path)
        metrics_log.log_eval(step, result.loss)
        value = result.loss if self.metric == "loss" else result.metrics[self.metric]
        scalars = {f"eval_{k}": v for k, v in result.metrics.items() if isinstance(v, float)}
        metrics_log._write({"step": int(step), **scalars})
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

    def _best_logged(self, path: Path) -> tuple[float | None, int | None]:
        """The best signed value of task.metric in a metrics file, and its step (None, None: none yet)."""
        from entrenar.train.metrics import read_metrics

        if not Path(path).is_file():
            return None, None
        key = f"eval_{self.metric}"
        values = [(metric_direction(self.metric) * r[key], -r["step"]) for r in read_metrics(path)
                  if r.get(key) is not None]
        if not values:
            return None, None
        value, step = max(values)  # the earliest step among equal values, as the live comparison keeps it
        return value, -step

    def finish(self, model, validation, recipe, run_dir: Path, output: Path) -> list[tuple[str, str]]:
        """End of training: calibrate on validation, save the calibration with the model, write the report."""
        from entrenar.evaluation.report import build_report, write_report

        if not validation:
            return [("report", "no validation data: no report (set data.validation or data.validation_split)")]
        logits = predict_logits(model, validation, recipe.training.batch_size, self.pad_id, recipe.training.precision)
        targets = targets_array(validation)
        calibration = calibrate(self.problem_type, logits, targets, recipe.task.threshold)
        model.info.update(calibration)
        update_classifier_file(output, calibration)
        report = build_report(self.problem_type, logits, targets, model.info["labels"], calibration,
                              seed=recipe.training.seed, source=f"validation ({len(validation)} examples)")
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


def save_result(model, tokenizer, recipe, out_dir: Path, lora_config) -> Path:
    """The adapter with the head as PEFT saves it for SEQ_CLS (LoRA), or the whole classifier folder."""
    from entrenar.io import atomic
    from entrenar.export import save_merged
    from entrenar.adapters.lora import save_adapter
    from entrenar.quant.qat import master_weights

    if lora_config is not None:
        out = out_dir / "adapter"
        save_adapter(model, out, lora_config, base_model_name_or_path=str(recipe.model.path),
                     modules_to_save=["score"], task_type="SEQ_CLS")
        atomic.write_text(out / CLASSIFIER_FILE, model.saved_files()[CLASSIFIER_FILE])
        return out
    out = out_dir / "model"
    with master_weights(model):
        save_merged(model, tokenizer, out)
    return out


def _thresholds(setting, num_labels: int) -> np.ndarray:
    if isinstance(setting, (list, tuple)):
        if len(setting) != num_labels:
            raise ConfigError(f"task.threshold: {len(setting)} thresholds for {num_labels} labels")
        return np.array(setting, dtype=np.float64)
    return np.full(num_labels, 0.5 if setting in (None, "tune") else float(setting))


def calibrate(problem_type: str, logits: np.ndarray, targets: np.ndarray, threshold_setting=None) -> dict:
    """Temperature (single_label, fitted on these logits) and per-label thresholds (multi_label: tuned on
    these logits unless the recipe sets them)."""
    if problem_type == "single_label":
        return {"temperature": M.fit_temperature(logits, targets)}
    if problem_type == "multi_label":
        if threshold_setting in (None, "tune"):
            thresholds = M.tune_thresholds(targets, M.sigmoid(logits))
        else:
            thresholds = _thresholds(threshold_setting, logits.shape[1])
        return {"thresholds": [float(t) for t in thresholds]}
    return {}


def update_classifier_file(folder: Path, values: dict) -> None:
    """Add ``values`` to classifier.json in a saved model or adapter folder."""
    from entrenar.io import atomic

    path = Path(folder) / CLASSIFIER_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    atomic.write_text(path, json.dumps({**data, **values}, indent=2) + "\n")


# -- a trained classifier on a data file -------------------------------------------------------


def _spec_of(model) -> LabelSpec:
    info = model.info
    return LabelSpec(info.get("problem_type", "single_label"), info.get("labels"), model.num_labels)


def evaluate_file(model, tokenizer, path: str, output_dir: str | Path | None = None, text_field: str = "text",
                  label_field: str = "label", seq_len: int = 512, batch_size: int = 8, fmt: str = "auto",
                  seed: int = 0) -> dict:
    """The report of ``model`` on a labeled data file, with the calibration saved with the model
    (temperature, thresholds); written to ``output_dir`` (report.json, report.md, PNGs) when given."""
    from entrenar.evaluation.report import build_report, write_report

    spec = _spec_of(model)
    examples, notes = read_texts(path, tokenizer, spec, text_field, label_field, seq_len, fmt)
    logits = predict_logits(model, examples, batch_size, _pad_id(tokenizer))
    calibration = {k: model.info[k] for k in ("temperature", "thresholds") if k in model.info}
    labels = spec.names or [str(i) for i in range(spec.num_labels)]
    report = build_report(spec.problem_type, logits, targets_array(examples), labels, calibration, seed=seed,
                          source=str(path))
    report["notes"] = notes
    if output_dir is not None:
        write_report(report, output_dir)
    return report


def predict_file(model, tokenizer, path: str, output: str | Path, text_field: str = "text", seq_len: int = 512,
                 batch_size: int = 8, fmt: str = "auto") -> int:
    """Write one JSON line per input text: predicted label(s) and calibrated probabilities (or values)."""
    from entrenar.io import atomic

    spec = _spec_of(model)
    examples, _ = read_texts(path, tokenizer, None, text_field, seq_len=seq_len, fmt=fmt)
    logits = predict_logits(model, examples, batch_size, _pad_id(tokenizer))
    labels = spec.names or [str(i) for i in range(spec.num_labels)]
    t = float(model.info.get("temperature", 1.0))
    lines = []
    for example, row in zip(examples, logits):
        out: dict[str, Any] = {"source": example.origin}
        if spec.problem_type == "single_label":
            probs = M.softmax(row[None], t)[0]
            out.update(label=labels[int(probs.argmax())], probs={n: float(p) for n, p in zip(labels, probs)})
        elif spec.problem_type == "multi_label":
            probs = M.sigmoid(row)
            thresholds = model.info.get("thresholds") or [0.5] * len(labels)
            out.update(labels=[n for n, p, th in zip(labels, probs, thresholds) if p >= th],
                       probs={n: float(p) for n, p in zip(labels, probs)})
        else:
            out["values"] = [float(v) for v in row]
        lines.append(json.dumps(out))
    atomic.write_text(output, "\n".join(lines) + "\n")
    return len(lines)
