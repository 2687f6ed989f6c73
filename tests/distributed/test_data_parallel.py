"""Two gloo processes train as one: same losses and weights as one process over the same global batches,
checkpoints that resume 2 -> 1 and 1 -> 2 exactly, a diverged replica caught, a dead rank restarted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(HERE))
from workers import diverging_worker, dying_worker, launch, train_worker  # noqa: E402

from entrenar.errors import DistributedError  # noqa: E402
from entrenar.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def write_recipe(ws: Path, method: str = "lora") -> str:
    lora = "lora: {r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}" if method == "lora" else "lora: null"
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion}}
{lora}
optimizer: {{lr: 1.0e-2}}
schedule: {{name: constant}}
training: {{max_steps: 4, batch_size: 2, global_batch_size: 4, log_every: 1, replica_check_every: 1,
           dist_timeout_s: 20}}
"""
    path = ws / f"recipe-{method}.yaml"
    path.write_text(text)
    return str(path)


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
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_processes_train_as_one_and_resume_across_world_sizes(workspace, method):
    recipe = write_recipe(workspace, method)
    one = workspace / "one"
    train_worker(recipe, [f"output.dir={one}"])  # 1 process: 2 rows x 2 accumulation
    assert len(losses(one)) == 4 and len(set(losses(one))) == 4

    two = workspace / "two"
    results = launch(train_worker, recipe, [f"output.dir={two}"])  # 2 processes: 2 rows x 1 accumulation each
    assert results[0] == pytest.approx(results[1], abs=0)  # every rank reports the global loss
    assert_same_run(two, one, method)
    line = next(r for r in read_metrics(two / "metrics.jsonl") if "loss" in r)
    assert len(line["peak_mem_gb_ranks"]) == 2
    if method == "full":
        return  # the resumes below exercise the data position, the same for both methods

    # 2 -> 1: stop the 2-process run at step 2 (its last checkpoint), finish on one process.
    two_one = workspace / "two-one"
    launch(train_worker, recipe, [f"output.dir={two_one}", "training.max_steps=2"])
    train_worker(recipe, [f"output.dir={two_one}", "training.max_steps=4"], True)
    assert_same_run(two_one, one)

    # 1 -> 2.
    one_two = workspace / "one-two"
    train_worker(recipe, [f"output.dir={one_two}", "training.max_steps=2"])
    launch(train_worker, recipe, [f"output.dir={one_two}", "training.max_steps=4"], True)
    assert_same_run(one_two, one)


def test_a_diverged_replica_stops_the_run_naming_step_and_tensor(workspace):
    recipe = write_recipe(workspace)
    with pytest.raises(DistributedError, match=r"step 2: replicas diverged; '.*lora_A.*' differs on rank\(s\) 1"):
        launch(diverging_worker, recipe, [f"output.dir={workspace / 'run'}"], 2)


def test_a_killed_rank_restarts_the_job_from_its_last_checkpoint(workspace):
    recipe = write_recipe(workspace)
    straight = workspace / "straight"
    train_worker(recipe, [f"output.dir={straight}"])

    run = workspace / "restarted"  # rank 1 dies after step 3; the checkpoint is at step 2
    launch(dying_worker, recipe, [f"output.dir={run}", "training.save_every=2"], 3, max_restarts=1)
    assert_same_run(run, straight)


def test_a_dead_rank_is_reported_once_with_its_exit_code(workspace):
    recipe = write_recipe(workspace)
    # Forked workers: torchrun reports the first failure it polls, the dead rank or the one that lost it.
    with pytest.raises(DistributedError, match=r"^rank (1: the process stopped with exit code 17( \(1 other|$)|"
                                               r"0: .* by peer.* lost another that failed)"):
        launch(dying_worker, recipe, [f"output.dir={workspace / 'run'}"], 3)


@pytest.mark.slow
def test_the_cli_launches_restarts_and_prints_one_summary(workspace):
    """`entrenar train --nproc-per-node 2 --max-restarts 1` (torchrun's agent, spawned workers running
    `python -m entrenar`), rank 1 killed after step 3 of 4 by a start-up hook on the first attempt."""
    recipe = write_recipe(workspace)
    straight = workspace / "straight"
    train_worker(recipe, [f"output.dir={straight}"])

    run = workspace / "restarted"
    env = {**os.environ, "ENTRENAR_TEST_DIE_AT": "3",
           "PYTHONPATH": os.pathsep.join([str(HERE / "crash_hook"), str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "entrenar", "train", recipe, "--set", f"output.dir={run}",
                           "--set", "training.save_every=2", "--no-progress", "--nproc-per-node", "2",
                           "--max-restarts", "1"], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(run, straight)
    assert done.stdout.count("final loss") == 1  # one summary, from rank 0
