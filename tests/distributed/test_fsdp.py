"""FSDP2 (fully_shard per decoder block) on 2 gloo processes: the same optimisation as one process, and a
checkpoint (gathered to the single-process format) that one process resumes exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel import assert_same_run  # noqa: E402
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from workers import launch, train_worker  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sharded_training_matches_one_process_and_resumes_on_one(shared, method):
    ws, recipes, reference = shared
    recipe, one = recipes[method], reference[method]
    sharded = ws / f"sharded-{method}"  # 2 steps on 2 sharded ranks, the checkpoint at step 2, then 2 more on one
    launch(train_worker, recipe, [f"output.dir={sharded}", "training.parallel=fsdp", "training.max_steps=2"])
    train_worker(recipe, [f"output.dir={sharded}", "training.max_steps=4"], True)
    assert_same_run(sharded, one, method)
