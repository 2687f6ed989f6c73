"""Experiment trackers: TensorBoard, MLflow and Weights & Biases behind one small interface.

A tracker receives the resolved recipe once (:meth:`Tracker.log_params`), the numbers of every ``metrics.jsonl``
line at that line's step (:meth:`Tracker.log_metrics`, fed by :class:`~entrenar.train.metrics.MetricsLogger`), the
run folder's plots, report and recipe at the end (:meth:`Tracker.log_artifacts`), and is closed with the run's
outcome. Only the process that writes ``metrics.jsonl`` (rank 0) opens any. Each is an optional extra, imported
only when the recipe asks for it; :func:`check_trackers` finds a missing one before anything is loaded.

Every tracker names the numbers alike: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``...
for a step's line, ``eval/loss``, ``eval/ppl``... for an evaluation's (:func:`scalars`). A resumed run opens new
MLflow and W&B runs whose steps continue after the checkpoint's; TensorBoard drops the events after it instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from entrenar.config import OutputSection, Recipe
from entrenar.errors import ConfigError
from entrenar.io.run_dir import RECIPE_FILE

TENSORBOARD_DIR = "tensorboard"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # http:, sqlite:, file:... (not a drive letter)
DEFAULT_MLFLOW_STORE = "mlruns"  # a local store in the working folder, as MLflow's own file store default was
ARTIFACTS = (RECIPE_FILE, "*.png", "report.json", "report.md")  # the run folder's recipe, plots and report


class Tracker(Protocol):
    """What the training run tells an experiment tracker."""

    def log_params(self, params: dict[str, Any]) -> None:
        """The resolved recipe (``Recipe.to_dict()``), once when the run starts."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """The numbers of one metrics line (:func:`scalars`) at its optimizer step."""

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """Files of the run folder, once at the end."""

    def close(self, ok: bool = True) -> None:
        """Finish the run: ``ok`` False when training ended with an error or an interrupt."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics line's finite numbers under the trackers' names: ``loss`` -> ``train/loss``, ``eval_loss`` ->
    ``eval/loss``; null (non-finite), text, lists and mappings are left out, and so is ``step``."""
    prefix = "eval" if any(key.startswith("eval_") for key in record) else "train"
    return {f"{prefix}/{key.removeprefix('eval_')}": float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _missing(key: str, package: str, extra: str) -> ConfigError:
    return ConfigError(f"{key}: needs the {package} package (pip install 'entrenar[{extra}]'), or set {key}: false")


def tensorboard_writer_class() -> type:
    """torch's SummaryWriter, or a ConfigError saying how to install what it needs."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise _missing("output.tensorboard", "tensorboard", "tensorboard") from None
    return SummaryWriter


def _mlflow() -> Any:
    try:
        import mlflow
        from mlflow.tracking import MlflowClient  # noqa: F401 (imported now: a broken install is found now too)
    except ImportError:
        raise _missing("output.mlflow", "mlflow-skinny", "mlflow") from None
    return mlflow


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise _missing("output.wandb", "wandb", "wandb") from None
    return wandb


def check_trackers(output: OutputSection) -> None:
    """Import every tracker the recipe asks for: a missing package is a ConfigError naming the extra to install,
    found before the model loads."""
    if output.tensorboard:
        tensorboard_writer_class()
    if output.mlflow is not None:
        _mlflow()
    if output.wandb is not None:
        _wandb()


