"""``entrenar classify eval|predict`` on a trained classifier: the report, and predictions with the saved
temperature applied; a bad label names its file and line."""

from __future__ import annotations

import json

import pytest
import torch
from classification_workspace import recipe_for, write_data

import entrenar
from entrenar.cli.main import main
from entrenar.evaluation.metrics import softmax
from entrenar.train.loop import train


def test_classify_cli_eval_and_predict(workspace, tmp_path, capsys):
    result = train(recipe_for(workspace, "training.max_steps=2", "training.eval_every=0"), progress=False)
    data = write_data(workspace, "test.jsonl", n=10)
    args = [str(workspace / "model"), "--adapter", str(result.output), "--data", str(data)]
    assert main(["classify", "eval", *args, "--output", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "ECE" in out and (tmp_path / "rep" / "report.md").is_file()

    assert main(["classify", "predict", *args, "--output", str(tmp_path / "p.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and rows[0]["source"].endswith("test.jsonl line 1")
    # On the device the command chose (a GPU's products round otherwise than the CPU's).
    model, tokenizer = entrenar.load(workspace / "model", adapter=result.output)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("0+0")], device=model.score.weight.device)).float().cpu().numpy()
    probs = softmax(logits, model.info["temperature"])[0]  # the saved temperature is applied
    assert rows[0]["probs"]["small"] == pytest.approx(probs[0], abs=1e-6)
    assert rows[0]["label"] == ("small" if probs[0] > probs[1] else "big")

    write_data(workspace, "bad.jsonl", n=3, bad="medium")
    args[-1] = str(workspace / "bad.jsonl")
    assert main(["classify", "eval", *args]) == 2
    assert "bad.jsonl line 4: unknown label 'medium'" in capsys.readouterr().err


def test_a_classification_summary_prints_no_perplexity(workspace):
    """exp(label cross-entropy) is no perplexity: the summary's best-eval row gives the loss and the task's
    metrics rows, with no ppl (a language model's summary keeps it)."""
    from entrenar.train.metrics import read_metrics

    result = train(recipe_for(workspace, "training.max_steps=2", "training.eval_every=2", "training.save_every=0"),
                   progress=False)
    best = next(line for line in result.summary.splitlines() if line.startswith("best eval"))
    evals = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "eval_loss" in r]
    loss = min(r["eval_loss"] for r in evals)
    step = next(r["step"] for r in evals if r["eval_loss"] == loss)
    assert best.split(None, 2)[2] == f"loss {loss:.4f} at step {step}"
    assert "ppl" not in result.summary and "accuracy" in result.summary
