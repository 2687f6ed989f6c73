"""Every export checks itself: what was written, read back as a user reads it, against the model as trained.

    report = verify_export("runs/qlora", None, [Path("out"), Path("out/model-q4_0.gguf")], level="quick")

The reference is the model as trained: base + adapter, on the NF4 base for a QLoRA run (``lora.quantize_base``).
Each export is loaded with the reader a user's tools use: entrenar's loader for a folder, entrenar's GGUF loader
(the ``gguf`` package's reader) for a GGUF file, and, where llama-cpp-python is installed, llama.cpp itself
(:mod:`entrenar.export.llama_cpp_check`: its own section of the report, same thresholds); where it is not, the report
says so. Both are scored on held-out data: ``data`` if given, else the run's ``data.validation``
file, else a few built-in texts (the report says which) with :func:`entrenar.evaluation.compare.compare_models`.

``export_report.json`` goes into an exported folder (``<name>.export_report.json`` beside a lone ``.gguf``),
written atomically. ``quick`` scores about :data:`QUICK_TOKENS` tokens; ``full`` the whole held-out file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from entrenar.data.batching import Batch
from entrenar.errors import ConfigError
from entrenar.evaluation.compare import (
    MAX_KL,
    MIN_TOP1,
    PROMPTS,
    Comparison,
    compare_models,
    format_comparison,
    held_out_batches,
)
from entrenar.evaluation.loss import eval_loss
from entrenar.evaluation.rules import eval_rules
from entrenar.export import export, load_merged
from entrenar.export.llama_cpp_check import NOT_INSTALLED, llama_cpp_comparison, llama_cpp_version
from entrenar.io import atomic
from entrenar.loading import load, require_tokenizer
from entrenar.loading.runs import resolve_model_and_adapter
from entrenar.models.transformer import Transformer

VERIFY_LEVELS = ("none", "quick", "full")
QUICK_TOKENS = 256
REPORT_FILE = "export_report.json"


@dataclass
class ExportCheck:
    """One written file or folder compared with the trained model."""

    path: Path
    reader: str
    comparison: Comparison

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "reader": self.reader, **self.comparison.to_json()}


@dataclass
class ExportReport:
    """The whole report: what was compared, on what data, and each export's comparison."""

    reference: str
    data: str
    level: str
    checks: list[ExportCheck] = field(default_factory=list)
    merge_bases: dict[str, float] = field(default_factory=dict)  # QLoRA: held-out loss of each merge base
    merge_base: str | None = None
    skipped: str | None = None  # why nothing was compared
    llama_cpp: str = NOT_INSTALLED  # llama-cpp-python's version when installed
    llama_cpp_checks: list[ExportCheck] = field(default_factory=list)  # each GGUF run through llama.cpp

    @property
    def problems(self) -> list[str]:
        return ([f"{c.path.name}: {p}" for c in self.checks for p in c.comparison.problems()]
                + [f"{c.path.name} in llama.cpp: {p}" for c in self.llama_cpp_checks for p in c.comparison.problems()])

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "data": self.data, "level": self.level, "merge_base": self.merge_base,
                "merge_bases": self.merge_bases, "skipped": self.skipped,
                "checks": [c.to_json() for c in self.checks],
                "llama.cpp": {"version": self.llama_cpp, "checks": [c.to_json() for c in self.llama_cpp_checks]},
                "problems": self.problems, "ok": not self.problems}

    def lines(self) -> list[str]:
        """The short printed report."""
        if self.skipped:
            return [f"verify: {self.skipped}"]
        out = [f"verify ({self.level}) against {self.reference} on {self.data}"]
        if self.merge_bases:
            out.append("merge bases, held-out loss: " + "  ".join(
                f"{name} {loss:.4f}{' (used)' if name == self.merge_base else ''}"
                for name, loss in self.merge_bases.items()))
        for check in self.checks:
            out.append(f"-- {check.path} (read with {check.reader})")
            out += ["   " + line for line in format_comparison(check.comparison)]
        if any(c.path.suffix == ".gguf" for c in self.checks):
            out.append(f"llama.cpp: {self.llama_cpp}")
            for check in self.llama_cpp_checks:
                out.append(f"-- {check.path} (run by {check.reader})")
                out += ["   " + line for line in format_comparison(check.comparison, candidate="llama.cpp")]
                out.append("   llama.cpp greedy generation stopped (end of generation) in "
                           f"{sum(x.candidate_stopped for x in check.comparison.continuations)}/"
                           f"{len(check.comparison.continuations)} prompts, the trained model in "
                           f"{sum(x.reference_stopped for x in check.comparison.continuations)}")
        return out


def check_level(level: str) -> str:
    if level not in VERIFY_LEVELS:
        raise ConfigError(f"verify level {level!r} must be one of {', '.join(VERIFY_LEVELS)}")
    return level


