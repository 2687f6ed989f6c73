"""QAT from a recipe through the training loop: it trains, resumes exactly, and its integer model loads and
computes what the fake-quantized model computed."""

from __future__ import annotations

import json

import pytest
import torch

import entrenar
from conftest import crash_after_step
from entrenar import quickstart
from entrenar.config import load_recipe
from entrenar.errors import ConfigError, QuantError
from entrenar.quant.int import QuantLinear
from entrenar.train import trainer
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

STEPS = 6


def recipe_for(ws, *overrides):
    """LSQ with learned activation steps: the quantizer state a checkpoint must carry."""
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion}}
qat: {{bits: 4, granularity: group, group_size: 16, backward: lsq, activations: 8}}
optimizer: {{lr: 1.0e-2}}
training: {{max_steps: {STEPS}, batch_size: 2, save_every: 2, keep_last: 2, log_every: 1}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("method", ["qat", "lora-qat"])
def test_qat_run_resumes_exactly_and_its_integer_model_computes_what_it_trained(workspace, monkeypatch, method):
    overrides = ["lora={r: 4, alpha: 8, target_modules: all-linear}"] if method == "lora-qat" else []
    ids = torch.randint(0, quickstart.build_tokenizer().vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    trained = {}
    real_save = trainer.save_qat_model

    def save_and_remember_logits(model, tokenizer, folder):
        model.eval()
        with torch.no_grad():
            trained["logits"] = model(ids)
        return real_save(model, tokenizer, folder)

    monkeypatch.setattr(trainer, "save_qat_model", save_and_remember_logits)
    straight = train(recipe_for(workspace, *overrides, f"output.dir={workspace / 'straight'}"), progress=False)
    expected = losses(straight.run_dir)
    assert len(expected) == STEPS and len(set(expected)) == STEPS
    assert straight.quantized == straight.run_dir / "quantized" and "quantized" in straight.summary

    # The integer model (LoRA-QAT: the integer base with the run's adapter) reproduces the trained logits.
    adapter = straight.output if method == "lora-qat" else None
    model, _ = entrenar.load(straight.quantized, adapter=adapter, device="cpu")
    down_proj = model.model.layers[0].mlp.down_proj
    assert isinstance(down_proj.base_layer if adapter else down_proj, QuantLinear)
    with torch.no_grad():
        assert torch.equal(model(ids), trained["logits"])
        run_model, _ = entrenar.load(straight.run_dir, device="cpu")  # the run folder stands for the same pair
        assert torch.equal(run_model(ids), trained["logits"])
    entry = json.loads((straight.quantized / "config.json").read_text())["quantization_config"]
    assert {k: entry[k] for k in ("method", "bits", "granularity", "group_size", "activation_bits",
                                  "activation_scale", "source", "backward")} == {
        "method": "int", "bits": 4, "granularity": "group", "group_size": 16, "activation_bits": 8,
        "activation_scale": "static", "source": "qat", "backward": "lsq"}
    if method == "qat":  # the full fine-tune's usual output holds the master weights as a plain model
        master, _ = entrenar.load(straight.output, device="cpu")
        assert isinstance(master.model.layers[0].mlp.down_proj, torch.nn.Linear)

    # Crash right after step 5 is logged; the last checkpoint is step 4. The resumed run matches bit for bit.
    recipe = recipe_for(workspace, *overrides)
    crash_after_step(monkeypatch, recipe, 5)
    resumed = train(recipe, resume=True, progress=False)
    assert losses(resumed.run_dir) == expected
    model, _ = entrenar.load(resumed.quantized, adapter=resumed.output if adapter else None, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids), trained["logits"])


def test_checkpoints_carry_the_learned_steps(workspace):
    from safetensors.torch import load_file

    result = train(recipe_for(workspace, "training.max_steps=2"), progress=False)
    state = load_file(result.checkpoint / "model.safetensors")
    layer = "model.layers.0.self_attn.q_proj"
    assert {f"{layer}.weight_step", f"{layer}.act_step", f"{layer}.act_step_initialized"} <= set(state)
    assert state[f"{layer}.act_step_initialized"].item() is True


def test_recipe_errors_name_the_key_and_the_layer(workspace):
    with pytest.raises(ConfigError, match=r"'qat\.bits' must be an integer in \[2, 8\], got 9"):
        recipe_for(workspace, "qat.bits=9")
    with pytest.raises(ConfigError, match=r"'qat\.activations' must be true, false or a bit width in \[2, 8\]"):
        recipe_for(workspace, "qat.activations=16")
    with pytest.raises(ConfigError, match=r"'qat\.backward' must be one of: .* \(did you mean 'lsq'\?\)"):
        recipe_for(workspace, "qat.backward=lsqq")
    with pytest.raises(ConfigError, match=r"'lora\.quantize_base' must be null when 'qat' is set"):
        recipe_for(workspace, "lora={quantize_base: nf4}")
    assert recipe_for(workspace, "qat.activations=true").qat.activations == 8
    assert recipe_for(workspace, "qat=null").qat is None
    with pytest.raises(QuantError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight: qat\.group_size 24 "
                                         r"does not divide in_features 32"):
        train(recipe_for(workspace, "qat.group_size=24"), progress=False)
