"""Classification through the one training loop: loss as transformers computes it, exact resume, accumulation,
data errors, the report, and exports that transformers and peft load with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import crash_after_step

import entrenar
from entrenar.config import load_recipe
from entrenar.errors import ConfigError, DataError
from entrenar.tasks.classification import loss_sum
from entrenar.train.loop import train
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


@pytest.mark.parametrize("problem_type,num_labels", [("single_label", 3), ("multi_label", 3), ("regression", 2)])
def test_loss_equals_transformers(problem_type, num_labels):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, num_labels=num_labels, pad_token_id=0,
                                      problem_type={"single_label": "single_label_classification",
                                                    "multi_label": "multi_label_classification"}.get(problem_type, "regression"))
    hf = transformers.LlamaForSequenceClassification(config).eval()
    ids = torch.randint(1, 64, (5, 7))
    if problem_type == "single_label":
        labels = torch.randint(0, num_labels, (5,))
    elif problem_type == "multi_label":
        labels = torch.randint(0, 2, (5, num_labels)).float()
    else:
        labels = torch.randn(5, num_labels)
    out = hf(input_ids=ids, labels=labels)
    count = labels.numel()
    torch.testing.assert_close(loss_sum(out.logits, labels, problem_type) / count, out.loss)


def test_weighted_smoothed_cross_entropy_is_torch_mean_over_the_step():
    logits, labels = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    w = torch.tensor([0.5, 1.0, 2.0])
    expected = torch.nn.functional.cross_entropy(logits, labels, weight=w, label_smoothing=0.1)
    torch.testing.assert_close(loss_sum(logits, labels, "single_label", w, 0.1) / w[labels].sum(), expected)


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


def test_exports_load_in_transformers_and_peft_with_equal_logits(workspace):
    import peft
    import transformers

    result = train(recipe_for(workspace, "training.max_steps=2", "training.eval_every=0"), progress=False)
    model, tokenizer = entrenar.load(workspace / "model", adapter=result.output, device="cpu")
    ids = torch.tensor([tokenizer.encode("3+4"), tokenizer.encode("9+9")])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = model(ids, mask)

    # Base + adapter, as PEFT loads a SEQ_CLS adapter (the head from modules_to_save).
    base = transformers.AutoModelForSequenceClassification.from_pretrained(workspace / "model", num_labels=2,
                                                                           pad_token_id=tokenizer.pad_id)
    with_adapter = peft.PeftModel.from_pretrained(base, result.output).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids, attention_mask=mask).logits, ours, atol=1e-5, rtol=1e-5)

    # Merged: a *ForSequenceClassification folder.
    from entrenar.export import export

    export(workspace / "model", result.output, workspace / "merged", merge=True)
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(workspace / "merged").eval()
    assert merged.config.id2label == {0: "small", 1: "big"}
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, ours, atol=1e-5, rtol=1e-5)
    reloaded, _ = entrenar.load(workspace / "merged")
    assert reloaded.info["temperature"] == model.info["temperature"]


def test_qlora_trains_the_head_beside_nf4_adapters(workspace):
    result = train(recipe_for(workspace, "lora.quantize_base=nf4", "training.max_steps=2", "training.eval_every=0"),
                   progress=False)
    model, _ = entrenar.load(workspace / "model", adapter=result.output, quantize="nf4")
    assert model.score.weight.abs().sum() > 0 and (result.run_dir / "report.json").is_file()


def test_full_fine_tune_saves_a_classifier_folder(workspace):
    result = train(recipe_for(workspace, "lora=null", "training.max_steps=2", "training.eval_every=0"), progress=False)
    model, _ = entrenar.load(result.output)
    assert model.info["labels"] == ["small", "big"] and "temperature" in model.info


@pytest.mark.parametrize("bad", ["medium", 7])
def test_unknown_or_out_of_range_label_names_file_and_line(workspace, bad):
    recipe = recipe_for(workspace)
    write_data(workspace, bad=bad)
    with pytest.raises(DataError, match=r"cls\.jsonl line 49"):
        train(recipe, progress=False)
    skipping = recipe_for(workspace, "data.on_error=skip")
    write_data(workspace, bad=bad)
    result = train(skipping, dry_run=True, progress=False)
    assert "1 record(s) skipped" in result.summary


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


def test_classify_cli_eval_and_predict(workspace, tmp_path, capsys):
    from entrenar.cli.main import main
    from entrenar.evaluation.metrics import softmax

    result = train(recipe_for(workspace, "training.max_steps=2", "training.eval_every=0"), progress=False)
    data = write_data(workspace, "test.jsonl", n=10)
    args = [str(workspace / "model"), "--adapter", str(result.output), "--data", str(data)]
    assert main(["classify", "eval", *args, "--output", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "ECE" in out and (tmp_path / "rep" / "report.md").is_file()

    assert main(["classify", "predict", *args, "--output", str(tmp_path / "p.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and rows[0]["source"].endswith("test.jsonl line 1")
    model, tokenizer = entrenar.load(workspace / "model", adapter=result.output, device="cpu")
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("0+0")])).numpy()
    probs = softmax(logits, model.info["temperature"])[0]  # the saved temperature is applied
    assert rows[0]["probs"]["small"] == pytest.approx(probs[0], abs=1e-6)
    assert rows[0]["label"] == ("small" if probs[0] > probs[1] else "big")

    write_data(workspace, "bad.jsonl", n=3, bad="medium")
    args[-1] = str(workspace / "bad.jsonl")
    assert main(["classify", "eval", *args]) == 2
    assert "bad.jsonl line 4: unknown label 'medium'" in capsys.readouterr().err


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


def test_skipped_labels_are_listed_in_the_runs_skipped_jsonl(workspace):
    recipe = recipe_for(workspace, "training.max_steps=1", "data.on_error=skip")
    write_data(workspace, bad="huge")  # one record with a label that is not a class
    result = train(recipe, progress=False)
    lines = [json.loads(line) for line in (result.run_dir / "skipped.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and "huge" in json.dumps(lines[0]) and "line 49" in json.dumps(lines[0])


def test_class_weights_count_only_the_rows_trained_on(workspace):
    """The validation split is taken out before the weights are counted (they were counted on every row)."""
    from entrenar import tasks
    from entrenar.tasks.classification import class_weights
    from entrenar.train.loop import build_data

    recipe = recipe_for(workspace, "task.class_weights=inverse_freq")
    task = tasks.for_recipe(recipe)
    _, tokenizer = task.load(recipe.model.path, dtype="float32", device="cpu", quantize=None)
    examples, validation, notes, _ = build_data(recipe, task, tokenizer, [])
    assert task.weights == class_weights("inverse_freq", examples, 2)
    assert task.weights != class_weights("inverse_freq", examples + validation, 2)
    assert any(note.startswith("class weights: ") for note in notes)
