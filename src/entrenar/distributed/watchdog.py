"""Hung ranks: each worker says what it is doing; the launcher stops a rank that stays at it too long.

A rank that dies is seen by torchrun's agent at once. A rank that hangs without dying (a stuck data read, a
deadlocked collective, a SIGSTOP) is not: the others wait in their next collective until
``training.dist_timeout_s``. Here every worker of a job entrenar launched writes a heartbeat file at each phase
of its work (:func:`beat`: ``loading``, ``data``, ``forward/backward``, ``collective``, ``evaluation``,
``checkpoint``) with the time it began and how long it may take; the launcher's :class:`Watchdog` reads the
files every second or so and, when a rank overstays its phase, names it and what it was doing, writes that into
the rank's torchrun error file and kills it (SIGKILL, which a stopped process obeys too). torchrun's agent then
treats it as a dead rank: with ``--max-restarts`` the job restarts and resumes from its last checkpoint, else
the launcher reports the stall as the root cause.

How long a phase may take (the worker decides, from the recipe):

- ``training.stall_startup_s`` for loading, evaluation, checkpoints and the first two steps a process runs
  (compilation, warm-up, a resume's first reads);
- afterwards, for a step's phases, ``training.stall_timeout_s`` or four times the slowest step this process has
  run since its warm-up, whichever is longer (a model whose steps take minutes is not stopped for being slow).

When several ranks overstay, the one that is behind is blamed: a stopped process first, then the rank that has
gone through the fewest phases (the others wait for it in a collective), then the one that began earliest.

Phases are marked on the host: on CUDA a hang inside a kernel shows in the phase that waits for its result
(``collective``, where the step's loss is read). Only jobs entrenar launched are watched (``entrenar train
--nproc-per-node``, :func:`entrenar.distributed.launch.launch_function`); under a user's own ``torchrun``,
``training.dist_timeout_s`` is the bound, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEARTBEAT_ENV = "ENTRENAR_HEARTBEAT_DIR"  # set by the launcher for its workers: where they write heartbeats
WARMUP_STEPS = 2  # steps a process runs under the startup bound
WRITE_INTERVAL_S = 0.25  # how often a worker's heartbeat thread writes a changed phase
SLOW_STEP_FACTOR = 4.0  # a steady phase may take this many times the slowest step seen
STEP_PHASES = ("data", "forward/backward", "collective")
PHASES = ("loading", *STEP_PHASES, "evaluation", "checkpoint")


class Heartbeat:
    """This worker's heartbeat file (a no-op outside a job entrenar launched, or before :meth:`configure`).

    :meth:`beat` only records the phase in memory (a dict built: microseconds on the training thread); a daemon
    thread writes it to the file every :data:`WRITE_INTERVAL_S` when it changed. The record holds when the phase
    began, so a writer a little late still tells the truth, and a stopped process stops both threads."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._record: dict[str, Any] | None = None
        self._written: dict[str, Any] | None = None
        self._writer: threading.Thread | None = None
        self.steady_s: float | None = None
        self.startup_s = 1800.0
        self.count = 0  # phases begun: ranks run the same phases in the same order
        self.steps_done = 0  # steps begun by this process
        self.step_began: float | None = None
        self.slowest_step = 0.0

    def configure(self, steady_s: float | None, startup_s: float) -> None:
        """Start writing heartbeats (``steady_s`` None: no stall detection, only dist_timeout_s)."""
        folder = os.environ.get(HEARTBEAT_ENV)
        self.path = None
        if folder and steady_s is not None and "RANK" in os.environ:
            self.path = Path(folder) / f"rank-{os.environ['RANK']}.json"
        self.steady_s, self.startup_s = steady_s, startup_s
        self.count = self.steps_done = 0
        self.step_began, self.slowest_step = None, 0.0
        self._record = self._written = None
        if self.path is not None and self._writer is None:
            self._writer = threading.Thread(target=self._write_often, name="entrenar-heartbeat", daemon=True)
            self._writer.start()

    def beat(self, phase: str, step: int | None = None) -> None:
        """This rank now begins ``phase`` (one of :data:`PHASES`) of step ``step`` (1-based), if a step's."""
        if self.path is None:
            return
        now = time.time()
        if phase == "data":  # a new step: the previous one is over
            if self.step_began is not None and self.steps_done > WARMUP_STEPS:  # warm-up says little of the pace
                self.slowest_step = max(self.slowest_step, now - self.step_began)
            self.steps_done += 1  # this one included
            self.step_began = now
        elif phase not in STEP_PHASES:
            self.step_began = None  # evaluation and checkpoints are not part of a step's time
        self.count += 1
        self._record = {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "phase": phase, "step": step,
                        "since": now, "limit_s": self.limit(phase), "count": self.count,
                        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                        "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE")}

    def flush(self) -> None:
        """Write the latest phase to the file now, if it changed since the last write."""
        record, path = self._record, self.path
        if record is None or path is None or record is self._written:
            return
        partial = path.with_suffix(".tmp")
        try:
            partial.write_text(json.dumps(record), encoding="utf-8")
            os.replace(partial, path)  # the watchdog reads a whole record or the previous one
            self._written = record
        except OSError:
            pass  # a heartbeat is advice: never fail training for it

    def _write_often(self) -> None:
        while True:
            time.sleep(WRITE_INTERVAL_S)
            self.flush()

    def limit(self, phase: str) -> float:
        """Seconds ``phase`` may last now."""
        if phase not in STEP_PHASES or self.steps_done <= WARMUP_STEPS or self.steady_s is None:
            return self.startup_s
        return max(self.steady_s, SLOW_STEP_FACTOR * self.slowest_step)


