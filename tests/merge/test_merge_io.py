"""Whole merges on tiny random checkpoints: outputs against the formula on the inputs' state dicts, loading in
transformers and entrenar, sharding, slices, model+adapter, GGUF in and out, vocabularies, dry runs, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_hf_model
from entrenar.errors import ConfigError, ModelError
from entrenar.merge import merge
from entrenar.merge import methods as M


@pytest.fixture
def models(tmp_path):
    """Three tiny Llamas with the quickstart tokenizer (so entrenar.load opens them): base, a, b."""
    from entrenar import quickstart

    tokenizer = quickstart.build_tokenizer()
    out = {}
    for seed, name in enumerate(("base", "a", "b")):
        model = make_hf_model("llama", seed=seed, vocab_size=tokenizer.vocab_size)
        model.save_pretrained(tmp_path / name)
        tokenizer.save(tmp_path / name)
        out[name] = tmp_path / name
    return out


def state(folder):
    from entrenar.models.hf import weight_files

    sd = {}
    for f in weight_files(folder):
        sd.update(load_file(f))
    return sd


def test_linear_merge_matches_formula_and_loads_in_transformers_and_entrenar(models, tmp_path):
    import transformers

    import entrenar

    out = tmp_path / "out"
    merge({"merge_method": "linear", "models": [{"model": str(models["a"]), "parameters": {"weight": 1.0}},
                                                {"model": str(models["b"]), "parameters": {"weight": 3.0}}]}, out)
    a, b, m = state(models["a"]), state(models["b"]), state(out)
    assert set(m) == set(a)
    for name in a:
        assert torch.allclose(m[name], (a[name] + 3 * b[name]) / 4, atol=1e-7), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, tokenizer = entrenar.load(out)
    ids = torch.tensor([tokenizer.encode("12+7=")])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-5)
    card = (out / "README.md").read_text()
    assert "linear" in card and str(models["a"]) in card and "merge_method: linear" in card
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_ties_sharded_output_matches_formula(models, tmp_path):
    out = tmp_path / "out"
    cfg = {"merge_method": "ties", "base_model": str(models["base"]), "dtype": "float32", "models": [
        {"model": str(models["a"]), "parameters": {"weight": 0.7, "density": 0.5}},
        {"model": str(models["b"]), "parameters": {"weight": [0.2, 0.8], "density": 0.3}}]}
    merge(cfg, out, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    base, a, b, m = state(models["base"]), state(models["a"]), state(models["b"]), state(out)
    name = "model.layers.1.mlp.up_proj.weight"  # layer 1 of 2: t = 1, so b's weight is 0.8
    want = M.task_arithmetic_family(M.METHODS["ties"].recipe, base[name], [a[name], b[name]], [0.7, 0.8], [0.5, 0.3],
                                    normalize=True)
    assert torch.equal(m[name], want)
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(out)  # the index and shards load


@pytest.mark.parametrize("method", ["ties", "dare_ties", "task_arithmetic", "della", "breadcrumbs_ties"])
def test_merging_the_base_with_itself_is_the_identity(models, tmp_path, method):
    base = str(models["base"])
    merge({"merge_method": method, "base_model": base,
           "models": [{"model": base, "parameters": {"weight": 0.5, "density": 0.5}},
                      {"model": str(models["a"]), "parameters": {"weight": 0.0, "density": 0.5}}]}, tmp_path / "o")
    b, m = state(models["base"]), state(tmp_path / "o")
    assert all(torch.equal(b[n], m[n]) for n in b)


def test_random_methods_are_reproducible_by_seed(models, tmp_path):
    cfg = {"merge_method": "dare_ties", "base_model": str(models["base"]),
           "models": [{"model": str(models["a"]), "parameters": {"weight": 0.5, "density": 0.3}},
                      {"model": str(models["b"]), "parameters": {"weight": 0.5, "density": 0.3}}]}
    merge(cfg, tmp_path / "one", seed=3)
    merge(cfg, tmp_path / "two", seed=3)
    merge(cfg, tmp_path / "three", seed=4)
    one, two, three = state(tmp_path / "one"), state(tmp_path / "two"), state(tmp_path / "three")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(one[name], two[name]) and not torch.equal(one[name], three[name])


def test_passthrough_slices_build_a_deeper_model(models, tmp_path):
    import transformers

    out = tmp_path / "franken"
    merge({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(models["a"]), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(models["b"]), "layer_range": [1, 2],
                      "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}}]}]}, out)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    a, b, m = state(models["a"]), state(models["b"]), state(out)
    assert torch.equal(m["model.layers.1.mlp.up_proj.weight"], a["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(m["model.layers.2.mlp.up_proj.weight"], b["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(m["model.layers.2.self_attn.o_proj.weight"], 0.5 * b["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(m["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert torch.equal(m["lm_head.weight"], b["lm_head.weight"])  # after the layers: from the last slice
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_slerp_with_layer_gradient(models, tmp_path):
    out = tmp_path / "s"
    merge({"merge_method": "slerp", "base_model": str(models["base"]),
           "slices": [{"sources": [{"model": str(models["base"]), "layer_range": [0, 2]},
                                   {"model": str(models["a"]), "layer_range": [0, 2]}]}],
           "parameters": {"t": [{"filter": "self_attn", "value": [0.0, 1.0]}, {"value": 0.3}]}}, out)
    base, a, m = state(models["base"]), state(models["a"]), state(out)
    q0, q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(m[q0], base[q0]) and torch.allclose(m[q1], a[q1])
    up = "model.layers.1.mlp.up_proj.weight"
    assert torch.allclose(m[up], M.slerp(0.3, base[up], a[up]))


def test_model_plus_adapter_equals_peft_merge(models, tmp_path):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(models["base"])
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                   init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    want = lora.merge_and_unload().state_dict()
    ref = f"{models['base']}+{tmp_path / 'adapter'}"
    merge({"merge_method": "passthrough", "models": [{"model": ref}]}, tmp_path / "out")
    m = state(tmp_path / "out")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.1.mlp.up_proj.weight"):
        assert torch.allclose(m[name], want[name], atol=1e-6), name


def test_gguf_input_and_output(tmp_path):
    import entrenar
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.export.gguf_write import write_gguf
    from entrenar.models.gguf import read_gguf
    from gguf_fixtures import train_byte_level_tokenizer

    tokenizer = Tokenizer(train_byte_level_tokenizer("gpt-2", vocab_size=300), eos_token="<|endoftext|>")
    for seed, name in enumerate(("a", "b")):
        make_hf_model("llama", seed=seed, vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path / name)
        tokenizer.save(tmp_path / name)
    model, _ = entrenar.load(tmp_path / "a")
    write_gguf(model, tokenizer, tmp_path / "a.gguf", "f32")
    out = tmp_path / "out"
    merge({"merge_method": "linear", "models": [{"model": str(tmp_path / "a.gguf"), "parameters": {"weight": 1.0}},
                                                {"model": str(tmp_path / "b"), "parameters": {"weight": 1.0}}],
           "tokenizer_source": str(tmp_path / "b")}, out, gguf="q8_0")
    a, b, m = state(tmp_path / "a"), state(tmp_path / "b"), state(out)
    name = "model.layers.0.self_attn.k_proj.weight"  # llama.cpp permutes q/k rows; the reader undoes it
    assert torch.allclose(m[name], (a[name] + b[name]) / 2, atol=1e-6)
    assert "model.layers.0.self_attn.q_proj.weight" in read_gguf(out / "model-q8_0.gguf").tensor_names()


def test_dry_run_checks_without_writing(models, tmp_path, capsys):
    from entrenar.cli.main import main

    cfg = tmp_path / "m.yaml"
    cfg.write_text(f"merge_method: ties\nbase_model: {models['base']}\nmodels:\n"
                   f"  - model: {models['a']}\n    parameters: {{weight: 1, density: 0.5}}\n")
    assert main(["merge", str(cfg), "--output", str(tmp_path / "o"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "merge_method: ties" in text and "model.embed_tokens.weight [16, 64]" in text
    assert not (tmp_path / "o").exists()
    cfg.write_text(f"merge_method: ties\nbase_model: {models['base']}\nmodels:\n  - model: {models['a']}\n")
    assert main(["merge", str(cfg), "--output", str(tmp_path / "o")]) == 2
    assert "needs the parameter 'weight'" in capsys.readouterr().err


def test_different_vocabularies_are_refused_then_handled_by_union(models, tmp_path):
    import tokenizers

    from entrenar.merge.run import plan_merge

    big = make_hf_model("llama", seed=5, vocab_size=18)  # the quickstart's 16 tokens + 2 added
    big.save_pretrained(tmp_path / "big")
    backend = tokenizers.Tokenizer.from_file(str(models["a"] / "tokenizer.json"))
    backend.add_tokens([tokenizers.AddedToken("<tool>", special=True), tokenizers.AddedToken("xyz")])
    backend.save(str(tmp_path / "big" / "tokenizer.json"))
    cfg = {"merge_method": "task_arithmetic", "base_model": str(models["base"]),
           "models": [{"model": str(tmp_path / "big"), "parameters": {"weight": 1.0}},
                      {"model": str(models["a"]), "parameters": {"weight": 1.0}}]}
    with pytest.raises(ModelError,
                       match=r"model.embed_tokens.weight has different shapes: .*\[18, 64\].*tokenizer_source"):
        plan_merge(cfg)

    out = tmp_path / "union"
    merge({**cfg, "tokenizer_source": "union"}, out)
    m, base, a, b = state(out), state(models["base"]), state(models["a"]), big.state_dict()
    e = "model.embed_tokens.weight"
    assert m[e].shape == (18, 64)
    # shared tokens: base + both deltas; the added tokens: only "big" has them -> its rows (the base row is absent,
    # so the base and "a" take the mean of those who have them, i.e. big's row: deltas big-big, big-big = 0 ... )
    assert torch.allclose(m[e][:16], base[e] + (b[e][:16] - base[e]) + (a[e] - base[e]), atol=1e-6)
    assert torch.allclose(m[e][16:], b[e][16:], atol=1e-6)
    merged_tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert merged_tok.token_to_id("<tool>") == 16 and merged_tok.token_to_id("xyz") == 17
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 18


def test_refuses_an_output_that_is_an_input(models):
    with pytest.raises(ConfigError, match="output"):
        merge({"merge_method": "linear", "models": [{"model": str(models["a"]), "parameters": {"weight": 1}}]},
              models["a"])


BLOCK_CASES = {
    "linear": {},
    "task_arithmetic": {},
    "ties": {"density": 0.4},
    "dare_ties": {"density": 0.6},
    "dare_linear": {"density": 0.5, "rescale_norm": "l2"},
    "dare_linear_inverse": {"density": 0.5, "rescale_norm": "inverse_density"},
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_row_blocks_give_the_same_bits_as_whole_tensors(models, tmp_path, monkeypatch, case):
    """Blockwise (two passes for TIES / DARE) against the whole-tensor functions, bit for bit."""
    from entrenar.merge import blockwise

    method = case.removesuffix("_inverse")
    extra = dict(BLOCK_CASES[case])
    norm = extra.pop("rescale_norm", None)
    cfg = {"merge_method": method, "base_model": str(models["base"]), "parameters": {"normalize": True},
           "models": [{"model": str(models["a"]), "parameters": {"weight": 0.4, **extra}},
                      {"model": str(models["b"]), "parameters": {"weight": 0.7, **extra}}]}
    if norm:
        cfg["parameters"]["rescale_norm"] = norm
    if method == "linear":
        cfg["models"].append({"model": str(models["base"]), "parameters": {"weight": 0.1}})
    monkeypatch.setattr(blockwise, "STREAMED", ())
    merge(cfg, tmp_path / "whole", seed=3)
    monkeypatch.undo()
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 3 * 64)  # three rows of a 64-wide tensor per block
    monkeypatch.setattr(blockwise, "SAMPLE_ELEMENTS", 64)  # small enough that the magnitude cut is bracketed
    assert blockwise.row_spans(7, 64)[-1] == (3, 7)  # never a block of one row
    calls = []
    real = blockwise.merge_blocks
    monkeypatch.setattr(blockwise, "merge_blocks", lambda *a: calls.append(a[0].name) or real(*a))
    merge(cfg, tmp_path / "blocks", seed=3)
    assert len(calls) > 10
    whole, blocks = state(tmp_path / "whole"), state(tmp_path / "blocks")
    assert all(torch.equal(whole[n], blocks[n]) for n in whole)


def test_a_missed_magnitude_bracket_falls_back_to_the_whole_tensor(models, tmp_path, monkeypatch):
    from entrenar.merge import blockwise

    cfg = {"merge_method": "ties", "base_model": str(models["base"]),
           "models": [{"model": str(models["a"]), "parameters": {"weight": 1.0, "density": 0.3}}]}
    merge(cfg, tmp_path / "right")
    monkeypatch.setattr(blockwise, "_bracket", lambda *a: (100.0, 200.0))  # above every |delta|: misses
    merge(cfg, tmp_path / "missed")
    right, missed = state(tmp_path / "right"), state(tmp_path / "missed")
    assert all(torch.equal(right[n], missed[n]) for n in right)


def test_different_architectures_are_refused_before_reading_weights(models, tmp_path):
    from entrenar.merge.run import plan_merge

    make_hf_model("llama", intermediate_size=96).save_pretrained(tmp_path / "narrow")
    config = json.loads((models["a"] / "config.json").read_text())
    config.pop("head_dim", None)  # left out: the default hidden/heads is compared, not a refusal
    (models["a"] / "config.json").write_text(json.dumps(config))
    plan_merge({"merge_method": "linear", "models": [{"model": str(models["a"]), "parameters": {"weight": 1}},
                                                    {"model": str(models["b"]), "parameters": {"weight": 1}}]})
    with pytest.raises(ModelError, match="differ in intermediate_size"):
        plan_merge({"merge_method": "linear",
                    "models": [{"model": str(models["a"]), "parameters": {"weight": 1}},
                               {"model": str(tmp_path / "narrow"), "parameters": {"weight": 1}}]})


def test_mapped_row_views_equal_plain_reads(tmp_path):
    from safetensors.torch import save_file

    from entrenar.merge.stream import SafetensorsFile

    torch.manual_seed(0)
    tensors = {"a": torch.randn(7, 5).to(torch.bfloat16), "b": torch.randn(300, 33), "c": torch.randn(3)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    for name, rows in (("a", (0, 7)), ("a", (2, 5)), ("b", (0, 1)), ("b", (299, 300)), ("b", (17, 250)), ("c", (0, 1))):
        view = f.view_rows(name, *rows)
        assert bytes(view) == f.read_rows(name, *rows).reshape(-1).view(torch.uint8).numpy().tobytes(), (name, rows)
    del view
    f.close()


def test_merge_progress_in_a_log_is_whole_lines(models, tmp_path, capsys):
    """stderr is no terminal here (as in a log file or CI): progress comes as newline-ended lines, no ``\\r``."""
    from entrenar.cli.main import main

    cfg = tmp_path / "m.yaml"
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {models['a']}\n    parameters: {{weight: 1}}\n"
                   f"  - model: {models['b']}\n    parameters: {{weight: 1}}\n")
    assert main(["merge", str(cfg), "--output", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("merged ")]
    assert "\r" not in err and 2 <= len(lines) <= 11
    total = lines[-1].split()[1].split("/")[1]
    assert lines[-1] == f"merged {total}/{total} tensors"
