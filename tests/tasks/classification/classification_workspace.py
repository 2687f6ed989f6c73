"""A classification workspace: sums of two digits labeled small or big, and a LoRA recipe on the tiny model
(tests here and tests/distributed/test_classification_ddp.py)."""

from __future__ import annotations

import json

from entrenar.config import load_recipe
from entrenar.train.metrics import read_metrics


def write_data(ws, name="cls.jsonl", n=48, bad=None):
    with open(ws / name, "w") as f:
        for i in range(n):
            a, b = i % 10, (i * 7) % 10
            f.write(json.dumps({"text": f"{a}+{b}", "label": "big" if a + b >= 9 else "small"}) + "\n")
        if bad is not None:
            f.write(json.dumps({"text": "1+1", "label": bad}) + "\n")
    return ws / name


def recipe_for(ws, *overrides):
    write_data(ws)
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'cls.jsonl'}, seq_len: 16, validation_split: 0.25}}
task: {{type: classification, labels: [small, big], class_weights: auto}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
optimizer: {{lr: 1.0e-2}}
training: {{max_steps: 6, batch_size: 4, eval_every: 3, save_every: 2, log_every: 1}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
