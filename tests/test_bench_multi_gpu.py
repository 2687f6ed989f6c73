"""bench/multi_gpu.py's summary over rounds: medians and ranges of the runs that finished; a failed run (whose
record has no process count, as a refused start or a stopped run reports) is left out instead of losing the
call's results (2026-11-27: a run stopped at its replica check and the aggregate raised KeyError)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import multi_gpu  # noqa: E402


def _ok(launch: str, gpus: int, tps: float, efficiency: float | None = None) -> dict:
    row = {"status": "ok", "launch": launch, "gpus": gpus, "tokens_per_s": tps, "peak_gb_ranks": [9.9] * gpus}
    return row if efficiency is None else {**row, "efficiency": efficiency}


def test_aggregate_leaves_failed_runs_out():
    runs = [_ok("plain process", 1, 100.0), _ok("torchrun, 2 process(es)", 2, 190.0, 0.95),
            {"status": "failed", "exit": 2, "error": "step 10: ...", "launch": "torchrun, 4 process(es)", "round": 1},
            _ok("plain process", 1, 102.0), _ok("torchrun, 2 process(es)", 2, 180.0, 0.88)]
    rows = {r["launch"]: r for r in multi_gpu.aggregate(runs)}
    assert set(rows) == {"plain process", "torchrun, 2 process(es)"}
    two = rows["torchrun, 2 process(es)"]
    assert two["runs"] == 2 and two["tokens_per_s_median"] == 185 and two["efficiency_min"] == 0.88
    assert rows["plain process"]["tokens_per_s_max"] == 102.0


def test_a_run_its_time_cut_keeps_the_steps_it_logged(tmp_path):
    """A run stopped by its time limit (exit 124) after logging steps is "cut" with their rates and every rank's
    peak (the full 8B fine-tune's final save outlasted a call); one that logged nothing past the skipped steps,
    or that failed otherwise, is "failed" with its log."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    run_dir.mkdir()
    log.write_text("stopped while saving\n")
    steps = [{"step": i, "loss": 3.0 - i / 10, "tokens": 32768, "tokens_per_s": 30000.0 + i,
              "peak_mem_gb_ranks": [70.1, 70.3, 70.2, 70.0]} for i in range(1, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    cut = multi_gpu.outcome(run_dir, log, 124, 4, 2, 300.0)
    assert cut["status"] == "cut" and cut["steps"] == 4 and cut["peak_gb_ranks"] == [70.1, 70.3, 70.2, 70.0]
    assert cut["per_gpu"] == round(cut["tokens_per_s"] / 4) and 30003 <= cut["tokens_per_s"] <= 30004
    assert multi_gpu.outcome(run_dir, log, 124, 4, 4, 300.0)["status"] == "failed"
    assert multi_gpu.outcome(run_dir, log, 1, 4, 2, 300.0) == {"status": "failed", "exit": 1,
                                                               "error": "stopped while saving\n"}


_PARENT_AND_CHILD = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(60)
"""


def test_a_stopped_or_timed_out_run_takes_its_workers_with_it(tmp_path):
    """run() kills the launcher and every process below it, and returns once they are gone: a worker (here the
    launcher's child, in a session of its own as torchrun starts them) does not live on holding its GPU into the
    next run. ``stop`` ends it early with its own code; the timeout with 124."""
    import time

    for stop, timeout, expected in ((lambda: (tmp_path / "child").exists(), 30.0, multi_gpu.STOPPED),
                                    (None, 3.0, 124)):
        (tmp_path / "child").unlink(missing_ok=True)
        started = time.perf_counter()
        code, wall = multi_gpu.run([sys.executable, "-c", _PARENT_AND_CHILD, str(tmp_path / "child")],
                                   tmp_path / "log", timeout, stop)
        assert code == expected and wall < 20 and time.perf_counter() - started < 20
        assert not multi_gpu.alive(int((tmp_path / "child").read_text()))


def test_a_run_stopped_after_its_last_step_is_ok_and_says_the_save_was_skipped(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    run_dir.mkdir()
    log.write_text("")
    steps = [{"step": i, "loss": 3.0, "tokens": 1000, "tokens_per_s": 500.0, "peak_mem_gb_ranks": [1.0, 1.5]}
             for i in range(1, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    row = multi_gpu.outcome(run_dir, log, multi_gpu.STOPPED, 2, 1, 10.0)
    assert row["status"] == "ok" and "skipped" in row["final_save"] and row["peak_gb_ranks"] == [1.0, 1.5]
