"""Run metrics: one JSON line per optimizer step in ``<run>/metrics.jsonl``, a closing summary, a loss plot.

Train lines: ``{"step", "loss", "grad_norm", "lr", "tokens", "total_tokens",
"tokens_per_s", "elapsed_s"}`` plus ``"peak_mem_gb"`` on CUDA, ``"peak_mem_gb_ranks"`` (each rank's) in a
distributed run, whose tokens are the whole global step's, and ``"skipped": reason`` on a step whose update
was dropped (training.nonfinite: skip) or ``"scaler_skipped": true`` where fp16's GradScaler dropped it. Eval
lines: ``{"step", "eval_loss", "eval_ppl"}``. Non-finite numbers are written as
``null`` so the file stays strict JSON. Step numbers are whatever the loop
counts, and must be the same count its checkpoints use, since resuming at
step N drops every line after N.

The same numbers, at the same steps, also go to the experiment trackers the logger is given (TensorBoard,
MLflow, Weights & Biases: :mod:`entrenar.train.trackers`), tagged ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``eval/loss``, ``eval/ppl``...
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from entrenar.errors import CheckpointError
from entrenar.io import atomic
from entrenar.io.run_dir import METRICS_FILE
from entrenar.train.trackers import Tracker, scalars

if TYPE_CHECKING:
    from typing_extensions import Self


def _number(value: Any) -> float | None:
    value = float(value)  # also 0-dim tensors
    return value if math.isfinite(value) else None


def _parse_lines(path: Path, data: bytes) -> list[tuple[bytes, dict]]:
    """Complete lines of a metrics file with their parsed records.

    A last line without its newline is a write cut short by a crash and is
    dropped; any other line that is not a JSON object with a "step" is an error.
    """
    lines = data.split(b"\n")[:-1]  # the piece after the last newline is empty or cut short
    parsed = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}:{number}: not a JSON line ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise CheckpointError(f"{path}:{number}: a metrics line must be a JSON object with an integer 'step'")
        parsed.append((line, record))
    return parsed


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a ``metrics.jsonl`` file, in order."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: metrics file is missing") from None
    return [record for _, record in _parse_lines(path, data)]


class MetricsLogger:
    """Append-only JSONL log of a run, one flushed line per call.

    ``resume_step=None`` starts a new run and replaces any existing file;
    ``resume_step=N`` keeps the lines with ``step <= N`` (rewritten atomically,
    byte for byte) and carries on from them: elapsed time, total tokens and the
    best eval loss continue where step N left them. ``clock`` is injectable for
    tests. ``trackers`` (:func:`~entrenar.train.trackers.open_trackers`) get each line's numbers and the files
    given to :meth:`log_artifacts`, and are closed with the logger (as failed after an error or an interrupt).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        resume_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        write: bool = True,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.total_tokens = 0
        self.last_step: int | None = None
        self.last_loss: float | None = None
        self.best_eval: tuple[int, float] | None = None  # (step, eval_loss)
        self._elapsed_before = 0.0
        self._timed: list[tuple[int, int, float]] = []  # (step, tokens, seconds) of the steps this process ran
        kept: list[bytes] = []
        if resume_step is not None and self.path.exists():
            for line, record in _parse_lines(self.path, self.path.read_bytes()):
                if record["step"] <= resume_step:
                    kept.append(line)
                    self._absorb(record)
        self._file = None  # write=False (the other ranks of a distributed run): counts kept, nothing written
        if write:
            atomic.write_bytes(self.path, b"".join(line + b"\n" for line in kept))  # a crash leaves the old file whole
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open until close())
        self._start = self._last = clock()
        self.trackers = list(trackers) if write else []  # the other ranks of a distributed run log nowhere

    def _absorb(self, record: dict) -> None:
        if "loss" in record:
            self.last_step, self.last_loss = record["step"], record["loss"]
            self.total_tokens = record.get("total_tokens", self.total_tokens)
            self._elapsed_before = record.get("elapsed_s", self._elapsed_before)
        if record.get("eval_loss") is not None and (self.best_eval is None or record["eval_loss"] < self.best_eval[1]):
            self.best_eval = (record["step"], record["eval_loss"])

    @property
    def elapsed_s(self) -> float:
        """Training wall time, including the time before a resume."""
        return self._elapsed_before + (self._clock() - self._start)

    def _write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self.trackers:
            numbers = scalars(record)
            for tracker in self.trackers:
                tracker.log_metrics(numbers, record["step"])

    def log_step(
        self,
        step: int,
        loss: float | torch.Tensor,
        grad_norm: float | torch.Tensor | None,
        lr: float,
        tokens: int,
        step_time_s: float | None = None,
        flags: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict:
        """Log one optimizer step; ``tokens`` are those processed in it.

        Throughput is ``tokens / step_time_s``, or over the wall time since the
        previous call (or since construction) when ``step_time_s`` is None.
        ``flags`` (``{"skipped": reason}``...) and ``extra`` (MoE router diagnostics, each rank's peak memory
        in a distributed run) are added to the record. Returns the record written.
        """
        now = self._clock()
        seconds = step_time_s if step_time_s is not None else now - self._last
        self._last = now
        self.total_tokens += int(tokens)
        self._timed.append((int(step), int(tokens), seconds))
        record: dict[str, Any] = {
            "step": int(step),
            "loss": _number(loss),
            "grad_norm": None if grad_norm is None else _number(grad_norm),
            "lr": float(lr),
            "tokens": int(tokens),
            "total_tokens": self.total_tokens,
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "elapsed_s": round(self.elapsed_s, 3),
        }
        record.update(extra or {})  # e.g. the MoE router diagnostics (entrenar.train.moe)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        record.update(flags or {})
        self._write(record)
        self.last_step, self.last_loss = record["step"], record["loss"]
        return record

    def log_eval(self, step: int, eval_loss: float | torch.Tensor) -> bool:
        """Log an evaluation; returns True when it is the best (lowest) eval loss so far."""
        loss = _number(eval_loss)
        try:
            ppl = _number(math.exp(loss)) if loss is not None else None
        except OverflowError:
            ppl = None
        self._write({"step": int(step), "eval_loss": loss, "eval_ppl": ppl})
        if loss is None or (self.best_eval is not None and loss >= self.best_eval[1]):
            return False
        self.best_eval = (int(step), loss)
        return True

    def steady_rate(self) -> tuple[float, int, int] | None:
        """(tokens/s, first step, last step) of the steps past start-up: the first fifth of the steps this process
        ran (at least one: compilation, CUDA graph capture, allocator warm-up) left out; None below 3 steps."""
        if len(self._timed) < 3:
            return None
        kept = self._timed[max(1, -(-len(self._timed) // 5)):]
        seconds = sum(s for _, _, s in kept)
        return (sum(t for _, t, _ in kept) / seconds, kept[0][0], kept[-1][0]) if seconds > 0 else None

    def summary(self, checkpoint: str | os.PathLike | None = None, extra: Sequence[tuple[str, str]] = (),
                perplexity: bool = True) -> str:
        """The closing summary of this run so far (see :func:`summary`)."""
        return summary(
            steps=self.last_step or 0,
            elapsed_s=self.elapsed_s,
            final_loss=self.last_loss,
            tokens=self.total_tokens,
            steady=self.steady_rate(),
            checkpoint=checkpoint,
            best_eval=self.best_eval,
            extra=extra,
            perplexity=perplexity,
        )

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """Hand the run folder's files (:func:`~entrenar.train.trackers.run_artifacts`) to the trackers."""
        for tracker in self.trackers:
            tracker.log_artifacts(paths)

    def close(self, ok: bool = True) -> None:
        if self._file is not None:
            self._file.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close(ok)
            except Exception as error:
                if ok:
                    raise
                # the error that stopped the run is the one to report
                warnings.warn(f"{type(tracker).__name__} could not close its run: {error}", stacklevel=2)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(ok=exc_type is None)


def format_duration(seconds: float) -> str:
    """``12.3s``, ``4m 05s`` or ``1h 02m 03s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def summary(
    *,
    steps: int,
    elapsed_s: float,
    final_loss: float | None = None,
    tokens: int | None = None,
    steady: tuple[float, int, int] | None = None,
    checkpoint: str | os.PathLike | None = None,
    best_eval: tuple[int, float] | None = None,
    extra: Sequence[tuple[str, str]] = (),
    perplexity: bool = True,
) -> str:
    """Format the end-of-training summary, one aligned ``key  value`` row per fact (``extra`` rows last);
    ``perplexity``: the best eval loss's exp beside it (a language model's; not a classifier's). ``steady``:
    (tokens/s, first step, last step) past start-up, shown before the whole run's rate (which counts start-up,
    compilation, graph capture and evaluations)."""
    rows = [("steps", f"{steps:,}"), ("time", format_duration(elapsed_s))]
    if final_loss is not None:
        rows.append(("final loss", f"{final_loss:.4f}"))
    if tokens:
        rate = f"{tokens / elapsed_s:,.0f} tokens/s" if elapsed_s > 0 else "n/a"
        if steady is not None:
            rows.append(("throughput", f"{steady[0]:,.0f} tokens/s in steady state (steps {steady[1]:,}-"
                                       f"{steady[2]:,}); {rate} over the whole run ({tokens:,} tokens)"))
        else:
            rows.append(("throughput", f"{rate} ({tokens:,} tokens)"))
    if best_eval is not None:
        step, loss = best_eval
        ppl = f" (ppl {math.exp(loss) if loss < 700 else math.inf:.2f})" if perplexity else ""
        rows.append(("best eval", f"loss {loss:.4f}{ppl} at step {step:,}"))
    if checkpoint is not None:
        rows.append(("checkpoint", str(checkpoint)))
    rows.extend(extra)
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


EMA_WEIGHT = 0.9  # TensorBoard's default smoothing of the loss curve


def smooth(values: Sequence[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Exponential moving average, bias-corrected as TensorBoard's: ``s_t = w s_{t-1} + (1-w) x_t``, divided by
    ``1 - w**t`` so the first points are not pulled towards zero."""
    out, last = [], 0.0
    for i, value in enumerate(values, start=1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**i))
    return out


def plot_loss_curve(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Draw the loss (raw, its EMA and the eval points) and, below it, the learning rate against step.

    Needs matplotlib (``pip install 'entrenar[plot]'``); without it, warns and
    returns None. Uses the Agg canvas directly, so no global backend is changed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'entrenar[plot]'): loss curve skipped", stacklevel=2)
        return None
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    lrs = [(r["step"], r["lr"]) for r in records if r.get("lr") is not None]
    if not train and not evals:
        raise CheckpointError(f"{metrics_path}: no loss values to plot")

    fig = Figure(figsize=(7, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax, ax_lr = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if train:
        steps, values = zip(*train)
        ax.plot(steps, values, linewidth=0.8, alpha=0.35, color="C0", label="train loss")
        ax.plot(steps, smooth(values), linewidth=1.5, color="C0", label=f"train loss, EMA {EMA_WEIGHT:g}")
    if evals:
        ax.plot(*zip(*evals), "o-", markersize=4, color="C1", label="eval loss")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if lrs:
        ax_lr.plot(*zip(*lrs), linewidth=1, color="C2")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic.write_file(out, lambda tmp: fig.savefig(tmp, format="png"))
