"""Start the processes of a distributed run through torchrun's own machinery, and report its failure once.

``entrenar train RECIPE --nproc-per-node N`` calls :func:`launch_command`, which builds a torchrun command
line (``torch.distributed.run``'s parser and config), and runs it with torchrun's elastic agent: one worker per
device running ``python -m entrenar train RECIPE``, rendezvous over c10d, workers watched and, with
``--max-restarts K``, the whole group restarted after a failure (workers then resume from the latest
checkpoint). ``torchrun ... -m entrenar train RECIPE`` runs the same workers under the user's own torchrun.

When workers fail, every rank tends to fail: the one with the cause, and the others when their next collective
loses it. Workers write their error into torchrun's per-rank error file instead of printing it, and
:func:`launch_command` raises one :class:`DistributedError` with the root cause (an entrenar error first, then
the rank that died, then the earliest), not N tracebacks.

A rank that hangs without dying is found by :mod:`entrenar.distributed.watchdog`: the workers write heartbeats
into a folder the launcher watches, and a rank that overstays its phase is named and stopped, so torchrun
restarts the job (``--max-restarts``) or the launcher reports the stall.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any

from entrenar.distributed.watchdog import HEARTBEAT_ENV, Stall, Watchdog
from entrenar.errors import ConfigError, DistributedError, EntrenarError

# What a collective says when another rank is gone: the cause is elsewhere.
_LOST_PEER = ("closed by peer", "reset by peer", "Connection refused", "timed out", "Timed out")
LAUNCHER_ENV = "ENTRENAR_LAUNCHER"  # set for workers entrenar started: they record errors, the launcher prints


def torchrun_args(
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    rdzv_id: str | None = None,
) -> list[str]:
    """The torchrun options for a launch (what ``torchrun`` would be given before ``-m entrenar``)."""
    if nproc_per_node < 1 or nnodes < 1 or max_restarts < 0:
        raise ConfigError(f"--nproc-per-node ({nproc_per_node}) and --nnodes ({nnodes}) must be at least 1, "
                            f"--max-restarts ({max_restarts}) at least 0")
    args = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if nnodes == 1 and rdzv_endpoint is None:
        # torchrun --standalone: a c10d store on a free local port.
        return [*args, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={rdzv_id or uuid.uuid4()}"]
    if rdzv_endpoint is None:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a host every node reaches)")
    if node_rank is not None:
        # Fixed node ranks: torchrun's static rendezvous, with the endpoint as the master address.
        host, _, port = rdzv_endpoint.rpartition(":")
        return [*args, "--rdzv-backend=static", f"--node-rank={node_rank}", f"--master-addr={host}",
                f"--master-port={port}"]
    return [*args, "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'entrenar'}"]


def _quiet() -> None:
    """The agent's own log lines (closing signals, each failed rank, OMP_NUM_THREADS set to 1) would bury the
    one message that matters; :func:`root_cause` says what failed."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def print_stall(stall: Stall) -> None:
    """The launcher's line when its watchdog stops a hung rank (torchrun then restarts the job or it fails)."""
    print(f"entrenar: rank {stall.rank} {stall.message}", file=sys.stderr, flush=True)


def launch_command(worker_argv: Sequence[str], on_stall: Callable[[Stall], None] = print_stall,
                   **options: Any) -> None:
    """Run ``python -m entrenar *worker_argv`` on every process torchrun starts (options: :func:`torchrun_args`);
    ``on_stall`` is told of each hung rank the watchdog stops."""
    from torch.distributed.run import config_from_args, parse_args

    _quiet()
    args = parse_args([*torchrun_args(**options), "-m", "entrenar", *worker_argv])
    config, cmd, cmd_args = config_from_args(args)
    _run(config, cmd, cmd_args, on_stall)


