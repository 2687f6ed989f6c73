"""Classification through the one training loop (LoRA, QLoRA, accumulation, exact resume, the report), and
ClassificationTask as the Task protocol has it."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from classification_workspace import losses, recipe_for

import entrenar
from conftest import crash_after_step
from entrenar.config import load_recipe
from entrenar.errors import ConfigError
from entrenar.tasks.base import Task
from entrenar.tasks.classification import ClassificationTask
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def test_classification_task_has_every_protocol_method_with_its_parameters():
    methods = [name for name, member in vars(Task).items() if not name.startswith("_") and callable(member)]
    assert {"load", "read", "stream", "loss_sum", "evaluate", "save", "finish"} <= set(methods)
    for name in methods:
        ours = getattr(ClassificationTask, name, None)
        assert callable(ours), f"ClassificationTask has no {name}()"
        expected = list(inspect.signature(getattr(Task, name)).parameters)
        assert list(inspect.signature(ours).parameters) == expected, name
    for attribute in Task.__annotations__:  # name
        assert hasattr(ClassificationTask(recipe=None), attribute), attribute


def test_lora_run_trains_reports_and_resumes_exactly(workspace, monkeypatch):
    straight = train(recipe_for(workspace, f"output.dir={workspace / 'straight'}"), progress=False)
    expected = losses(straight.run_dir)
    assert len(expected) == 6 and len(set(expected)) == 6
    run = straight.run_dir
    for name in ("report.json", "report.md", "confusion_matrix.png", "reliability.png"):
        assert (run / name).is_file(), name
    report = json.loads((run / "report.json").read_text())
    assert report["labels"] == ["small", "big"] and report["examples"] == 12
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_macro_f1" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    info = json.loads((run / "adapter" / "classifier.json").read_text())
    assert info["temperature"] == report["calibration"]["temperature"] > 0
    assert (run / "best" / "adapter" / "adapter_model.safetensors").is_file()

    recipe = recipe_for(workspace)
    crash_after_step(monkeypatch, recipe, 5)
    resumed = train(recipe, resume=True, progress=False)
    assert losses(resumed.run_dir) == expected  # bit for bit, head included
    best = "best/adapter/adapter_model.safetensors"  # the same evaluation is the best after the resume
    assert (resumed.run_dir / best).read_bytes() == (straight.run_dir / best).read_bytes()
    best_line = next(line for line in straight.summary.splitlines() if line.startswith("best macro_f1"))
    assert best_line in resumed.summary


def test_accumulation_normalises_by_the_whole_step(workspace):
    one = train(recipe_for(workspace, "training.batch_size=4", "output.dir=" + str(workspace / "a")), progress=False)
    two = train(recipe_for(workspace, "training.batch_size=2", "training.grad_accum=2",
                           "output.dir=" + str(workspace / "b")), progress=False)
    torch.testing.assert_close(torch.tensor(losses(two.run_dir)), torch.tensor(losses(one.run_dir)), atol=1e-5, rtol=0)


def test_qlora_trains_the_head_beside_nf4_adapters(workspace):
    result = train(recipe_for(workspace, "lora.quantize_base=nf4", "training.max_steps=2", "training.eval_every=0"),
                   progress=False)
    model, _ = entrenar.load(workspace / "model", adapter=result.output, quantize="nf4")
    assert model.score.weight.abs().sum() > 0 and (result.run_dir / "report.json").is_file()


def test_metric_must_belong_to_the_problem_type(workspace):
    with pytest.raises(ConfigError, match="task.metric: 'rmse' is not a single_label metric"):
        train(recipe_for(workspace, "task.metric=rmse"), dry_run=True, progress=False)


def test_task_section_is_checked():
    with pytest.raises(ConfigError, match="task.pooling"):
        load_recipe(None, ["task.pooling=first"])
    with pytest.raises(ConfigError, match="task.num_labels"):
        load_recipe(None, ["task.labels=[a, b]", "task.num_labels=3"])
    with pytest.raises(ConfigError, match="task.class_weights"):
        load_recipe(None, ["task.class_weights=[1, -1]"])


@pytest.mark.parametrize("problem_type", ["multi_label", "regression"])
def test_multi_label_and_regression_runs_write_their_report(workspace, problem_type):
    with open(workspace / "other.csv", "w") as f:
        f.write("text,label\n")
        for i in range(30):
            a, b = i % 10, (i * 3) % 10
            label = {"multi_label": f'"{"even," if a % 2 == 0 else ""}{"big" if a + b > 9 else ""}"',
                     "regression": str((a + b) / 18)}[problem_type]
            f.write(f"{a}+{b},{label}\n")
    task = ("{type: classification, problem_type: multi_label, labels: [even, big]}" if problem_type == "multi_label"
            else "{type: classification, problem_type: regression}")
    result = train(recipe_for(workspace, f"data.train={workspace / 'other.csv'}", f"task={task}",
                              "training.max_steps=3", "training.eval_every=0"), progress=False)
    report = json.loads((result.run_dir / "report.json").read_text())
    if problem_type == "multi_label":
        assert {"micro_f1", "macro_f1", "subset_accuracy", "hamming_loss"} <= set(report["metrics"])
        assert len(report["calibration"]["thresholds"]) == 2
    else:
        assert {"rmse", "mae", "r2", "spearman"} <= set(report["metrics"])
        assert set(report["headline"]) == {"rmse", "r2"}
