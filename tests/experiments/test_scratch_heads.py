"""Task heads from scratch: a random-init decoder with a regression (or classification) head, trained on
synth:regression and on a two-file SQLite ledger, as the original MoE runner trained its regressor."""

from __future__ import annotations

import json
import sqlite3

import pytest

from entrenar.config import Recipe
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def scratch_recipe(tmp_path, data: dict, steps: int = 40, **task) -> Recipe:
    return Recipe.from_dict({
        "model": {"init": "random", "device": "cpu", "config": TINY},
        "data": {"seq_len": 48, **data},
        "task": {"type": "classification", "problem_type": "regression", **task}, "lora": None,
        "optimizer": {"lr": 1e-2}, "schedule": {"name": "constant"},
        "training": {"max_steps": steps, "batch_size": 16, "eval_every": steps, "log_every": 10},
        "output": {"dir": str(tmp_path / "run")}})


def test_a_random_init_regressor_learns_synth_regression_and_writes_its_report(tmp_path):
    recipe = scratch_recipe(tmp_path, {"train": "synth:regression:640:4", "validation": "synth:regression:64:5"},
                            pooling="mean")  # 40 steps of 16 rows: each record seen once
    result = train(recipe, progress=False)
    assert result.eval_before is not None and result.eval_after is not None
    assert result.eval_after.loss < 0.8 * result.eval_before.loss  # the held-out MSE fell (1.45 -> about 0.9)
    losses = [r["loss"] for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-10:]) < sum(losses[:10])
    report = json.loads((result.run_dir / "report.json").read_text())
    assert {"rmse", "r2"} <= set(report["metrics"])
    assert json.loads((result.output / "config.json").read_text())["architectures"][0].endswith(
        "ForSequenceClassification")


def test_a_ledger_of_two_database_files_trains_a_head_from_scratch(tmp_path):
    decisions, outcomes = tmp_path / "decisions.db", tmp_path / "outcomes.db"
    with sqlite3.connect(decisions) as c:
        c.execute("CREATE TABLE decisions (id INTEGER, route TEXT)")
        c.executemany("INSERT INTO decisions VALUES (?, ?)", [(i, f"route {'ab'[i % 2]} {i}") for i in range(40)])
    c.close()
    with sqlite3.connect(outcomes) as c:
        c.execute("CREATE TABLE outcomes (decision_id INTEGER, ok TEXT)")
        c.executemany("INSERT INTO outcomes VALUES (?, ?)", [(i, "yes" if i % 2 else "no") for i in range(40)])
    c.close()
    recipe = scratch_recipe(tmp_path, {
        "train": str(decisions), "attach": {"outcomes": str(outcomes)}, "validation_split": 0.2,
        "query": "SELECT d.route AS text, o.ok AS label FROM decisions d JOIN outcomes.outcomes o "
                 "ON o.decision_id = d.id"}, steps=4, problem_type="single_label")
    result = train(recipe, progress=False)
    assert result.steps == 4
    assert json.loads((result.output / "classifier.json").read_text())["labels"] == ["no", "yes"]



def test_ablate_trains_each_arm_as_a_regressor_from_scratch_and_reports_its_metrics(tmp_path):
    from entrenar.experiments import ablate as ab

    moe = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "max_position_embeddings": 64}
    recipe = Recipe.from_dict({
        "model": {"init": "random", "device": "cpu", "config": moe},
        "data": {"train": "synth:regression:32", "validation": "synth:regression:16:1", "seq_len": 48},
        "task": {"type": "classification", "problem_type": "regression"}, "lora": None,
        "training": {"max_steps": 2, "batch_size": 4, "log_every": 1}, "output": {"dir": str(tmp_path / "run")}})
    report = ab.ablate(recipe, arms=("moe", "dense"), output=tmp_path / "out")
    saved = json.loads((report.output / "ablation.json").read_text())
    assert saved["setup"]["task"] == "classification (regression)"
    for arm in ("moe", "dense"):
        metrics = saved["arms"][arm]["eval_metrics"]
        assert {"rmse", "r2"} <= set(metrics)
        assert metrics["rmse"] ** 2 == pytest.approx(saved["arms"][arm]["eval_loss"], rel=1e-4)  # MSE = rmse^2
        assert (report.output / arm / "model" / "config.json").is_file()
    assert "## Held-out task metrics (classification (regression)" in (report.output / "ablation.md").read_text()
