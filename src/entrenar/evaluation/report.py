"""The classification report: report.json, report.md and PNGs (confusion matrix, reliability diagram).

Built from logits and targets alone, so training's end and ``entrenar classify
eval`` write the same report. Headline metrics carry 95% percentile bootstrap
intervals (1000 resamples of the rows, seeded).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from entrenar.evaluation import metrics as M
from entrenar.io import atomic

BOOTSTRAP_SAMPLES = 1000


def _headline(problem_type: str, logits: np.ndarray, targets: np.ndarray, calibration: dict, seed: int) -> dict:
    t = calibration.get("temperature", 1.0)
    if problem_type == "single_label":
        probs = M.softmax(logits, t)
        pred = probs.argmax(1)
        c = probs.shape[1]
        fns = {
            "accuracy": lambda i: float((pred[i] == targets[i]).mean()),
            "macro_f1": lambda i: float(M.per_class(M.confusion_matrix(targets[i], pred[i], c))["f1"].mean()),
            "ece": lambda i: M.ece_mce(targets[i], probs[i])[0],
        }
    elif problem_type == "multi_label":
        th = np.asarray(calibration.get("thresholds", np.full(logits.shape[1], 0.5)))
        probs = M.sigmoid(logits)
        fns = {"micro_f1": lambda i: M.multi_label(targets[i], probs[i], th)["micro_f1"],
               "macro_f1": lambda i: M.multi_label(targets[i], probs[i], th)["macro_f1"]}
    else:
        fns = {"rmse": lambda i: M.regression(targets[i], logits[i])["rmse"],
               "r2": lambda i: M.regression(targets[i], logits[i])["r2"]}
    n = len(targets)
    everything = np.arange(n)
    return {name: {"value": fn(everything), "ci": list(M.bootstrap_ci(fn, n, BOOTSTRAP_SAMPLES, seed))}
            for name, fn in fns.items()}


def build_report(problem_type: str, logits: np.ndarray, targets: np.ndarray, labels: list[str], calibration: dict,
                 seed: int = 0, source: str = "") -> dict:
    """Every metric of the report as a JSON-able dict (calibration: temperature / thresholds in use)."""
    report: dict = {"problem_type": problem_type, "examples": int(len(targets)), "source": source,
                    "labels": list(labels), "calibration": calibration, "ece_bins": M.ECE_BINS,
                    "bootstrap": {"samples": BOOTSTRAP_SAMPLES, "level": 0.95, "seed": seed}}
    if problem_type == "single_label":
        t = calibration.get("temperature", 1.0)
        raw = M.single_label(targets, M.softmax(logits, 1.0))
        calibrated = M.single_label(targets, M.softmax(logits, t))
        report["metrics"] = calibrated
        report["uncalibrated"] = {k: raw[k] for k in ("accuracy", "ece", "mce", "brier", "log_loss")}
        report["reliability"] = {k: v.tolist() for k, v in M.calibration_bins(targets, M.softmax(logits, t)).items()}
        report["reliability_uncalibrated"] = {k: v.tolist()
                                              for k, v in M.calibration_bins(targets, M.softmax(logits)).items()}
    elif problem_type == "multi_label":
        th = np.asarray(calibration.get("thresholds", np.full(logits.shape[1], 0.5)))
        report["metrics"] = M.multi_label(targets, M.sigmoid(logits), th)
    else:
        report["metrics"] = M.regression(targets, logits)
    report["headline"] = _headline(problem_type, logits, np.asarray(targets), calibration, seed)
    return report


def _markdown(report: dict) -> str:
    m, labels = report["metrics"], report["labels"]
    lines = [f"# Classification report ({report['problem_type']})", "",
             f"{report['examples']} examples: {report['source']}", "", "| metric | value | 95% CI |",
             "| --- | --- | --- |"]
    for name, v in report["headline"].items():
        lines.append(f"| {name} | {v['value']:.4f} | [{v['ci'][0]:.4f}, {v['ci'][1]:.4f}] |")
    scalars = {k: v for k, v in m.items() if isinstance(v, float) and k not in report["headline"]}
    lines += ["", "| metric | value |", "| --- | --- |", *[f"| {k} | {v:.4f} |" for k, v in scalars.items()]]
    if report["problem_type"] == "single_label":
        raw, t = report["uncalibrated"], report["calibration"].get("temperature", 1.0)
        lines += ["", f"## Calibration ({report['ece_bins']} equal-width confidence bins)", "",
                  f"Temperature {t:.4f} (fitted on validation). Accuracy is unchanged by it.", "",
                  "| | ECE | MCE | Brier | log loss |", "| --- | --- | --- | --- | --- |",
                  f"| before (T=1) | {raw['ece']:.4f} | {raw['mce']:.4f} | {raw['brier']:.4f} "
                  f"| {raw['log_loss']:.4f} |",
                  f"| after (T={t:.3g}) | {m['ece']:.4f} | {m['mce']:.4f} | {m['brier']:.4f} | {m['log_loss']:.4f} |",
                  "", "## Per class", "", "| label | precision | recall | F1 | support |",
                  "| --- | --- | --- | --- | --- |"]
        pc = m["per_class"]
        for i, name in enumerate(labels):
            lines.append(f"| {name} | {pc['precision'][i]:.4f} | {pc['recall'][i]:.4f} | {pc['f1'][i]:.4f} | "
                         f"{int(pc['support'][i])} |")
        lines += ["", "## Confusion matrix (rows: true, columns: predicted)", "",
                  "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for i, row in enumerate(m["confusion"]):
            lines.append(f"| {labels[i]} | " + " | ".join(str(x) for x in row) + " |")
        lines += ["", "![confusion matrix](confusion_matrix.png) ![reliability diagram](reliability.png)"]
    elif report["problem_type"] == "multi_label":
        th = report["calibration"].get("thresholds")
        lines += ["", "| label | F1 | support | threshold |", "| --- | --- | --- | --- |"]
        for i, name in enumerate(labels):
            lines.append(f"| {name} | {m['per_label_f1'][i]:.4f} | {int(m['support'][i])} | "
                         f"{th[i] if th else 0.5:.3f} |")
    return "\n".join(lines) + "\n"


def _plots(report: dict, folder: Path) -> list[Path]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'entrenar[plot]'): report images skipped", stacklevel=2)
        return []

    def figure(**kwargs):
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    written = []
    m, labels = report["metrics"], report["labels"]
    counts = np.array(m["confusion"], dtype=np.float64)
    normalised = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    fig = figure(figsize=(4 + 1.2 * len(labels), 2 + 0.6 * len(labels)))
    axes = fig.subplots(1, 2)
    for ax, values, title, fmt in ((axes[0], counts, "counts", "{:.0f}"),
                                   (axes[1], normalised, "normalised by true class", "{:.2f}")):
        ax.imshow(values, cmap="Blues")
        ax.set_title(title)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        for i in range(len(labels)):
            for j in range(len(labels)):
                ax.text(j, i, fmt.format(values[i, j]), ha="center", va="center", fontsize=8)
    fig.tight_layout()
    path = folder / "confusion_matrix.png"
    atomic.write_file(path, lambda p: fig.savefig(p, format="png", dpi=100))
    written.append(path)

    fig = figure(figsize=(5, 5))
    ax = fig.subplots()
    bins = report["ece_bins"]
    centers = (np.arange(bins) + 0.5) / bins
    for key, label, offset in (("reliability_uncalibrated", "T=1", -0.25), ("reliability", "calibrated", 0.25)):
        b = report[key]
        used = np.array(b["count"]) > 0
        ax.bar(centers[used] + offset / bins, np.array(b["accuracy"])[used], width=0.5 / bins,
               label=f"accuracy ({label})")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set_xlabel(f"confidence ({bins} equal-width bins)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = folder / "reliability.png"
    atomic.write_file(path, lambda p: fig.savefig(p, format="png", dpi=100))
    written.append(path)
    return written


def write_report(report: dict, folder: str | Path) -> list[Path]:
    """report.json, report.md and (single-label) the two PNGs in ``folder``; returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_text(folder / "report.json", json.dumps(report, indent=2) + "\n")
    atomic.write_text(folder / "report.md", _markdown(report))
    written = [folder / "report.json", folder / "report.md"]
    if report["problem_type"] == "single_label":
        written += _plots(report, folder)
    return written