class TensorBoardTracker:
    """Event files in ``<run>/tensorboard/`` (the standard SummaryWriter); a resume drops the events after its step,
    as ``metrics.jsonl`` drops the lines."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = tensorboard_writer_class()(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)

    def log_params(self, params: dict[str, Any]) -> None:
        pass  # recipe.yaml beside the events holds them

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        pass  # the event files sit in the run folder with them

    def close(self, ok: bool = True) -> None:
        self.writer.close()


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def recipe_params(recipe: dict[str, Any], max_length: int) -> dict[str, str]:
    """``section.key`` -> the value as YAML spells it (JSON for lists and mappings), as ``--set`` names them; a value
    longer than ``max_length`` is cut and ends with ``...`` (recipe.yaml, an artifact, holds it whole)."""
    params = {}
    for section, values in recipe.items():
        for key, value in (values or {}).items():
            text = _param_text(value)
            params[f"{section}.{key}"] = text if len(text) <= max_length else text[: max_length - 3] + "..."
    return params


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses a local folder store unless ``MLFLOW_ALLOW_FILE_STORE`` is set; a recipe that names one
    asks for it (mlflow-skinny has no database store). Set only while the store is built, which MLflow caches."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def mlflow_tracking_uri(setting: str | None) -> str:
    """The recipe's tracking URI or folder, else ``MLFLOW_TRACKING_URI``, else ``mlruns`` in the working folder; a
    folder becomes an absolute ``file:`` URI, so a later change of working folder cannot move it."""
    uri = setting or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_MLFLOW_STORE
    if uri in ("databricks", "databricks-uc", "uc") or _SCHEME.match(uri):
        return uri
    return Path(uri).absolute().as_uri()


class MlflowTracker:
    """An MLflow run in ``output.mlflow``'s store: the recipe as params, each line's numbers as metrics at its step,
    the run folder's files as artifacts; FINISHED or FAILED at the end."""

    def __init__(self, settings: dict[str, Any], run_name: str, resume_step: int | None = None) -> None:
        mlflow = _mlflow()
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self._mlflow, self._max_value, self._batch = mlflow, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        self.tracking_uri = mlflow_tracking_uri(settings["tracking_uri"])
        with _file_store_allowed(self.tracking_uri):
            self.client = mlflow.tracking.MlflowClient(self.tracking_uri)
        name = settings["experiment"] or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        tags = {"entrenar.resumed_from_step": str(resume_step)} if resume_step is not None else {}
        self.run_id = self.client.create_run(experiment_id, run_name=settings["run_name"] or run_name,
                                             tags=tags).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        items = [self._mlflow.entities.Param(k, v) for k, v in recipe_params(params, self._max_value).items()]
        for start in range(0, len(items), self._batch):
            self.client.log_batch(self.run_id, params=items[start:start + self._batch])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._mlflow.entities.Metric(name, value, stamp, step)
                                                    for name, value in metrics.items()])

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class WandbTracker:
    """A Weights & Biases run (``mode: offline`` needs no network: ``wandb sync`` uploads it later): the recipe as
    its config, each line's numbers at its step, copies of the run folder's files saved with the run."""

    def __init__(self, settings: dict[str, Any], run_name: str, resume_step: int | None = None) -> None:
        wandb = _wandb()
        options = {k: settings[k] for k in ("project", "entity", "mode", "dir") if settings[k] is not None}
        if "dir" in options:
            Path(options["dir"]).mkdir(parents=True, exist_ok=True)  # W&B falls back to a temporary folder
        notes = f"resumed from step {resume_step}" if resume_step is not None else None
        # create_new: a run of the caller's own, if one is active, stays as it is
        self.run = wandb.init(name=settings["run_name"] or run_name, notes=notes, reinit="create_new", **options)

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)  # an evaluation at the step of a train line joins that line's row

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:  # copied: W&B would link to them, and an offline run is uploaded later, maybe elsewhere
            copy = shutil.copy2(path, Path(self.run.dir) / path.name)
            self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def open_trackers(recipe: Recipe, run_dir: Path, resume_step: int | None = None) -> list[Tracker]:
    """The trackers ``recipe.output`` asks for, each with a run named after the run folder (unless its section
    names one) and the recipe logged; a tracker that cannot start closes those already started."""
    output, name = recipe.output, Path(run_dir).name
    starts: list[tuple[str, Any]] = []
    if output.tensorboard:
        starts.append(("output.tensorboard", lambda: TensorBoardTracker(run_dir, resume_step)))
    if output.mlflow is not None:
        starts.append(("output.mlflow", lambda: MlflowTracker(output.mlflow, name, resume_step)))
    if output.wandb is not None:
        starts.append(("output.wandb", lambda: WandbTracker(output.wandb, name, resume_step)))
    trackers: list[Tracker] = []
    try:
        for key, start in starts:
            try:
                trackers.append(start())
                trackers[-1].log_params(recipe.to_dict())
            except Exception as error:  # a server that refuses, W&B online without a login...
                raise ConfigError(f"{key}: the tracker could not start a run: {type(error).__name__}: {error}") \
                    from error
    except BaseException:
        for tracker in trackers:
            tracker.close(ok=False)
        raise
    return trackers


def run_artifacts(run_dir: Path) -> list[Path]:
    """The run folder's files a tracker receives at the end: the resolved recipe, the plots, the report."""
    return sorted({path for pattern in ARTIFACTS for path in Path(run_dir).glob(pattern) if path.is_file()})


__all__ = ["MlflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers",
           "recipe_params", "run_artifacts", "scalars", "tensorboard_writer_class"]
