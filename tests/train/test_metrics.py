"""metrics.jsonl logging, truncation on resume, the closing summary and the loss plot."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
import torch

from entrenar.errors import CheckpointError
from entrenar.train.metrics import MetricsLogger, format_duration, plot_loss_curve, read_metrics, summary


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_step_and_eval_lines_are_written_and_flushed(tmp_path: Path) -> None:
    clock = FakeClock()
    logger = MetricsLogger(tmp_path, clock=clock)
    clock.now += 2.0
    logger.log_step(1, torch.tensor(2.5), torch.tensor(0.75), 1e-4, tokens=1000)
    clock.now += 0.5
    logger.log_step(2, 2.25, 0.5, 2e-4, tokens=400)
    logger.log_step(3, 2.0, None, 2e-4, tokens=300, step_time_s=0.25)
    assert logger.log_eval(3, 1.5) is True
    # Read before close: every line is already on disk.
    lines = _lines(tmp_path)
    on_cuda = torch.cuda.is_available()
    assert all(("peak_mem_gb" in line) == on_cuda for line in lines[:3])  # peak GPU memory only where there is a GPU
    for line in lines:
        line.pop("peak_mem_gb", None)
    assert lines[0] == {
        "step": 1,
        "loss": 2.5,
        "grad_norm": 0.75,
        "lr": 1e-4,
        "tokens": 1000,
        "total_tokens": 1000,
        "tokens_per_s": 500.0,
        "elapsed_s": 2.0,
    }
    assert lines[1]["tokens_per_s"] == 800.0 and lines[1]["total_tokens"] == 1400 and lines[1]["elapsed_s"] == 2.5
    assert lines[2]["tokens_per_s"] == 1200.0 and lines[2]["grad_norm"] is None
    assert lines[3] == {"step": 3, "eval_loss": 1.5, "eval_ppl": pytest.approx(math.exp(1.5))}
    logger.close()


def test_non_finite_values_stay_strict_json(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log_step(1, float("nan"), float("inf"), 1e-4, tokens=10)
        assert logger.log_eval(1, 1000.0) is True  # exp overflows: ppl is null, the loss still counts
        assert logger.log_eval(2, 2000.0) is False
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    lines = _lines(tmp_path)
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None
    assert lines[1] == {"step": 1, "eval_loss": 1000.0, "eval_ppl": None}


def _write_run(run: Path) -> bytes:
    clock = FakeClock()
    with MetricsLogger(run, clock=clock) as logger:
        for step in range(1, 6):
            clock.now += 1.0
            logger.log_step(step, 3.0 - step / 10, 1.0, 1e-4, tokens=100)
            if step in (2, 4):
                logger.log_eval(step, {2: 2.0, 4: 1.8}[step])
    return (run / "metrics.jsonl").read_bytes()


def test_resume_truncates_after_the_checkpoint_step(tmp_path: Path) -> None:
    original = _write_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 6, "loss": 2.4, "gra')  # a line cut short by a crash
    clock = FakeClock()
    logger = MetricsLogger(tmp_path, resume_step=3, clock=clock)
    kept = original.split(b"\n")[:4]  # steps 1, 2, eval 2, step 3: byte for byte
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"\n".join(kept) + b"\n"
    assert logger.best_eval == (2, 2.0) and logger.total_tokens == 300 and logger.last_step == 3
    clock.now += 1.5
    record = logger.log_step(4, 2.6, 1.0, 1e-4, tokens=100)
    assert record["elapsed_s"] == 4.5 and record["total_tokens"] == 400  # continues from step 3 (3.0 s)
    logger.close()
    assert [line["step"] for line in _lines(tmp_path)] == [1, 2, 2, 3, 4]


def test_new_run_replaces_old_metrics(tmp_path: Path) -> None:
    _write_run(tmp_path)
    MetricsLogger(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""


def test_corrupt_line_is_reported_and_file_left_alone(tmp_path: Path) -> None:
    original = _write_run(tmp_path)
    lines = original.split(b"\n")
    lines[2] = b"{not json"
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(CheckpointError, match=r"metrics.jsonl:3: not a JSON line"):
        MetricsLogger(tmp_path, resume_step=4)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"\n".join(lines)
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    with pytest.raises(CheckpointError, match=r"metrics.jsonl:1: .* integer 'step'"):
        read_metrics(tmp_path / "metrics.jsonl")
    with pytest.raises(CheckpointError, match="metrics file is missing"):
        read_metrics(tmp_path / "nope.jsonl")


def test_summary_formats_the_run() -> None:
    text = summary(
        steps=1200,
        elapsed_s=3723.4,
        final_loss=1.23456,
        tokens=4_800_000,
        checkpoint="runs/a/checkpoints/step-1200",
        best_eval=(1000, 1.1),
    )
    assert text.splitlines() == [
        "steps       1,200",
        "time        1h 02m 03s",
        "final loss  1.2346",
        "throughput  1,289 tokens/s (4,800,000 tokens)",
        f"best eval   loss 1.1000 (ppl {math.exp(1.1):.2f}) at step 1,000",
        "checkpoint  runs/a/checkpoints/step-1200",
    ]
    assert [format_duration(s) for s in (4.25, 65, 3600)] == ["4.2s", "1m 05s", "1h 00m 00s"]


def test_logger_summary_uses_what_it_logged(tmp_path: Path) -> None:
    _write_run(tmp_path)
    with MetricsLogger(tmp_path, resume_step=5) as logger:
        text = logger.summary(checkpoint=tmp_path / "checkpoints" / "step-5")
    assert "steps       5" in text and "final loss  2.5000" in text and "at step 4" in text
    assert "(500 tokens)" in text


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_loss_curve_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _write_run(tmp_path)
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    assert _png_size(out) == (700, 550)  # loss panel over a learning-rate panel
    (tmp_path / "empty.jsonl").write_text('{"step": 1, "eval_loss": null, "eval_ppl": null}\n')
    with pytest.raises(CheckpointError, match="no loss values to plot"):
        plot_loss_curve(tmp_path / "empty.jsonl", tmp_path / "x.png")


def test_plot_without_matplotlib_warns_and_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_run(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import matplotlib...` raise ImportError
    with pytest.warns(UserWarning, match=r"entrenar\[plot\]"):
        assert plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()


def test_smoothing_is_tensorboards_debiased_ema() -> None:
    from entrenar.train.metrics import smooth

    # By hand, w = 0.5: the averages 0.5, 1.25, 2.125 divided by 1 - 0.5**t.
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert smooth([2.0] * 5) == pytest.approx([2.0] * 5)  # no pull towards zero at the start


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_the_numbers_of_metrics_jsonl_and_drops_them_after_a_resumed_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from entrenar.train.trackers import TensorBoardTracker

    with MetricsLogger(tmp_path, trackers=[TensorBoardTracker(tmp_path)]) as logger:
        for step in range(1, 5):
            logger.log_step(step, 3.0 - 0.25 * step, 0.5 * step, 1e-3 * step, tokens=100, step_time_s=0.5,
                            flags={"skipped": "x"} if step == 2 else None)
        logger.log_eval(4, 2.0)
    resumed = TensorBoardTracker(tmp_path, resume_step=2)  # crashed after 4, resumed from 2
    with MetricsLogger(tmp_path, resume_step=2, trackers=[resumed]) as logger:
        for step in (3, 4):
            logger.log_step(step, 9.0 + step, 0.1, 2e-3, tokens=100, step_time_s=0.5)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in lines if "loss" in r]
    assert scalars["train/lr"] == [(r["step"], pytest.approx(r["lr"])) for r in lines if "loss" in r]
    assert [s for s, _ in scalars["train/grad_norm"]] == [1, 2, 3, 4]
    assert scalars.get("eval/loss", []) == []  # the eval at step 4 came after the resumed step: purged


def test_tensorboard_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from entrenar.errors import ConfigError
    from entrenar.train.trackers import tensorboard_writer_class

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"output\.tensorboard: needs the tensorboard package \(pip install "
                                          r"'entrenar\[tensorboard\]'\)"):
        tensorboard_writer_class()


def test_summary_reports_the_steady_state_rate_beside_the_whole_run(tmp_path: Path) -> None:
    """A 10-step run whose first step took 9 s (compilation) and the rest 0.1 s each: the whole-run rate hides
    the steady rate the user will get on a long run; the summary shows both."""
    ticks = iter([0.0, 10.0, 12.0])  # construction, the summary's elapsed time (x2: rate and row)
    with MetricsLogger(tmp_path, clock=lambda: next(ticks, 12.0)) as logger:
        for step in range(1, 11):
            logger.log_step(step, 1.0, None, 1e-4, 1000, step_time_s=9.0 if step == 1 else 0.1)
        rate = logger.steady_rate()
        text = logger.summary()
    assert rate == pytest.approx((10_000.0, 3, 10))  # steps 1-2 (a fifth) left out
    assert "throughput  10,000 tokens/s in steady state (steps 3-10); 833 tokens/s over the whole run " \
           "(10,000 tokens)" in text
    with MetricsLogger(tmp_path / "short") as short:
        short.log_step(1, 1.0, None, 1e-4, 100, step_time_s=1.0)
        assert short.steady_rate() is None  # too few steps to tell start-up from steady state
