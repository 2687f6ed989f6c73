"""What `entrenar train` prints: the resolved recipe, what it is doing, a line per evaluation and per log_every."""

from __future__ import annotations

import re
import sys

import pytest
import yaml
from test_loop import recipe_for

from entrenar.errors import ConfigError
from entrenar.train.console import compact_yaml
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def test_the_compact_recipe_is_the_recipe(workspace):
    recipe = recipe_for(workspace, "training.early_stopping={patience: 2}")
    text = compact_yaml(recipe)
    assert len(text.splitlines()) < 30  # a line per section, the long ones wrapped
    assert yaml.safe_load(text) == recipe.to_dict()


def test_no_progress_prints_the_recipe_evaluations_and_a_line_every_log_every_steps(workspace, capsys):
    result = train(recipe_for(workspace, "training.log_every=3", "output.tensorboard=true"), progress=False,
                   verbose=True)
    out = capsys.readouterr().out
    assert out.startswith("recipe (resolved):\n  model: {path: ")
    assert "loading " in out and "reading and tokenizing " in out and "evaluating on 8 validation examples" in out
    records = read_metrics(result.run_dir / "metrics.jsonl")
    steps = re.findall(r"^step (\d+)/8  loss (\S+)  lr (\S+)  grad_norm \S+  \S+ tokens/s$", out, re.M)
    assert [int(s) for s, _, _ in steps] == [3, 6, 8]
    by_step = {r["step"]: r for r in records if "loss" in r}
    assert [(float(loss), float(lr)) for s, loss, lr in steps] == [
        (pytest.approx(by_step[int(s)]["loss"], abs=5e-5), pytest.approx(by_step[int(s)]["lr"], rel=1e-2))
        for s, _, _ in steps]
    evals = re.findall(r"^step (\d+): eval_loss (\S+)  eval_ppl \S+", out, re.M)
    assert [(int(s), float(v)) for s, v in evals] == [
        (r["step"], pytest.approx(r["eval_loss"], abs=5e-5)) for r in records if "eval_loss" in r]
    assert list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_the_library_is_silent_unless_asked(workspace, capsys):
    train(recipe_for(workspace, "training.max_steps=2"), progress=False)
    assert capsys.readouterr().out == ""


def test_a_missing_tensorboard_is_found_before_anything_is_loaded_or_written(workspace, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="output.tensorboard: needs the tensorboard package"):
        train(recipe_for(workspace, "output.tensorboard=true"), progress=False)
    assert not (workspace / "run").exists()
