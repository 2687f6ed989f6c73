"""Adapters in PEFT's on-disk format: entrenar -> peft and peft -> entrenar give the same logits."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import conftest
from entrenar.adapters import lora
from entrenar.adapters.lora import (
    LoraConfig,
    apply_lora,
    load_adapter,
    lora_layers,
    save_adapter,
)
from entrenar.errors import AdapterError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7], [2, 4, 8, 16, 32, 64, 127, 0]])

CASES = {
    "names": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": False},
    "all-linear": {"r": 4, "alpha": 16, "target_modules": "all-linear", "use_rslora": False},
    "rslora": {"r": 8, "alpha": 4, "target_modules": ["k_proj", "o_proj", "down_proj"], "use_rslora": True},
}


def tiny_llama() -> nn.Module:
    return conftest.tiny_llama().eval()


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return tiny_llama()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def randomize_b(modules, seed: int = 1) -> None:
    """Give every lora_B weight random values (they start at zero, which would hide a wrong load)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in modules:
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)


def entrenar_adapted(base: nn.Module, cfg: LoraConfig) -> nn.Module:
    model = copy.deepcopy(base)
    apply_lora(model, cfg)
    randomize_b(layer.lora_B.weight for _, layer in lora_layers(model))
    assert not torch.allclose(logits(model), logits(base), atol=1e-3)
    return model


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_entrenar_adapter_loads_in_peft(base, case, tmp_path):
    cfg = LoraConfig(dropout=0.1, **CASES[case])
    model = entrenar_adapted(base, cfg)
    save_adapter(model, tmp_path, cfg, base_model_name_or_path="tiny-llama")

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message="Unexpected keyword arguments"
        )  # every field we write is one PEFT knows
        theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    torch.testing.assert_close(logits(theirs), logits(model), rtol=1e-5, atol=1e-5)

    config = theirs.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora) == (
        cfg.r,
        cfg.alpha,
        0.1,
        cfg.use_rslora,
    )
    assert config.base_model_name_or_path == "tiny-llama"


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_peft_adapter_loads_in_entrenar(base, case, tmp_path):
    c = CASES[case]
    peft_config = peft.LoraConfig(
        r=c["r"],
        lora_alpha=c["alpha"],
        target_modules=c["target_modules"],
        use_rslora=c["use_rslora"],
        lora_dropout=0.05,
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(copy.deepcopy(base), peft_config).eval()
    randomize_b(p for n, p in theirs.named_parameters() if "lora_B" in n)
    theirs.save_pretrained(tmp_path)

    ours = copy.deepcopy(base)
    cfg = load_adapter(ours, tmp_path)
    assert (cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora) == (c["r"], c["alpha"], 0.05, c["use_rslora"])
    expected = logits(theirs)
    assert not torch.allclose(expected, logits(base), atol=1e-3)
    torch.testing.assert_close(logits(ours), expected, rtol=1e-5, atol=1e-5)


def test_file_layout_is_peft_s(base, tmp_path):
    cfg = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    save_adapter(entrenar_adapted(base, cfg), tmp_path, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    keys = load_file(tmp_path / "adapter_model.safetensors").keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 14 and not any("default" in k or "lm_head" in k for k in keys)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["task_type"] == "CAUSAL_LM"
    # like PEFT, "all-linear" is written as the layers it resolved to
    assert len(saved["target_modules"]) == 14 and "model.layers.0.mlp.up_proj" in saved["target_modules"]


def test_save_load_round_trip_within_entrenar(base, tmp_path):
    cfg = LoraConfig(r=2, alpha=4, dropout=0.1, target_modules=r".*\.(q|v)_proj", use_rslora=True)
    model = entrenar_adapted(base, cfg)
    save_adapter(model, tmp_path, cfg)
    fresh = copy.deepcopy(base)
    assert load_adapter(fresh, tmp_path) == cfg
    torch.testing.assert_close(logits(fresh), logits(model), rtol=0, atol=0)


def test_save_refuses_a_config_that_does_not_describe_the_model(base, tmp_path):
    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj"])
    model = entrenar_adapted(base, cfg)
    with pytest.raises(AdapterError, match="r=4.*r=8"):
        save_adapter(model, tmp_path, LoraConfig(r=8, alpha=8, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match="does not describe"):
        save_adapter(model, tmp_path, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert not any(tmp_path.iterdir())


def test_failed_save_leaves_the_old_adapter(base, tmp_path, monkeypatch):
    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj"])
    old = entrenar_adapted(base, cfg)
    save_adapter(old, tmp_path, cfg)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    new = copy.deepcopy(base)
    apply_lora(new, cfg)  # zero B: a different adapter

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(lora, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(new, tmp_path, cfg)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files left either
    fresh = copy.deepcopy(base)
    load_adapter(fresh, tmp_path)
    torch.testing.assert_close(logits(fresh), logits(old), rtol=0, atol=0)


@pytest.fixture
def saved(base, tmp_path) -> Path:
    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    save_adapter(entrenar_adapted(base, cfg), tmp_path, cfg)
    return tmp_path


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def assert_load_fails(base: nn.Module, folder: Path, pattern: str) -> None:
    model = copy.deepcopy(base)
    with pytest.raises(AdapterError, match=pattern) as err:
        load_adapter(model, folder)
    assert str(folder) in str(err.value)
    assert not list(lora_layers(model))  # a failed load leaves the model untouched


def test_wrong_rank_names_tensor_and_shapes(base, saved):
    edit_config(saved, r=8)
    assert_load_fails(
        base, saved, r"'model.layers.0.self_attn.q_proj.lora_A.weight' has shape \[4, 64\], the model needs \[8, 64\]"
    )


def test_wrong_shape_from_another_model(base, saved):
    def widen(tensors):
        key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        tensors[key] = torch.zeros(64, 4)

    edit_tensors(saved, widen)
    assert_load_fails(base, saved, r"v_proj.lora_B.weight' has shape \[64, 4\], the model needs \[32, 4\]")


def test_missing_tensor(base, saved):
    edit_tensors(saved, lambda t: t.pop("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"))
    assert_load_fails(base, saved, r"missing tensor 'model.layers.1.self_attn.q_proj.lora_B.weight'")


def test_tensor_for_an_untargeted_module(base, saved):
    edit_tensors(saved, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}))
    assert_load_fails(base, saved, r"tensor 'lm_head.lora_A.weight' belongs to no LoRA layer")


def test_target_modules_absent_from_model(base, saved):
    edit_config(saved, target_modules=["query_key_value"])
    assert_load_fails(base, saved, r"\['query_key_value'\] match no linear layer")


def test_unsupported_variant_is_refused(base, saved):
    edit_config(saved, use_dora=True)
    assert_load_fails(base, saved, r"use_dora=True is not supported")


def test_not_a_lora_adapter(base, saved):
    edit_config(saved, peft_type="IA3")
    assert_load_fails(base, saved, r"peft_type is 'IA3'")


def test_broken_json_names_file_and_line(base, saved):
    (saved / "adapter_config.json").write_text('{\n  "r": 4,\n  "lora_alpha": 8,,\n}')
    assert_load_fails(base, saved, r"adapter_config.json:3:\d+: invalid JSON")


def test_missing_files(base, saved):
    (saved / "adapter_model.safetensors").rename(saved / "adapter_model.bin")
    assert_load_fails(base, saved, r"no adapter_model.safetensors \(adapter_model.bin is a pickle")
    (saved / "adapter_config.json").unlink()
    assert_load_fails(base, saved, r"no adapter_config.json")


def save_tiny_model_folder(model: nn.Module, folder: Path) -> None:
    """An HF model folder entrenar.load accepts: weights, config and a minimal word-level tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))


def test_native_model_adapter_loads_in_peft(tmp_path):
    """entrenar's own model has HF's module names, so its adapters load onto the HF model."""
    hf_io = pytest.importorskip("entrenar.models.hf")
    hf_model = tiny_llama()
    hf_model.save_pretrained(tmp_path / "base")
    ours = hf_io.load_hf(tmp_path / "base", dtype=torch.float32, device="cpu").eval()

    cfg = LoraConfig(r=4, alpha=8, target_modules="all-linear", use_rslora=True)
    hf_linears = [n for n, m in hf_model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert apply_lora(ours, cfg) == hf_linears
    randomize_b(layer.lora_B.weight for _, layer in lora_layers(ours))
    save_adapter(ours, tmp_path / "adapter", cfg)

    theirs = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    expected = logits(theirs)
    assert not torch.allclose(expected, logits(tiny_llama()), atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), expected, rtol=1e-4, atol=1e-4)


def test_peft_adapter_through_entrenar_load(base, tmp_path):
    """entrenar.load(folder, adapter=...) on the native model gives PEFT's logits."""
    entrenar = pytest.importorskip("entrenar")
    pytest.importorskip("entrenar.models.hf")
    save_tiny_model_folder(base, tmp_path / "base")
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], task_type="CAUSAL_LM")
    theirs = peft.get_peft_model(copy.deepcopy(base), peft_config).eval()
    randomize_b(p for n, p in theirs.named_parameters() if "lora_B" in n)
    theirs.save_pretrained(tmp_path / "adapter")

    ours, _ = entrenar.load(tmp_path / "base", adapter=tmp_path / "adapter", dtype="float32", device="cpu")
    assert len(list(lora_layers(ours))) == 4
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), logits(theirs), rtol=1e-4, atol=1e-4)


