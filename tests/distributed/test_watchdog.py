"""The hung-rank watchdog without a process group: heartbeats' bounds, who is blamed, what is reported."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from entrenar.distributed import watchdog
from entrenar.distributed.launch import root_cause


def test_a_phase_may_take_the_startup_bound_then_the_steady_one_or_four_slowest_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(watchdog.HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    beat = watchdog.Heartbeat()
    beat.configure(30.0, 600.0)
    clock = iter(float(t) for t in range(0, 10_000, 1))
    monkeypatch.setattr(watchdog.time, "time", lambda: next(clock))
    beat.beat("loading")
    beat.flush()
    assert json.loads((tmp_path / "rank-3.json").read_text())["limit_s"] == 600.0
    limits = []
    for step in range(1, 5):
        beat.beat("data", step)
        beat.flush()
        limits.append(json.loads((tmp_path / "rank-3.json").read_text())["limit_s"])
    assert limits == [600.0, 600.0, 30.0, 30.0]  # the first two steps a process runs are its warm-up
    assert beat.limit("checkpoint") == 600.0 and beat.limit("evaluation") == 600.0
    beat.slowest_step = 20.0  # a slow model: four of its steps, not 30 s
    assert beat.limit("forward/backward") == 80.0
    beat.configure(None, 600.0)  # stall_timeout_s: null: no heartbeats
    (tmp_path / "rank-3.json").unlink()
    beat.beat("data", 5)
    beat.flush()
    assert not (tmp_path / "rank-3.json").exists()


def heartbeat(folder, rank, pid, phase, step, since, count, error_file):
    record = {"rank": rank, "pid": pid, "phase": phase, "step": step, "since": since, "limit_s": 5.0,
              "count": count, "attempt": 0, "error_file": str(error_file)}
    (folder / f"rank-{rank}.json").write_text(json.dumps(record))


@pytest.mark.timeout(30)
def test_the_stopped_rank_is_blamed_killed_and_reported_as_the_root_cause(tmp_path):
    """Rank 0 waits in a collective (its heartbeat later, one phase further); rank 1 is SIGSTOPped: rank 1 is
    named, with its phase and step, killed (a stopped process obeys SIGKILL), and its error file written."""
    waiting, stopped = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        stopped.send_signal(signal.SIGSTOP)
        for _ in range(200):  # the signal is delivered asynchronously
            if watchdog._state(stopped.pid) == "T":
                break
            time.sleep(0.01)
        now = time.time()
        heartbeat(tmp_path, 0, waiting.pid, "collective", 4, now - 6, 12, tmp_path / "error-0.json")
        heartbeat(tmp_path, 1, stopped.pid, "data", 4, now - 7, 11, tmp_path / "error-1.json")
        seen: list[watchdog.Stall] = []
        dog = watchdog.Watchdog(tmp_path, seen.append)
        assert dog.check(now - 3) is None  # nobody has overstayed yet
        stall = dog.check(now)
        assert stall is not None and seen == [stall]
        assert (stall.rank, stall.phase, stall.step, stall.stopped, stall.waiting) == (1, "data", 4, True, (0,))
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert waiting.poll() is None  # torchrun's agent stops the others, not the watchdog
        assert dog.check(now + 60) is None  # this attempt is settled: its waiting ranks are not blamed too
        failure = ProcessFailure(local_rank=1, pid=stopped.pid, exitcode=-9, error_file=str(tmp_path / "error-1.json"))
        lost = tmp_path / "error-0.json"
        lost.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed by peer",
                                                "extraInfo": {"timestamp": "1"}}}))
        assert root_cause({0: ProcessFailure(0, waiting.pid, 1, str(lost)), 1: failure}).startswith(
            "rank 1: stalled: no progress for 7 s in phase 'data' of step 4 (limit 5 s")
    finally:
        for process in (waiting, stopped):
            process.kill()
            process.wait()


def test_a_dead_workers_heartbeat_is_not_watched(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    heartbeat(tmp_path, 0, gone.pid, "data", 2, time.time() - 100, 3, tmp_path / "e.json")
    seen: list[watchdog.Stall] = []
    assert watchdog.Watchdog(tmp_path, seen.append).check() is None and seen == []
