"""One workspace and one single-process reference run per method, shared by the distributed tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from workers import train_worker  # noqa: E402

from conftest import make_workspace  # noqa: E402  (tests/conftest.py)


def write_recipe(ws: Path, method: str = "lora") -> str:
    """4 steps of 4 rows: 2 per device x 2 accumulation on one process, x 1 on two (global_batch_size fixes it)."""
    lora = "lora: {r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}" if method == "lora" else "lora: null"
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion}}
{lora}
optimizer: {{lr: 1.0e-2}}
schedule: {{name: constant}}
training: {{max_steps: 4, batch_size: 2, global_batch_size: 4, log_every: 1, replica_check_every: 1,
           dist_timeout_s: 20, kernels: false}}
"""
    # kernels: false: FSDP runs the plain modules, and the fused nodes (on a CPU too since kernels: auto took them)
    # round differently; these tests compare one process with N to 1e-5.
    path = ws / f"recipe-{method}.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """(workspace, recipes by method, the one-process reference run folder by method), built once per session."""
    ws = make_workspace(tmp_path_factory.mktemp("dist"))
    recipes = {method: write_recipe(ws, method) for method in ("lora", "full")}
    reference = {}
    for method, recipe in recipes.items():
        reference[method] = ws / f"reference-{method}"
        train_worker(recipe, [f"output.dir={reference[method]}"])
    return ws, recipes, reference