def test_peft_adapter_on_a_tied_head_works_unmerged_and_refuses_to_merge(tmp_path):
    """PEFT only warns about LoRA on a tied lm_head: its adapter runs unmerged, but merging would change the
    embeddings."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, tie_word_embeddings=True,
    )
    base = transformers.LlamaForCausalLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's warning about the tied target
        reference = peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"])
        ).eval()
    randomize_b(p for n, p in reference.named_parameters() if "lora_B" in n)
    reference.save_pretrained(tmp_path, save_embedding_layers=False)  # the adapter alone, not the base head

    model = copy.deepcopy(base)
    load_adapter(model, tmp_path)
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)
    embeddings = model.model.embed_tokens.weight.clone()
    tied = r"lm_head\.base_layer\.weight is tied to model\.embed_tokens\.weight.*use the adapter unmerged"
    with pytest.raises(AdapterError, match=tied):
        lora.merge_lora(model)
    assert not any(layer.merged for _, layer in lora_layers(model))  # nothing merged, not even q_proj
    assert torch.equal(model.model.embed_tokens.weight, embeddings)


def test_an_adapter_on_another_base_of_the_same_shapes_warns_naming_both(base, tmp_path, capsys):
    """PEFT writes the base it trained on into adapter_config.json; loading the adapter on another base of the
    same shapes (an instruct tune and its base model, say) warns once, naming both, and still loads it. The same
    base by another spelling (its Hub id beside the Hub cache's snapshot folder) is no mismatch."""
    import shutil

    entrenar = pytest.importorskip("entrenar")
    from entrenar.cli.main import main

    save_tiny_model_folder(base, tmp_path / "base")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft.get_peft_model(hf_base, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "ad")
    named = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(named) == tmp_path / "base"  # what PEFT records
    shutil.copytree(tmp_path / "base", tmp_path / "other")  # same shapes, another model

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the base it names: no warning
        entrenar.load(tmp_path / "base", adapter=tmp_path / "ad", device="cpu")
    with pytest.warns(UserWarning) as caught:
        ours, _ = entrenar.load(tmp_path / "other", adapter=tmp_path / "ad", device="cpu")
    assert len(list(lora_layers(ours))) == 2  # loaded all the same
    message = str(caught[0].message)
    assert f"trained on {named} " in message and f"applied to {tmp_path / 'other'}" in message

    # the CLI: one line
    code = main(["generate", str(tmp_path / "other"), "--adapter", str(tmp_path / "ad"), "--prompt", "w1 w2",
                 "--max-new-tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0 and [line for line in err.splitlines() if "trained on" in line] == [f"note: {message}"]

    # The Hub id of the same base, beside the Hub cache's snapshot folder of it: the same base.
    config = tmp_path / "ad" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "org/base"}))
    snapshot = tmp_path / "hub" / "models--org--base" / "snapshots" / "0123abc"
    shutil.copytree(tmp_path / "base", snapshot)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entrenar.load(snapshot, adapter=tmp_path / "ad", device="cpu")
