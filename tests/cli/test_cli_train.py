"""``entrenar train``: the recipe, its overrides and the flags reach ``train`` as the library would get them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import fake_module

from entrenar.cli.main import main
from entrenar.config import load_recipe

RECIPE = """\
model:
  path: models/tiny
data:
  train: data/train.jsonl
training:
  max_steps: 10
"""


@pytest.fixture
def calls(monkeypatch):
    """Replace ``entrenar.train.loop.train`` with one that records its arguments."""
    seen: list[dict] = []

    def train(recipe, resume=None, dry_run=False, progress=True, verbose=False, force=False):
        seen.append({"recipe": recipe, "resume": resume, "dry_run": dry_run, "progress": progress, "verbose": verbose,
                     "force": force})
        summary = "dry run: would train" if dry_run else f"trained {recipe.training.max_steps} steps"
        return SimpleNamespace(run_dir=Path(recipe.output.dir), summary=summary)

    fake_module(monkeypatch, "entrenar.train.loop", train=train)
    return seen


@pytest.fixture
def recipe_file(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(RECIPE)
    return path


def test_recipe_with_overrides_is_passed_and_summary_printed(capsys, calls, recipe_file):
    sets = ["training.max_steps=3", "optimizer.lr=1e-4"]
    assert main(["train", str(recipe_file), "--set", sets[0], "--set", sets[1]]) == 0
    (call,) = calls
    assert call["recipe"] == load_recipe(recipe_file, sets)
    assert call["recipe"].training.max_steps == 3  # the override, not the file's 10
    assert (call["resume"], call["dry_run"], call["progress"], call["verbose"]) == (None, False, True, True)
    assert capsys.readouterr().out == "trained 3 steps\n"


def test_no_recipe_runs_the_bundled_quickstart(calls):
    assert main(["train", "--set", "training.max_steps=2"]) == 0
    assert calls[0]["recipe"] == load_recipe(None, ["training.max_steps=2"])


@pytest.mark.parametrize(
    "flags, resume",
    [(["--resume"], True), (["--resume", "runs/old"], "runs/old"), ([], None)],
)
def test_resume_bare_means_the_recipes_own_run(calls, recipe_file, flags, resume):
    assert main(["train", str(recipe_file), *flags]) == 0
    assert calls[0]["resume"] == resume


def test_dry_run_and_no_progress(capsys, calls, recipe_file):
    assert main(["train", str(recipe_file), "--dry-run", "--no-progress"]) == 0
    assert (calls[0]["dry_run"], calls[0]["progress"]) == (True, False)
    assert capsys.readouterr().out == "dry run: would train\n"


def test_missing_recipe_names_the_file(capsys, calls, tmp_path):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"error: recipe file not found: {tmp_path / 'nope.yaml'}\n"
    assert calls == []


def test_bad_override_key_names_the_key_and_a_suggestion(capsys, calls, recipe_file):
    assert main(["train", str(recipe_file), "--set", "optimizer.lrr=1e-4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set optimizer.lrr=1e-4: unknown key 'optimizer.lrr'")
    assert "did you mean 'lr'" in err and err.count("\n") == 1
    assert calls == []


def test_bad_value_in_the_file_names_its_line(capsys, calls, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(RECIPE.replace("max_steps: 10", "max_steps: ten"))
    assert main(["train", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path} line 6: 'training.max_steps' must be an integer > 0 or null, got 'ten'\n"
    )


def test_a_run_that_does_not_fit_exits_2_with_the_numbers_and_force_trains_it(capsys, monkeypatch, workspace):
    from cli_helpers import run_cli

    import entrenar.train.plan as plan_module

    monkeypatch.setattr(plan_module, "available_memory", lambda device: (2**20, "MemAvailable in /proc/meminfo"))
    recipe = workspace / "recipe.yaml"
    recipe.write_text(f"model: {{path: {workspace / 'model'}, device: cpu}}\n"
                      f"data: {{train: {workspace / 'train.jsonl'}, seq_len: 32, validation_split: 0}}\n"
                      f"training: {{max_steps: 2, batch_size: 2, save_every: 0}}\n"
                      f"output: {{dir: {workspace / 'run'}}}\n")
    for dry in (["--dry-run"], []):
        code, out, err = run_cli(capsys, "train", recipe, "--no-progress", *dry)
        assert code == 2 and "Traceback" not in err
        assert "error: memory: the run needs about" in err and "cpu has 0.00 GiB available (MemAvailable" in err
        assert not (workspace / "run" / "metrics.jsonl").exists()  # refused before training
    code, out, err = run_cli(capsys, "train", recipe, "--no-progress", "--force")
    assert code == 0 and (workspace / "run" / "metrics.jsonl").is_file()


def test_force_reaches_train(calls, recipe_file):
    main(["train", str(recipe_file), "--force"])
    main(["train", str(recipe_file)])
    assert [c["force"] for c in calls] == [True, False]