def launch_function(fn: Callable[..., Any], args: Sequence[Any] = (), start_method: str = "spawn",
                    monitor_interval: float = 0.1, shutdown_timeout: int = 30,
                    on_stall: Callable[[Stall], None] = print_stall, **options: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on every process (a library entry point, and the tests'); returns each rank's result.

    ``start_method="fork"`` starts workers without importing torch again (tests on a small machine);
    ``shutdown_timeout``: seconds the survivors of a failure get between SIGTERM and SIGKILL; ``on_stall`` is
    told of each hung rank the watchdog stops.
    """
    from torch.distributed.run import config_from_args, parse_args

    _quiet()
    parsed = parse_args([*torchrun_args(**options), "unused"])
    config, _, _ = config_from_args(parsed)
    if "shutdown_timeout" in {f.name for f in fields(config)}:
        config = replace(config, start_method=start_method, monitor_interval=monitor_interval,
                         shutdown_timeout=shutdown_timeout)
    else:  # torch < 2.12 has no shutdown_timeout
        config = replace(config, start_method=start_method, monitor_interval=monitor_interval)
    return _run(config, _Recording(fn), list(args), on_stall)


class _Recording:
    """A worker function whose errors go to torchrun's error file, for :func:`root_cause` to report."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # torchrun names the job after the function

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except EntrenarError as e:
            if report_worker_error(e, user_error=True):
                raise SystemExit(2) from e  # not re-raised: torchrun's handler would overwrite the report
            raise


def _run(config: Any, entrypoint: Any, args: list[Any], on_stall: Callable[[Stall], None]) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    previous = {name: os.environ.get(name) for name in (LAUNCHER_ENV, HEARTBEAT_ENV)}
    with tempfile.TemporaryDirectory(prefix="entrenar-heartbeats-") as heartbeats:
        os.environ[LAUNCHER_ENV] = "1"
        os.environ[HEARTBEAT_ENV] = heartbeats  # the workers inherit it
        try:
            with Watchdog(heartbeats, on_stall):
                return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as failed:
            raise DistributedError(root_cause(failed.failures)) from None
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def root_cause(failures: dict[int, Any]) -> str:
    """One line for the failures of a run: the most telling rank's message.

    An entrenar error (bad data, a diverged replica) or a stall the watchdog found explains itself; a rank
    killed or exited without a report (a crash, the OOM killer) is the likely cause of the others' lost
    collectives; otherwise the earliest.
    """
    def reported(failure: Any) -> dict:
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        return {} if data.get("message") in (None, "<NONE>") else data  # "<NONE>": torchrun found no error file

    def rank_of(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, failure = item
        data = reported(failure)
        kind = 0 if data.get("entrenar") in ("user", "stall") else 1 if not data.get("message") else 2
        return kind, failure.timestamp, rank

    rank, failure = min(failures.items(), key=rank_of)
    data = reported(failure)
    message = failure.message
    if isinstance(message, dict):  # torchrun's own record of an exception
        message = message.get("message", "")
    if "entrenar" not in data:
        how = f"signal {-failure.exitcode} ({failure.signal_name()})" if failure.exitcode < 0 else \
              f"exit code {failure.exitcode}"
        detail = f": {message}" if data.get("message") and message else ""
        message = f"the process stopped with {how}{detail}"
    if any(sign in message for sign in _LOST_PEER):
        message += " (this rank lost another that failed or hung first; see the other ranks' output)"
    others = len(failures) - 1
    tail = f" ({others} other rank(s) stopped with it)" if others else ""
    return f"rank {rank}: {message}{tail}"


def report_worker_error(error: BaseException, user_error: bool) -> bool:
    """In a worker entrenar launched: write ``error`` to torchrun's error file for the launcher to print, and
    return True (the worker then prints nothing). Elsewhere False: the caller prints as usual."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.environ.get(LAUNCHER_ENV) != "1":
        return False
    message = str(error) if user_error else f"internal error: {type(error).__name__}: {error}"
    record = {"message": message, "timestamp": int(time.time()), "entrenar": "user" if user_error else "bug"}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        return False
    return True


def rank_prefix() -> str:
    """``[rank R] `` in a worker of a distributed run (so N printed errors say whose they are), else empty."""
    return f"[rank {os.environ['RANK']}] " if "RANK" in os.environ and "WORLD_SIZE" in os.environ and \
        os.environ.get("WORLD_SIZE") != "1" else ""

