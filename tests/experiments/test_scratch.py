"""Training from scratch: model.init random builds a seeded model from a config.json-style mapping."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import entrenar
from entrenar.config import Recipe, load_recipe
from entrenar.errors import ConfigError
from entrenar.models import random_init as scratch
from entrenar.models.config import ModelConfig
from entrenar.train import arch

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
       "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 260}
DENSE = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1}


def recipe(config, seed=0, **model):
    return Recipe.from_dict({"model": {"init": "random", "device": "cpu", "config": config, **model},
                             "data": {"train": "unused.jsonl"}, "training": {"seed": seed}})


def test_byte_tokenizer_ids_are_the_utf8_bytes_and_transformers_agrees(tmp_path):
    import transformers

    tok = scratch.byte_tokenizer()
    text = "héllo, wörld ✓\n\t x"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))


def test_random_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = scratch.build(recipe(MOE, seed=1), "float32", "cpu")
    assert torch.rand(1) == before  # build() restored the caller's generator
    b, _ = scratch.build(recipe(MOE, seed=1), "float32", "cpu")
    c, _ = scratch.build(recipe(MOE, seed=2), "float32", "cpu")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    # Llama's initialisation: normal(0, initializer_range) weights, unit norms.
    w = sa["model.layers.0.mlp.experts.gate_up_proj"]
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(sa["model.norm.weight"], torch.ones(32))
    assert a.config.num_experts == 4 and a.config.vocab_size == 260


def test_dense_config_takes_vocab_and_special_ids_from_the_tokenizer():
    model, tok = scratch.build(recipe(DENSE), "bfloat16", "cpu")
    assert model.config.vocab_size == 259 and model.config.eos_token_id == 257 and model.config.pad_token_id == 258
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    assert model.config.num_parameters == sum(p.numel() for p in model.parameters())


def test_a_tokenizer_file_is_used_and_must_fit_the_vocabulary(tmp_path):
    scratch.byte_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    _, tok = scratch.build(recipe(DENSE, tokenizer=str(tmp_path / "tokenizer.json")), "float32", "cpu")
    assert tok.vocab_size == 259 and tok.eos_id == 257
    with pytest.raises(ConfigError, match=r"model.config: 'vocab_size' is 100 but the tokenizer .* 259 tokens"):
        scratch.build(recipe({**DENSE, "vocab_size": 100}), "float32", "cpu")
    with pytest.raises(ConfigError, match="model.tokenizer: .*nope.json: no such"):
        scratch.build(recipe(DENSE, tokenizer=str(tmp_path / "nope.json")), "float32", "cpu")


@pytest.mark.parametrize("model, message", [
    ({"init": "random"}, "'model.config' is required when 'model.init' is random"),
    ({"init": "random", "config": [1]}, "'model.config' must be null or a non-empty mapping"),
    ({"init": "random", "config": DENSE, "path": "m"}, "'model.path' must be null when 'model.init' is random"),
    ({"path": "m", "config": DENSE}, "'model.config' is for 'model.init: random'"),
    ({"init": "randm", "config": DENSE}, "did you mean 'random'"),
])
def test_recipe_refusals_name_the_key(model, message):
    with pytest.raises(ConfigError, match=message):
        Recipe.from_dict({"model": model, "data": {"train": "x.jsonl"}})


@pytest.mark.parametrize("change, message", [
    ({"model_type": None}, "model.config: missing key 'model_type'"),
    ({"model_type": "gpt2"}, "unknown model family 'gpt2'"),
    ({"hidden_size": "big"}, "model.config: 'hidden_size' must be a positive integer"),
    ({"num_hidden_layers": None}, "missing key 'num_hidden_layers'"),
    ({"num_hiden_layers": 3}, "model.config: unknown key 'num_hiden_layers' for model_type llama"),
    ({"router_scoring": "sigmoid"}, "unknown key 'router_scoring'"),
])
def test_config_errors_name_the_key(change, message):
    config = {k: v for k, v in {**DENSE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        scratch.build(recipe(config), "float32", "cpu")


def test_fingerprint_is_sha256_of_the_canonical_json_and_ignores_spelling():
    a = ModelConfig.from_hf({**DENSE, "vocab_size": 259})
    b = ModelConfig.from_hf({**DENSE, "vocab_size": 259, "head_dim": 16, "rope_theta": 10000, "initializer_range": 0.5,
                             "eos_token_id": 3})
    text = arch.canonical_json(a)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert '"rope_theta":10000,' in text and '"rms_norm_eps":1e-06,' in text and " " not in text
    assert arch.fingerprint(a) == hashlib.sha256(text.encode()).hexdigest() == arch.fingerprint(b)
    assert arch.fingerprint(a) != arch.fingerprint(a.replace(num_kv_heads=2))
    assert arch.fingerprint(a) != arch.fingerprint(a.replace(model_type="qwen2", qkv_bias=True))
    record = arch.arch_record(ModelConfig.from_hf(MOE))
    assert record["parameters"] > record["active_parameters"] and record["moe"]


def test_a_run_from_scratch_trains_writes_arch_json_and_loads_back(tmp_path):
    import transformers

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"{w}>{w[::-1]}"}) + "\n"
                            for w in ("abcd", "bcda", "cdab", "dabc", "acbd", "bdca") * 8))
    (tmp_path / "r.yaml").write_text(json.dumps({
        "model": {"init": "random", "device": "cpu", "config": MOE},
        "data": {"train": str(data), "seq_len": 16}, "lora": None, "optimizer": {"lr": 0.01},
        "training": {"max_steps": 8, "batch_size": 4, "log_every": 1}, "output": {"dir": str(tmp_path / "run")}}))
    from entrenar.train.loop import train
    from entrenar.train.metrics import read_metrics

    result = train(load_recipe(tmp_path / "r.yaml"), progress=False)
    losses = [r["loss"] for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 1.0  # from ln(260) ~ 5.6 down
    record = json.loads((result.run_dir / "arch.json").read_text())
    config = ModelConfig.from_hf(MOE)
    assert record["fingerprint"] == arch.fingerprint(config)
    assert (record["parameters"], record["active_parameters"]) == (config.num_parameters, config.num_active_parameters)
    model, tok = entrenar.load(result.run_dir / "model", dtype="float32", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.run_dir / "model", dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("abcd>dcba")])
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(result.run_dir / "model")
    assert ids[0].tolist() == hf_tokenizer("abcd>dcba")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["MixtralConfig", "Qwen3MoeConfig", "Qwen2Config"])
def test_a_whole_transformers_config_builds_the_model_transformers_builds(name):
    import transformers

    hf_config = getattr(transformers, name)(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=300,
                                            **({"num_local_experts": 4, "num_experts_per_tok": 2}
                                               if name == "MixtralConfig" else {}),
                                            **({"num_experts": 4, "moe_intermediate_size": 16, "num_experts_per_tok": 2}
                                               if name == "Qwen3MoeConfig" else {}))
    model, _ = scratch.build(recipe(hf_config.to_dict()), "float32", "cpu")
    reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert model.config.num_parameters == sum(p.numel() for p in reference.parameters())


def test_set_changes_one_key_of_model_config(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({"model": {"init": "random", "config": DENSE}, "data": {"train": "synth:mixture:9"}}))
    recipe = load_recipe(path, ["model.config.hidden_size=64", "model.config.num_hidden_layers=3"])
    assert recipe.model.config == {**DENSE, "hidden_size": 64, "num_hidden_layers": 3}
    with pytest.raises(ConfigError, match="'model.config' is set as a whole"):
        load_recipe(path, ["model.config.a.b=1"])
