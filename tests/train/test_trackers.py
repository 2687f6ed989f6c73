"""MLflow and Weights & Biases receive the numbers of metrics.jsonl at its steps (read back with their own clients),
the resolved recipe and the run folder's files; a missing package or a bad setting is refused before anything
is loaded or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_loop import recipe_for

from conftest import make_workspace
from entrenar.cli.main import main
from entrenar.config import Recipe, load_recipe
from entrenar.errors import ConfigError
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics
from entrenar.train.trackers import MlflowTracker, mlflow_tracking_uri

# metrics.jsonl's fields and the trackers' names for them (TensorBoard's tags)
NAMES = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
         "total_tokens": "train/total_tokens", "tokens_per_s": "train/tokens_per_s", "elapsed_s": "train/elapsed_s",
         "eval_loss": "eval/loss", "eval_ppl": "eval/ppl"}


def wandb_home(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Everything W&B writes goes under ``folder``, never the user's home; nothing reaches a network."""
    for variable, name in [("WANDB_DIR", "wandb"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                           ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")]:
        (folder / name).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(variable, str(folder / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A tiny LoRA run (4 steps, evaluations at 0, 2 and 4) logged to a local MLflow store and an offline W&B run."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    ws = make_workspace(tmp_path_factory.mktemp("tracked"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        wandb_home(monkeypatch, ws / "home")
        result = train(recipe_for(ws, "training.max_steps=4", "training.eval_every=2", "training.save_every=0",
                                  f"output.mlflow={{tracking_uri: {ws / 'mlruns'}, experiment: tiny}}",
                                  f"output.wandb={{project: tiny, mode: offline, dir: {ws / 'wb'}}}"),
                       progress=False)
    return ws, result.run_dir, read_metrics(result.run_dir / "metrics.jsonl")


def expected_series(records: list[dict], field: str) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in records if isinstance(r.get(field), (int, float))]


def test_mlflow_gets_the_numbers_of_metrics_jsonl_the_recipe_and_the_plots(tracked, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    ws, run_dir, records = tracked
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading a folder store, as `mlflow ui` would
    client = MlflowClient((ws / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tiny")
    [run] = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")  # named after the run folder
    assert {(r["step"], "eval_loss" in r) for r in records} >= {(0, True), (2, True), (4, True), (4, False)}
    for field, name in NAMES.items():
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == expected_series(records, field), name
    assert set(run.data.metrics) == set(NAMES.values())

    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert run.data.params == {f"{section}.{key}": value if isinstance(value, str) else json.dumps(value)
                               for section, values in recipe.items() for key, value in (values or {}).items()}
    assert run.data.params["optimizer.lr"] == "0.01" and run.data.params["lora.r"] == "4"

    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["loss_curve.png", "recipe.yaml"]
    for name in ("loss_curve.png", "recipe.yaml"):
        copy = client.download_artifacts(run.info.run_id, name, str(tmp_path))
        assert Path(copy).read_bytes() == (run_dir / name).read_bytes()


def wandb_records(run_folder: Path) -> list[dict]:
    """The records of an offline run's .wandb log, as W&B's own reader prints them."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
                         capture_output=True, text=True, check=True, env=os.environ, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_wandb_offline_gets_the_numbers_of_metrics_jsonl_the_recipe_and_the_plots(tracked, monkeypatch):
    ws, run_dir, records = tracked
    wandb_home(monkeypatch, ws / "home")
    [folder] = (ws / "wb" / "wandb").glob("offline-run-*")
    log = wandb_records(folder)
    rows = {r["history"]["item"]["_step"]: r["history"]["item"] for r in log if r["type"] == "history"}
    assert sorted(rows) == sorted({r["step"] for r in records})  # a step's train line and evaluation: one row
    for field, name in NAMES.items():
        assert [(step, rows[step][name]) for step, _ in expected_series(records, field)] == \
            expected_series(records, field), name
        assert all(name not in row for step, row in rows.items()
                   if step not in {s for s, _ in expected_series(records, field)}), name

    [run] = [r["run"] for r in log if r["type"] == "run"]
    assert (run["display_name"], run["project"]) == ("run", "tiny")
    config: dict = {}
    for r in log:
        if r["type"] in ("run", "config"):
            config.update((r[r["type"]].get("config") or r[r["type"]]).get("update", {}))
    config.pop("_wandb", None)
    assert config == yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert [r["exit"].get("exit_code", 0) for r in log if r["type"] == "exit"] == [0]
    for name in ("loss_curve.png", "recipe.yaml"):  # copies, not links: an offline run may be synced elsewhere
        saved = folder / "files" / name
        assert not saved.is_symlink() and saved.read_bytes() == (run_dir / name).read_bytes()


@pytest.mark.parametrize(("key", "package"), [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_missing_tracker_package_is_refused_before_anything_is_loaded_or_written(workspace, monkeypatch, capsys,
                                                                                     key, package):
    monkeypatch.setitem(sys.modules, key, None)  # as if not installed
    recipe_for(workspace)  # writes workspace/recipe.yaml
    code = main(["train", str(workspace / "recipe.yaml"), "--set", f"output.{key}=true", "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"error: output.{key}: needs the {package} package "
                                               f"(pip install 'entrenar[{key}]'), or set output.{key}: false")
    assert not (workspace / "run").exists()


@pytest.mark.parametrize(("setting", "message"), [
    ("mlflow:\n    experiment_name: tiny", "'output.mlflow' must be false, true, a tracking URI or folder, or a "
     "mapping {tracking_uri, experiment, run_name}, got {experiment_name: tiny} (unknown key 'experiment_name'; "
     "did you mean 'experiment'?)"),
    ("wandb:\n    mode: ofline", "'output.wandb' must be false, true, a project name, or a mapping {project, "
     "entity, run_name, mode, dir}, got {mode: ofline} (mode must be one of: online, offline, got 'ofline')"),
    ("mlflow: 3", "'output.mlflow' must be false, true, a tracking URI or folder, or a mapping {tracking_uri, "
     "experiment, run_name}, got 3"),
], ids=["mlflow-key", "wandb-mode", "mlflow-number"])
def test_a_bad_tracker_setting_names_the_key_and_its_line(tmp_path, setting, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: m\ndata:\n  train: t.jsonl\noutput:\n  {setting}\n")
    with pytest.raises(ConfigError) as error:
        load_recipe(recipe)
    assert str(error.value) == f"{recipe} line 6: {message}"


def test_a_recipe_value_longer_than_mlflows_limit_is_cut_visibly(tmp_path, monkeypatch):
    """Cut to MLflow's limit, ending with '...' (MLflow 3 cuts silently, older servers refuse); recipe.yaml, an
    artifact, holds it whole."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    long = "x" * (MAX_PARAM_VAL_LENGTH + 1)
    tracker = MlflowTracker({"tracking_uri": str(tmp_path / "store"), "experiment": None, "run_name": None}, "long")
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set only while the folder store was opened
    tracker.log_params({"data": {"train": long, "seq_len": 32}, "lora": None})
    tracker.close()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((tmp_path / "store").as_uri())
    run = client.get_run(tracker.run_id)
    assert run.data.params == {"data.train": long[: MAX_PARAM_VAL_LENGTH - 3] + "...", "data.seq_len": "32"}
    assert (run.info.run_name, client.get_experiment(run.info.experiment_id).name) == ("long", "Default")


def test_the_mlflow_store_is_the_recipes_then_the_environments_then_mlruns_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_tracking_uri(None) == (tmp_path / "mlruns").as_uri()
    assert mlflow_tracking_uri("runs/store") == (tmp_path / "runs" / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert mlflow_tracking_uri(None) == "http://tracker:5000"
    for uri in ("https://host/mlflow", "databricks", "file:///tmp/x"):
        assert mlflow_tracking_uri(uri) == uri


def test_a_run_that_stops_with_an_error_ends_failed_and_a_resumed_one_says_from_where(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from entrenar.train.metrics import MetricsLogger

    settings = {"tracking_uri": str(tmp_path / "store"), "experiment": "e", "run_name": None}
    with pytest.raises(KeyboardInterrupt), MetricsLogger(tmp_path, trackers=[MlflowTracker(settings, "r")]) as logger:
        logger.log_step(1, 2.5, 0.5, 1e-3, tokens=10, step_time_s=0.1)
        raise KeyboardInterrupt
    with MetricsLogger(tmp_path, resume_step=1, trackers=[MlflowTracker(settings, "r", resume_step=1)]) as logger:
        logger.log_step(2, 2.0, 0.5, 1e-3, tokens=10, step_time_s=0.1)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((tmp_path / "store").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id], order_by=["attributes.start_time"])
    assert [(r.info.status, r.data.tags.get("entrenar.resumed_from_step")) for r in runs] == [
        ("FAILED", None), ("FINISHED", "1")]
    assert [[(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "train/loss")] for r in runs] == [
        [(1, 2.5)], [(2, 2.0)]]


def test_a_tracker_that_cannot_start_names_its_key_and_closes_those_started(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from entrenar.train.trackers import WandbTracker, open_trackers

    def refuse(*args, **kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(WandbTracker, "__init__", refuse)
    recipe = Recipe.from_dict({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                               "output": {"mlflow": str(tmp_path / "store"), "wandb": True}})
    with pytest.raises(ConfigError, match=r"^output\.wandb: the tracker could not start a run: RuntimeError: "
                                          r"api_key not configured \(no-tty\)$"):
        open_trackers(recipe, tmp_path / "run")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "store").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert run.info.status == "FAILED"
