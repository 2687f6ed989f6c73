"""bench/multi_gpu.py's summary over rounds: medians and ranges of the runs that finished; a failed run (whose
record has no process count, as a refused start or a stopped run reports) is left out instead of losing the
call's results (2026-11-27: a run stopped at its replica check and the aggregate raised KeyError)."""

from __future__ import annotations

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
