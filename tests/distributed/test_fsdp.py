"""FSDP2 (fully_shard per decoder block) on gloo processes: the same optimisation as one process, and sharded
checkpoints (torch.distributed.checkpoint, each rank writing its shards) that resume on another world size
exactly: 2 -> 1 (a plain process) and 1 -> 2 (FSDP on one process, then on two)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel import assert_same_run  # noqa: E402
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from workers import launch, train_worker  # noqa: E402

from entrenar.train.checkpoint import is_sharded, latest_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def shard_files(run: Path) -> list[str]:
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    return sorted(p.name for p in (ckpt / "shards").iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sharded_checkpoints_resume_on_another_world_size_as_an_uninterrupted_run(shared, method):
    ws, recipes, reference = shared
    recipe, one = recipes[method], reference[method]
    run = ws / f"sharded-{method}"  # 2 steps, the checkpoint at step 2, then 2 more on the other world size
    first = ["training.parallel=fsdp", "training.max_steps=2", f"output.dir={run}"]
    if method == "full":  # 2 -> 1: two ranks' shards, read whole by one plain process
        launch(train_worker, recipe, first)
        assert shard_files(run) == ["__0_0.distcp", "__1_0.distcp"]
        train_worker(recipe, [f"output.dir={run}", "training.max_steps=4"], True)
    else:  # 1 -> 2: one rank's shards (FSDP on one process), resharded over two
        launch(train_worker, recipe, first, nproc=1)
        assert shard_files(run) == ["__0_0.distcp"]
        launch(train_worker, recipe, [f"output.dir={run}", "training.parallel=fsdp", "training.max_steps=4"], True)
        assert shard_files(run) == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_run(run, one, method)  # the final model / adapter: one plain file, as one process writes it
