"""A classifier's training accuracy per step: metrics.jsonl's train_accuracy and the console line, held against
transformers' *ForSequenceClassification on the saved model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from entrenar.config import Recipe
from entrenar.models.random_init import byte_tokenizer
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

TEXTS = [(f"{word} {i}", label) for i in range(6) for word, label in (("apple", "fruit"), ("carrot", "veg"))]


def test_train_accuracy_is_the_share_of_the_steps_rows_the_model_classified_right(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in TEXTS))
    recipe = Recipe.from_dict({
        "model": {"init": "random", "device": "cpu", "config": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}},
        "data": {"train": str(data), "seq_len": 16, "shuffle": False}, "task": {"type": "classification"},
        "lora": None, "optimizer": {"lr": 1e-12, "weight_decay": 0.0},  # the weights stay as drawn
        "training": {"max_steps": 2, "batch_size": len(TEXTS), "log_every": 1, "seed": 3},
        "output": {"dir": str(tmp_path / "run")}})
    result = train(recipe, progress=False, verbose=True)
    steps = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]

    reference = transformers.AutoModelForSequenceClassification.from_pretrained(result.output).eval()
    labels = reference.config.label2id
    tokenizer = byte_tokenizer()
    with torch.no_grad():
        right = sum(int(reference(torch.tensor([tokenizer.encode(text)])).logits.argmax(-1)) == labels[label]
                    for text, label in TEXTS)
    assert 0 < right < len(TEXTS)  # a random head: some right, some wrong, so the count means something
    # every row, each step (an fp32 ratio on the device)
    assert [r["train_accuracy"] for r in steps] == pytest.approx([right / len(TEXTS)] * 2, abs=1e-7)
    assert f"train_accuracy {right / len(TEXTS):.3f}" in capsys.readouterr().out


def test_a_regression_step_has_no_accuracy(tmp_path):
    recipe = Recipe.from_dict({
        "model": {"init": "random", "device": "cpu", "config": {
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}},
        "data": {"train": "synth:regression:8", "seq_len": 48},
        "task": {"type": "classification", "problem_type": "regression"}, "lora": None,
        "training": {"max_steps": 1, "batch_size": 4}, "output": {"dir": str(tmp_path / "run")}})
    result = train(recipe, progress=False)
    [step] = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert "train_accuracy" not in step
