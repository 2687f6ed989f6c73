"""Early stopping: the rule by hand, the recipe key, and a run that stops, says why, and resumes to the same stop."""

from __future__ import annotations

import pytest
from test_loop import losses, recipe_for

from conftest import crash_after_step
from entrenar.config import Recipe
from entrenar.errors import ConfigError
from entrenar.train.early_stopping import EarlyStopping
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def early(**config) -> EarlyStopping:
    raw = {"training": {"early_stopping": config, "eval_every": 1}}
    return EarlyStopping(Recipe.from_dict(raw).training.early_stopping)


def test_patience_counts_evaluations_that_do_not_beat_the_best_by_min_delta():
    stopper = early(metric="eval_loss", patience=2, min_delta=0.1)
    # 1.0 best; 0.95 not 0.1 better (1 bad); 0.85 is (best, reset); 0.9 (1 bad); 0.8 not below 0.75 (2 bad): stop.
    decisions = [stopper.update(step, {"eval_loss": v}) for step, v in enumerate([1.0, 0.95, 0.85, 0.9, 0.8])]
    assert decisions == [False, False, False, False, True]
    assert stopper.reason == "eval_loss did not improve by more than 0.1 for 2 evaluation(s) (best 0.8500 at step 2)"


def test_mode_follows_the_metric_name_unless_given():
    assert early(metric="eval_loss").config == {"metric": "eval_loss", "patience": 3, "min_delta": 0.0, "mode": "min"}
    assert early(metric="eval_macro_f1").config["mode"] == "max"
    assert early(metric="eval_macro_f1", mode="min").config["mode"] == "min"
    stopper = early(metric="eval_accuracy", patience=1)
    assert [stopper.update(s, {"eval_accuracy": v}) for s, v in enumerate([0.5, 0.6, 0.6])] == [False, False, True]


@pytest.mark.parametrize("value, problem", [(5, "a mapping"), ({"patience": 0}, "patience must be an integer > 0"),
                                            ({"min_delta": -1}, "min_delta must be a number >= 0"),
                                            ({"mode": "up"}, "mode must be min or max"),
                                            ({"metrc": "eval_loss"}, "unknown key 'metrc'")])
def test_bad_settings_name_the_key(value, problem):
    with pytest.raises(ConfigError, match=rf"training\.early_stopping' must be .*{problem}"):
        Recipe.from_dict({"training": {"early_stopping": value}})


def test_an_unknown_metric_and_a_run_without_evaluations_are_refused(workspace):
    with pytest.raises(ConfigError, match=r"early_stopping: needs evaluations during the run"):
        train(recipe_for(workspace, "training.eval_every=0", "training.early_stopping={patience: 2}"), progress=False)
    with pytest.raises(ConfigError,
                       match=r"'eval_f1' is not a metric this run evaluates \(it has: eval_loss, eval_ppl"):
        train(recipe_for(workspace, "training.early_stopping={metric: eval_f1}"), progress=False)


def test_a_run_stops_early_saves_says_why_and_resumes_to_the_same_stop(workspace, monkeypatch):
    # min_delta 10 nats: no evaluation improves, so the run stops at the third evaluation after step 0 (step 6 of 8).
    overrides = ["training.eval_every=2", "training.save_every=2",
                 "training.early_stopping={metric: eval_loss, patience: 3, min_delta: 10}"]
    straight = train(recipe_for(workspace, *overrides, f"output.dir={workspace / 'straight'}"), progress=False)
    assert straight.steps == 6 and len(losses(straight.run_dir)) == 6
    assert "stopped early  eval_loss did not improve by more than 10 for 3 evaluation(s) (best" in straight.summary
    assert (straight.run_dir / "checkpoints" / "step-6").is_dir() and (straight.run_dir / "adapter").is_dir()

    recipe = recipe_for(workspace, *overrides)
    crash_after_step(monkeypatch, recipe, 5)  # the last checkpoint is step 4, two bad evaluations counted
    resumed = train(recipe, resume=True, progress=False)
    assert resumed.steps == 6 and losses(resumed.run_dir) == losses(straight.run_dir)
    evals = [r["step"] for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [0, 2, 4, 6]
