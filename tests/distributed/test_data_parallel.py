"""Two gloo processes train as one: same losses and weights as one process over the same global batches,
checkpoints that resume 2 -> 1 and 1 -> 2 exactly, a diverged replica caught, a dead rank restarted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(HERE))
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from workers import (  # noqa: E402
    diverging_worker,
    dying_worker,
    free_port,
    launch,
    mixed_device_worker,
    stalling_worker,
    summary_worker,
    train_worker,
)

from entrenar.errors import DistributedError  # noqa: E402
from entrenar.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def weights(run: Path, method: str) -> dict[str, torch.Tensor]:
    if method == "lora":
        return load_file(run / "adapter" / "adapter_model.safetensors")
    return load_file(run / "model" / "model.safetensors")


def assert_same_run(run: Path, reference: Path, method: str = "lora") -> None:
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(reference)), rtol=0, atol=1e-5)
    got, expected = weights(run, method), weights(reference, method)
    assert got.keys() == expected.keys()
    # Adam divides each gradient by its own running root-mean-square, so an element whose gradient is near zero
    # moves by up to lr a step whatever that gradient's rounding: another summation order (gloo's reductions,
    # another CPU's vector width) moves it by about 1e-4 of lr (2.2e-6 at these recipes' lr of 1e-2, one element
    # of 2048, on an AVX-512 CPU, 2026-11-27); 1e-3 of lr bounds that, far under any real divergence.
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_processes_train_as_one_and_resume_across_world_sizes(shared, method):
    ws, recipes, reference = shared
    recipe, one = recipes[method], reference[method]
    assert len(losses(one)) == 4 and len(set(losses(one))) == 4

    two = ws / f"two-{method}"
    results = launch(summary_worker, recipe, [f"output.dir={two}"])  # 2 processes: 2 rows x 1 accumulation each
    assert results[0][0] == results[1][0]  # every rank reports the global loss
    assert_same_run(two, one, method)
    line = next(r for r in read_metrics(two / "metrics.jsonl") if "loss" in r)
    assert len(line["peak_mem_gb_ranks"]) == 2
    assert "identical on 2 ranks at 4 check(s), steps 1-4" in results[0][1]  # replica_check_every: 1
    assert re.search(r"peak memory +rank 0 \d+\.\d\d GB, rank 1 \d+\.\d\d GB", results[0][1])
    if method == "full":
        return  # the resumes below exercise the data position, the same for both methods

    # 2 -> 1: stop the 2-process run at step 2 (its last checkpoint), finish on one process.
    two_one = ws / "two-one"
    launch(train_worker, recipe, [f"output.dir={two_one}", "training.max_steps=2"])
    train_worker(recipe, [f"output.dir={two_one}", "training.max_steps=4"], True)
    assert_same_run(two_one, one)

    # 1 -> 2.
    one_two = ws / "one-two"
    train_worker(recipe, [f"output.dir={one_two}", "training.max_steps=2"])
    launch(train_worker, recipe, [f"output.dir={one_two}", "training.max_steps=4"], True)
    assert_same_run(one_two, one)


def test_only_rank_0_logs_to_the_trackers(shared, monkeypatch):
    """Two processes, one MLflow run: rank 0's, with the losses of metrics.jsonl (which only rank 0 writes)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    ws, recipes, _ = shared
    run, store = ws / "tracked", ws / "mlruns"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    launch(train_worker, recipes["lora"], [f"output.dir={run}", "training.max_steps=2", f"output.mlflow={store}"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the folder store the run wrote
    client = MlflowClient(store.as_uri())
    [tracked] = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    history = client.get_metric_history(tracked.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_a_diverged_replica_stops_the_run_naming_step_and_tensor(shared):
    ws, recipes, _ = shared
    with pytest.raises(DistributedError, match=r"step 2: replicas diverged; '.*lora_A.*' differs on rank\(s\) 1"):
        launch(diverging_worker, recipes["lora"], [f"output.dir={ws / 'diverged'}"], 2)


def test_a_diverged_replica_is_caught_before_its_step_saves(shared):
    """The check's verdict is read at the next check, but a step that saves reads it first: no checkpoint of
    diverged replicas is written."""
    ws, recipes, _ = shared
    run = ws / "diverged-save"
    with pytest.raises(DistributedError, match=r"step 2: replicas diverged"):
        launch(diverging_worker, recipes["lora"], [f"output.dir={run}", "training.save_every=2",
                                                   "training.replica_check_every=2"], 2)
    assert not [p for p in run.rglob("step-2*")], sorted(run.rglob("*"))


def test_a_killed_rank_restarts_the_job_from_its_last_checkpoint(shared):
    ws, recipes, reference = shared
    run = ws / "restarted"  # rank 1 dies after step 3; the checkpoint is at step 2
    launch(dying_worker, recipes["lora"], [f"output.dir={run}", "training.save_every=2"], 3, max_restarts=1)
    assert_same_run(run, reference["lora"])


def test_a_stopped_rank_is_found_within_its_bound_named_and_the_job_restarts(shared):
    """Rank 1 is SIGSTOPped after step 3 (alive, silent): the watchdog names it and its phase within
    stall_timeout_s (+ its 1 s polling), stops it, and the restarted job ends at the uninterrupted run's weights
    (without the watchdog the others would wait dist_timeout_s, 20 s here, and the job would fail)."""
    ws, recipes, reference = shared
    run, stamp, stalls = ws / "stalled", ws / "stopped-at", []
    launch(stalling_worker, recipes["lora"], [f"output.dir={run}", "training.save_every=2",
                                              "training.stall_timeout_s=3", "training.stall_startup_s=60"],
           3, str(stamp), max_restarts=1, on_stall=stalls.append)
    [stall] = stalls
    assert (stall.rank, stall.phase, stall.step, stall.stopped, stall.limit_s) == (1, "collective", 3, True, 3.0)
    assert stall.detected_at - float(stamp.read_text()) < 3.0 + 2.0
    assert "rank(s) 0 waited for it" in stall.message or not stall.waiting
    assert_same_run(run, reference["lora"])


def test_ranks_that_resolved_different_device_types_are_refused_together(shared):
    ws, recipes, _ = shared
    with pytest.raises(DistributedError, match=r"^rank [01]: model.device: the ranks of this job resolved to "
                                               r"different device types \(rank 0 cpu, rank 1 xpu\)"):
        launch(mixed_device_worker, recipes["lora"], [f"output.dir={ws / 'mixed'}"])


def test_a_dead_rank_is_reported_once_with_its_exit_code(shared):
    ws, recipes, _ = shared
    # Forked workers: torchrun reports the first failure it polls, the dead rank or the one that lost it.
    with pytest.raises(DistributedError, match=r"^rank (1: the process stopped with exit code 17( \(1 other|$)|"
                                               r"0: .* by peer.* lost another that failed)"):
        launch(dying_worker, recipes["lora"], [f"output.dir={ws / 'dead'}"], 3)


def test_the_cli_runs_two_nodes_and_prints_one_summary(shared):
    """Two hosts' worth of `entrenar train --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT
    --nproc-per-node 1` on this one: torchrun's agents (static rendezvous), spawned `python -m entrenar` workers."""
    ws, recipes, reference = shared
    run = ws / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen([sys.executable, "-m", "entrenar", "train", recipes["lora"], "--set",
                               f"output.dir={run}", "--set", "training.max_steps=2", "--no-progress",
                               "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank),
                               "--rdzv-endpoint", endpoint], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=80) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert outputs[0][0].count("final loss") == 1 and "final loss" not in outputs[1][0]  # rank 0 prints
    assert "ddp on 2 processes (gloo)" in outputs[0][0]
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(reference["lora"])[:2]),
                               rtol=0, atol=1e-5)


def test_what_rank_0_does_alone_reaches_every_rank_with_its_result_or_its_error():
    from workers import main_only_worker

    assert launch(main_only_worker) == {r: ("from rank 0", "bad.jsonl:3: not JSON") for r in (0, 1)}