def verify_export(
    model_path: str | Path,
    adapter: str | Path | None,
    written: Sequence[Path],
    level: str = "quick",
    data: str | Path | None = None,
    max_kl: float = MAX_KL,
    min_top1: float | None = MIN_TOP1,
    merge_base: str | None = None,
    other_base: Transformer | None = None,
) -> ExportReport:
    """Compare each written export (a model folder or a .gguf file) with the model as trained, and write the report
    beside the first one. ``merge_base`` names the base the adapter was merged into; ``other_base`` (a QLoRA run's
    merge into the other base) is scored too, so the report shows both bases' held-out losses."""
    check_level(level)
    source = resolve_model_and_adapter(model_path, adapter)
    reference, ref_tok = load(model_path, adapter=adapter, dtype=torch.float32, device="cpu",
                              quantize=source.quantize_base)
    if ref_tok is None:  # a folder without tokenizer.json: nothing to score text with
        return ExportReport(reference=str(source.model), data="none", level=level,
                            skipped="the model has no tokenizer (no tokenizer.json): not verified")
    rules = eval_rules(source.recipe)
    split = None
    if data is None and source.recipe is not None:
        d = source.recipe.data
        if d.validation is not None:
            data = _run_path(source.run_dir, d.validation)
        elif d.validation_split > 0 and isinstance(d.train, str):
            data, split = _run_path(source.run_dir, d.train), (d.validation_split, source.recipe.training.seed)
    batches, data_name = held_out_batches(ref_tok, data, rules, split=split)
    max_tokens = QUICK_TOKENS if level == "quick" else None
    prompts, new_tokens = (PROMPTS, 16) if level == "quick" else (PROMPTS, 64)
    what = "base + adapter as trained" if source.adapter or source.checkpoint else "the input model"
    if source.quantize_base:
        what += f" ({source.quantize_base} base)"
    report = ExportReport(reference=f"{source.model}: {what}", data=data_name, level=level, merge_base=merge_base)
    version = llama_cpp_version()
    if version is not None:
        report.llama_cpp = f"llama-cpp-python {version}"
    for path in written:
        if path.is_dir() and not (path / "config.json").is_file():
            continue  # an adapter folder: not a model to compare
        reader = "entrenar GGUF loader (gguf package reader)" if path.suffix == ".gguf" else "entrenar.load"
        candidate, cand_tok = load(path, dtype=torch.float32, device="cpu")
        comparison = compare_models(reference, ref_tok, candidate, require_tokenizer(cand_tok, path), batches,
                                    max_tokens, prompts, new_tokens, max_kl=max_kl, min_top1=min_top1)
        report.checks.append(ExportCheck(path, reader, comparison))
        if merge_base is not None and path.suffix != ".gguf" and merge_base not in report.merge_bases:
            report.merge_bases[merge_base] = comparison.candidate_loss
        del candidate
        if path.suffix == ".gguf" and version is not None:  # the same file, run by llama.cpp itself
            cpp = llama_cpp_comparison(path, reference, ref_tok, batches, max_tokens, prompts, new_tokens,
                                       max_kl=max_kl, min_top1=min_top1)
            report.llama_cpp_checks.append(ExportCheck(path, f"llama.cpp (llama-cpp-python {version})", cpp))
    if other_base is not None and merge_base is not None:
        other = "full" if merge_base == "trained" else "trained"
        report.merge_bases[other] = eval_loss(other_base.float(), _capped(batches, max_tokens)).loss
        report.merge_bases["as trained"] = report.checks[0].comparison.reference_loss if report.checks else float("nan")
    if report.checks:
        write_report(report, written[0])
    return report


def _run_path(run_dir: Path | None, name: str) -> Path:
    """A data path of a run's recipe: as written, else from the folders above the run (training ran from one)."""
    path = Path(name)
    if path.is_absolute() or path.exists() or run_dir is None:
        return path
    return next((f / path for f in run_dir.absolute().parents if (f / path).exists()), path)


def _capped(batches: list[Batch], max_tokens: int | None) -> list[Batch]:
    """The leading batches :func:`compare_logits` scores under the same token cap."""
    if max_tokens is None:
        return batches
    kept, tokens = [], 0
    for batch in batches:
        kept.append(batch)
        tokens += int((batch["labels"][:, 1:] != -100).sum())
        if tokens >= max_tokens:
            break
    return kept


def report_path(export: Path) -> Path:
    """Where the report of an export goes: inside a folder, beside a lone .gguf file."""
    return export.with_name(f"{export.stem}.{REPORT_FILE}") if export.suffix == ".gguf" else export / REPORT_FILE


def write_report(report: ExportReport, export: Path) -> Path:
    """``export_report.json`` (atomically)."""
    return atomic.write_text(report_path(export), json.dumps(report.to_json(), indent=2, default=str) + "\n")





def export_verified(
    model_path: str | Path,
    adapter: str | Path | None,
    output: str | Path,
    verify: str = "quick",
    data: str | Path | None = None,
    max_kl: float = MAX_KL,
    min_top1: float | None = MIN_TOP1,
    merge_base: str = "full",
    **export_kwargs: Any,
) -> tuple[list[Path], ExportReport | None]:
    """:func:`entrenar.export.export`, then :func:`verify_export` of what it wrote (None: ``verify="none"``, or
    only an adapter was written). A QLoRA run's merge is also made, in memory, into the other base, so the report
    gives both bases' held-out losses."""
    check_level(verify)
    written = export(model_path, adapter, output, merge_base=merge_base, **export_kwargs)
    models = [p for p in written if p.suffix == ".gguf" or (p / "config.json").is_file()]
    if verify == "none" or not models:
        return written, None
    source = resolve_model_and_adapter(model_path, adapter)
    other = None
    qlora = source.quantize_base is not None
    if qlora:
        other, _ = load_merged(model_path, adapter, "float32", merge_base="full" if merge_base == "trained"
                               else "trained")
    report = verify_export(model_path, adapter, models, verify, data, max_kl, min_top1,
                           merge_base=merge_base if qlora else None, other_base=other)
    return written, report
__all__ = ["QUICK_TOKENS", "REPORT_FILE", "VERIFY_LEVELS", "ExportReport", "export_verified", "report_path",
           "verify_export"]
