"""A trained classifier on a data file, for ``entrenar classify``: its report on labeled texts, or its
predictions with the calibration saved with the model applied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from entrenar.data.tokenizer import Tokenizer
from entrenar.evaluation import metrics as M
from entrenar.evaluation.report import build_report, write_report
from entrenar.io import atomic
from entrenar.loading.classifier import padding_id
from entrenar.models.classifier import SequenceClassifier
from entrenar.tasks.classification.data import read_texts
from entrenar.tasks.classification.evaluation import predict_logits, targets_array
from entrenar.tasks.classification.labels import LabelSpec


def evaluate_file(model: SequenceClassifier, tokenizer: Tokenizer, path: str, output_dir: str | Path | None = None,
                  text_field: str = "text", label_field: str = "label", seq_len: int = 512, batch_size: int = 8,
                  fmt: str = "auto", seed: int = 0) -> dict:
    """The report of ``model`` on a labeled data file, with the calibration saved with the model
    (temperature, thresholds); written to ``output_dir`` (report.json, report.md, PNGs) when given."""
    spec = _spec_of(model)
    examples, notes = read_texts(path, tokenizer, spec, text_field, label_field, seq_len, fmt)
    logits = predict_logits(model, examples, batch_size, padding_id(tokenizer))
    calibration = {k: model.info[k] for k in ("temperature", "thresholds") if k in model.info}
    labels = spec.names or [str(i) for i in range(spec.num_labels)]
    report = build_report(spec.problem_type, logits, targets_array(examples), labels, calibration, seed=seed,
                          source=str(path))
    report["notes"] = notes
    if output_dir is not None:
        write_report(report, output_dir)
    return report


def predict_file(model: SequenceClassifier, tokenizer: Tokenizer, path: str, output: str | Path,
                 text_field: str = "text", seq_len: int = 512, batch_size: int = 8, fmt: str = "auto") -> int:
    """Write one JSON line per input text: predicted label(s) and calibrated probabilities (or values)."""
    spec = _spec_of(model)
    examples, _ = read_texts(path, tokenizer, None, text_field, seq_len=seq_len, fmt=fmt)
    logits = predict_logits(model, examples, batch_size, padding_id(tokenizer))
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


def _spec_of(model: SequenceClassifier) -> LabelSpec:
    """The labels a saved classifier was trained with (its classifier.json)."""
    info = model.info
    return LabelSpec(info.get("problem_type", "single_label"), info.get("labels"), model.num_labels)
