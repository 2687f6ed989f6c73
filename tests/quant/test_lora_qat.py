"""LoRA-QAT as issue #36 specifies it: LSQ's step sizes learned under LoRA (their own learning rate, saved beside
the adapter), qat.target_modules, and the adapters quantized with their base (qat.quantize_lora)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import entrenar
from entrenar import quickstart
from entrenar.adapters.lora import LoraLinear
from entrenar.config import load_recipe
from entrenar.errors import ConfigError, QuantError
from entrenar.quant.int import QuantLinear
from entrenar.quant.qat import (
    QAT_STATE_FILE,
    FakeQuantLinear,
    QuantizedLoraLinear,
    load_qat_adapter,
    prepare_qat,
    qat_config,
)
from entrenar.train import trainer
from entrenar.train.loop import train

LAYER = "model.layers.0.self_attn.q_proj"


def recipe_for(ws, *overrides):
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion}}
qat: {{bits: 3, granularity: group, group_size: 16, backward: lsq, activations: 8, scale_lr: 2.0e-2}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
optimizer: {{lr: 1.0e-2}}
training: {{max_steps: 3, batch_size: 2, log_every: 1}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


@pytest.fixture
def ids():
    vocab = quickstart.build_tokenizer().vocab_size
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def remember_trained_logits(monkeypatch, ids):
    """The trained model's logits, taken just before the run writes its integer model."""
    trained = {}
    real_save = trainer.save_qat_model

    def save(model, tokenizer, folder):
        model.eval()
        with torch.no_grad():
            trained["logits"] = model(ids)
        return real_save(model, tokenizer, folder)

    monkeypatch.setattr(trainer, "save_qat_model", save)
    return trained


def qat_base(ws, recipe):
    """The run's base, fake-quantized as the run prepared it (steps at their initialisation)."""
    model, _ = entrenar.load(ws / "model", device="cpu")
    prepare_qat(model, qat_config(recipe.qat))
    return model


def test_lora_qat_learns_its_steps_at_scale_lr_and_the_export_reproduces_the_trained_logits(workspace, monkeypatch,
                                                                                           ids):
    recipe = recipe_for(workspace)
    groups = {}
    real_build = trainer.build_param_groups

    def build(model, *args, **kwargs):
        groups["groups"] = real_build(model, *args, **kwargs)
        return groups["groups"]

    monkeypatch.setattr(trainer, "build_param_groups", build)
    trained = remember_trained_logits(monkeypatch, ids)
    result = train(recipe, progress=False)

    # The steps are their own group: no weight decay, at qat.scale_lr (optimizer.lr x 2).
    steps = [g for g in groups["groups"] if any(n.endswith("_step") for n in g["names"])]
    assert len(steps) == 1 and all(n.endswith(("weight_step", "act_step")) for n in steps[0]["names"])
    assert steps[0]["weight_decay"] == 0.0 and steps[0]["lr_scale"] == pytest.approx(2.0)
    assert f"{LAYER}.base_layer.weight_step" in steps[0]["names"]

    # They moved: the file beside the adapter differs from the initialisation in every layer.
    state = load_file(result.output / QAT_STATE_FILE)
    initial = {n: m.weight_step.detach() for n, m in qat_base(workspace, recipe).named_modules()
               if isinstance(m, FakeQuantLinear)}
    assert len(initial) == 14
    for name, step in initial.items():
        assert not torch.equal(state[f"{name}.base_layer.weight_step"], step), name

    # The exported integer base with the adapter reproduces the trained logits bit for bit...
    model, _ = entrenar.load(result.quantized, adapter=result.output, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids), trained["logits"])
    # ... and so does the full-precision base, fake-quantized, with the adapter and its learned steps.
    base = qat_base(workspace, recipe)
    load_qat_adapter(base, result.output)
    base.eval()
    with torch.no_grad():
        assert torch.equal(base(ids), trained["logits"])


def test_an_adapter_without_its_steps_is_refused_on_an_lsq_model(workspace, tmp_path):
    recipe = recipe_for(workspace, "training.max_steps=1")
    result = train(recipe, progress=False)
    saved = (result.output / QAT_STATE_FILE).read_bytes()
    (result.output / QAT_STATE_FILE).unlink()
    with pytest.raises(QuantError, match=rf"no {QAT_STATE_FILE}; the model learns its quantizer steps"):
        load_qat_adapter(qat_base(workspace, recipe), result.output)
    (result.output / QAT_STATE_FILE).write_bytes(saved)
    other = qat_base(workspace, recipe_for(workspace, "qat.bits=4"))
    with pytest.raises(QuantError, match=r"learned for qat .*'bits': 3.*the model is prepared with .*'bits': 4"):
        load_qat_adapter(other, result.output)


