"""DDP with flat gradients on 2 to 4 GPUs (NCCL), CUDA graphs and overlapped steps on, against one process on one
GPU over the same global batches (skipped with fewer than 2 GPUs). Not run on the CPU-only machine it was
written on; tests/distributed/test_flat_grads.py covers the same code on gloo. Run on a multi-GPU host:

    PYTHONPATH=src python -m pytest -q tests/distributed/test_flat_grads_gpu.py

Each run goes through torchrun's agent (entrenar.distributed.launch), as `entrenar train --nproc-per-node N`
does: 1 process for the reference, then every GPU of the host up to 4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import write_recipe  # noqa: E402
from test_data_parallel import losses, weights  # noqa: E402
from workers import reduction_worker  # noqa: E402

from entrenar.distributed.flat_grads import CARRY_SLOTS  # noqa: E402
from entrenar.distributed.launch import launch_function  # noqa: E402

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices"),
              pytest.mark.timeout(600)]


def launch(*args, nproc: int):
    # Spawned, not forked: a process that touched CUDA cannot fork workers that use it.
    return launch_function(reduction_worker, args, start_method="spawn", shutdown_timeout=5, nproc_per_node=nproc)


def test_flat_ddp_with_graphs_and_overlap_trains_as_one_gpu(tmp_path):
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    recipe = write_recipe(ws, "lora")
    nproc = min(4, torch.cuda.device_count())
    # 2 micro-batches a step on each of nproc ranks, 2 x nproc on the one process; fp32, so only the order of
    # the sums differs.
    common = ["model.device=cuda", "training.precision=fp32", "training.cuda_graphs=true",
              "training.overlap_steps=true", "optimizer.fused=true", "training.max_steps=8",
              f"training.global_batch_size={2 * 2 * nproc}", "training.replica_check_every=4"]
    one, many = ws / "one", ws / "many"
    [(kind_one, _, _, captured_one)] = launch(recipe, [*common, f"output.dir={one}"], nproc=1).values()
    results = launch(recipe, [*common, "training.parallel=ddp", f"output.dir={many}"], nproc=nproc)
    assert kind_one == "Single" and captured_one == 1
    kind, summary, sizes, captured = results[0]
    assert kind == "FlatReplicated" and captured == 1  # the micro-step replayed from a graph under DDP
    assert f"identical on {nproc} ranks at 3 check(s), steps 1-8" in summary  # after step 1, then every 4
    trainable = sum(t.numel() for t in weights(many, "lora").values())
    # one all-reduce of the gradients a step, with the step's loss and peaks in the buffer's spare slots
    assert sizes.count(trainable + CARRY_SLOTS + nproc) == 8
    torch.testing.assert_close(torch.tensor(losses(many)), torch.tensor(losses(one)), rtol=0, atol=1e-3)
    got, expected = weights(many, "lora"), weights(one, "lora")
    assert got.keys() == expected.keys()
    errors = {name: float((got[name].float() - expected[name].float()).norm() / expected[name].float().norm())
              for name in expected}  # Adam may flip a near-zero gradient's element: each tensor as a whole
    print("relative errors, largest:", sorted(errors.items(), key=lambda kv: -kv[1])[:6])
    assert max(errors.values()) < 1e-3, sorted(errors.items(), key=lambda kv: -kv[1])[:6]