HEARTBEAT = Heartbeat()


def configure(steady_s: float | None, startup_s: float) -> None:
    """:meth:`Heartbeat.configure` of this process's heartbeat (the training loop calls it once it has the recipe)."""
    HEARTBEAT.configure(steady_s, startup_s)


def beat(phase: str, step: int | None = None) -> None:
    """:meth:`Heartbeat.beat` of this process's heartbeat."""
    HEARTBEAT.beat(phase, step)


@dataclass(frozen=True)
class Stall:
    """A rank the watchdog stopped: which, what it was doing, for how long, and when it was seen."""

    rank: int
    phase: str
    step: int | None
    stalled_s: float
    limit_s: float
    detected_at: float
    stopped: bool  # the process was stopped (SIGSTOP, a debugger)
    waiting: tuple[int, ...]  # other ranks that had overstayed too (waiting for this one)

    @property
    def message(self) -> str:
        step = f" of step {self.step}" if self.step is not None else ""
        state = "; the process was stopped (SIGSTOP or a debugger)" if self.stopped else ""
        waiting = f"; rank(s) {', '.join(map(str, self.waiting))} waited for it" if self.waiting else ""
        return (f"stalled: no progress for {self.stalled_s:.0f} s in phase '{self.phase}'{step} (limit "
                f"{self.limit_s:.0f} s: training.stall_timeout_s / stall_startup_s){state}{waiting}; stopped by "
                "entrenar's watchdog")


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (``T``: stopped), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    if _state(pid) in ("Z", "X"):  # exited, not yet reaped by the agent
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Watchdog:
    """Reads the heartbeats under ``folder`` every ``interval`` seconds, in a thread of the launcher; stops a rank
    that overstays its phase (see the module docstring) and calls ``report`` with the :class:`Stall`."""

    def __init__(self, folder: str | os.PathLike, report: Callable[[Stall], None], interval: float = 1.0) -> None:
        self.folder = Path(folder)
        self.report = report
        self.interval = interval
        self.settled_attempt = -1  # heartbeats of this attempt or earlier belong to workers already stopped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="entrenar-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def _records(self) -> list[dict[str, Any]]:
        """The heartbeats of the live workers of the latest attempt not yet acted on."""
        records = []
        for path in self.folder.glob("rank-*.json"):
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(record, dict) and record.get("attempt", 0) > self.settled_attempt and \
                        _alive(record["pid"]):
                    records.append(record)
        latest = max((r["attempt"] for r in records), default=0)
        return [r for r in records if r["attempt"] == latest]  # a restart's workers that have not beaten yet

    def check(self, now: float | None = None) -> Stall | None:
        """One look at the heartbeats; the stall found and acted on, if any."""
        now = time.time() if now is None else now
        records = self._records()
        late = [r for r in records if now - r["since"] > r["limit_s"]]
        if not late:
            return None
        stopped = {r["rank"]: _state(r["pid"]) in ("T", "t") for r in records}
        # Behind first: a stopped process, then the fewest phases begun, then the earliest begun.
        culprit = min(records, key=lambda r: (not stopped[r["rank"]], r["count"], r["since"]))
        stall = Stall(rank=culprit["rank"], phase=culprit["phase"], step=culprit["step"],
                      stalled_s=now - culprit["since"], limit_s=culprit["limit_s"], detected_at=now,
                      stopped=stopped[culprit["rank"]],
                      waiting=tuple(sorted(r["rank"] for r in late if r["rank"] != culprit["rank"])))
        self.settled_attempt = max(self.settled_attempt, culprit["attempt"])
        if culprit.get("error_file"):  # what the launcher reports if the job is not restarted
            with contextlib.suppress(OSError):
                Path(culprit["error_file"]).write_text(json.dumps(
                    {"message": stall.message, "timestamp": int(now), "entrenar": "stall"}), encoding="utf-8")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(culprit["pid"], signal.SIGKILL)  # a stopped process obeys SIGKILL; torchrun sees a dead rank
        self.report(stall)
        return stall


__all__ = ["HEARTBEAT_ENV", "PHASES", "Heartbeat", "Stall", "Watchdog", "beat", "configure"]