def test_scale_lr_needs_lsq():
    with pytest.raises(ConfigError, match=r"'qat\.scale_lr' is the learning rate of LSQ's learned step sizes"):
        entrenar.config.Recipe.from_dict({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                                          "qat": {"backward": "ste", "scale_lr": 1e-3}})


@pytest.mark.parametrize("targets, expected", [
    ("[q_proj, v_proj]", {"q_proj", "v_proj"}),
    ("lora", {"q_proj", "k_proj"}),
])
def test_qat_target_modules_selects_the_fake_quantized_layers(workspace, targets, expected):
    from entrenar.tasks import for_recipe as task_for
    from entrenar.train.prepare import build_model

    recipe = recipe_for(workspace, f"qat.target_modules={targets}", "lora.target_modules=[q_proj, k_proj]")
    model, _ = build_model(recipe, task_for(recipe), "float32", torch.device("cpu"), None)
    names = {n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    assert {n.replace(".base_layer", "").rsplit(".", 1)[1] for n in names} == expected
    assert len(names) == 2 * len(expected)


def test_qat_target_modules_errors_name_the_key(workspace):
    with pytest.raises(ConfigError, match=r"'qat\.target_modules' lora selects the layers LoRA adapts"):
        recipe_for(workspace, "qat.target_modules=lora", "lora=null")
    with pytest.raises(ConfigError, match=r"'qat\.target_modules' must be 'all-linear', 'lora' or a non-empty list"):
        recipe_for(workspace, "qat.target_modules=q_proj")
    with pytest.raises(QuantError, match=r"^qat\.target_modules: target_modules \['q_prj'\] match no linear layer"):
        train(recipe_for(workspace, "qat.target_modules=[q_prj]"), progress=False)


def test_quantize_lora_trains_q_of_w_plus_ba_and_its_merged_integer_model_is_exact(workspace, monkeypatch, ids):
    trained = remember_trained_logits(monkeypatch, ids)
    recipe = recipe_for(workspace, "qat.quantize_lora=true", "qat.backward=ste", "qat.scale_lr=null")
    result = train(recipe, progress=False)
    entry = json.loads((result.quantized / "config.json").read_text())["quantization_config"]
    assert entry["lora"] == "merged" and entry["bits"] == 3
    model, _ = entrenar.load(result.run_dir, device="cpu")  # the run stands for its merged integer model alone
    assert isinstance(model.get_submodule(LAYER), QuantLinear)
    with torch.no_grad():
        assert torch.equal(model(ids), trained["logits"])
    # Merged and unmerged are one model: the report says so.
    line = next(line for line in result.summary.splitlines() if "merged integer" in line)
    assert "(+0.0000; Q(W + BA), what quantized/ holds)" in line
    # The adapter on the fake-quantized base, as trained: the layers quantize W + BA again.
    base = qat_base(workspace, recipe)
    load_qat_adapter(base, result.output)
    assert isinstance(base.get_submodule(LAYER), QuantizedLoraLinear)
    base.eval()
    with torch.no_grad():
        assert torch.equal(base(ids), trained["logits"])


def test_without_quantize_lora_the_merged_integer_model_is_reported_against_the_unmerged_one(workspace):
    result = train(recipe_for(workspace), progress=False)
    line = next(line for line in result.summary.splitlines() if "merged integer" in line)
    assert "unmerged" in line and "re-quantized" in line
    size = (result.quantized / "model.safetensors").stat().st_size / 2**20
    assert f"{result.quantized} (3-bit codes; weights {size:.2f} MiB on disk)" in result.summary
    loaded, _ = entrenar.load(result.quantized, adapter=result.output, device="cpu")
    assert isinstance(loaded.get_submodule(LAYER), LoraLinear)


def test_quantize_lora_refuses_dropout_and_a_recipe_without_lora(workspace):
    with pytest.raises(ConfigError, match=r"'qat\.quantize_lora' quantizes W \+ BA as one weight.*lora\.dropout"):
        recipe_for(workspace, "qat.quantize_lora=true", "lora.dropout=0.1")
    with pytest.raises(ConfigError, match=r"'qat\.quantize_lora' quantizes the adapters with their base"):
        recipe_for(workspace, "qat.quantize_lora=true", "lora=null")


def test_an_nf4_base_with_qat_is_refused_with_the_reason_and_the_alternatives(workspace):
    with pytest.raises(ConfigError) as refused:
        recipe_for(workspace, "lora.quantize_base=nf4")
    message = str(refused.value)
    assert "'lora.quantize_base' must be null when 'qat' is set" in message
    assert "QLoRA trains the adapters against the very base they ship with" in message
    assert "quantize twice" in message and "entrenar inspect MODEL --qat BITS" in message
