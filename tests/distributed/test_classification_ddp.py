"""A classification run on two gloo processes trains as one process does: the head and adapters are reduced
through DDP (the classifier's forward goes through the wrapper), and the replicas stay identical."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tasks" / "classification"))
import classification_workspace as C  # noqa: E402 - found through sys.path above (tests/tasks/classification)
from workers import launch, train_worker  # noqa: E402 - found through sys.path above

from conftest import make_workspace  # tests/conftest.py  # noqa: E402  (tests/conftest.py)

pytestmark = pytest.mark.timeout(120)


def test_two_processes_classify_as_one(tmp_path):
    ws = make_workspace(tmp_path)
    C.recipe_for(ws)
    recipe = str(ws / "recipe.yaml")
    common = ["training.global_batch_size=8", "training.replica_check_every=1", "training.dist_timeout_s=30",
              "training.eval_every=0", "task.class_weights=none", "training.save_every=0", "training.max_steps=3"]
    train_worker(recipe, [*common, f"output.dir={ws / 'one'}"])
    launch(train_worker, recipe, [*common, f"output.dir={ws / 'two'}"])  # a diverged replica would raise here
    one, two = C.losses(ws / "one"), C.losses(ws / "two")
    assert len(one) == 3
    assert two == pytest.approx(one, abs=1e-5)
    # Each step's training accuracy counts both ranks' rows: the one process's, step for step.
    from entrenar.train.metrics import read_metrics

    accuracy = [[r["train_accuracy"] for r in read_metrics(ws / run / "metrics.jsonl") if "loss" in r]
                for run in ("one", "two")]
    assert accuracy[0] == accuracy[1] and len(accuracy[0]) == 3
