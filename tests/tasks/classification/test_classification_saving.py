"""What a classification run writes: a SEQ_CLS adapter and a merged *ForSequenceClassification folder that
transformers and peft load with equal logits, or (full fine-tune) a classifier folder with its calibration."""

from __future__ import annotations

import json

import pytest
import torch
from classification_workspace import recipe_for

import entrenar
from entrenar.export import export
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


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
    export(workspace / "model", result.output, workspace / "merged", merge=True)
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(workspace / "merged").eval()
    assert merged.config.id2label == {0: "small", 1: "big"}
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, ours, atol=1e-5, rtol=1e-5)
    reloaded, _ = entrenar.load(workspace / "merged")
    assert reloaded.info["temperature"] == model.info["temperature"]


def test_full_fine_tune_saves_a_classifier_folder(workspace):
    result = train(recipe_for(workspace, "lora=null", "training.max_steps=2", "training.eval_every=0"), progress=False)
    model, _ = entrenar.load(result.output)
    assert model.info["labels"] == ["small", "big"] and "temperature" in model.info


def test_a_classifier_run_trains_on_from_an_earlier_run(workspace):
    """model.path an earlier LoRA classifier run: the adapter and the head train on from its weights (the held-out
    loss before the first step is the earlier run's last), and the adapter saved names the plain base."""
    train(recipe_for(workspace))
    first = [r["eval_loss"] for r in read_metrics(workspace / "run" / "metrics.jsonl") if "eval_loss" in r]
    train(recipe_for(workspace, f"model.path={workspace / 'run'}", f"output.dir={workspace / 'again'}"))
    again = [r["eval_loss"] for r in read_metrics(workspace / "again" / "metrics.jsonl") if "eval_loss" in r]
    assert again[0] == pytest.approx(first[-1], abs=1e-5)
    assert again[-1] < again[0]
    config = json.loads((workspace / "again" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(workspace / "model")
