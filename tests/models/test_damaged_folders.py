"""Damaged model folders: every way a config.json or an index can be wrong is a ModelError naming the file and
the key, never a TypeError, a RecursionError or an allocation of absurd size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import entrenar
from entrenar.errors import EntrenarError, ModelError
from entrenar.models.config import ModelConfig
from entrenar.models.hf import save_hf
from entrenar.models.transformer import Transformer


@pytest.fixture
def folder(tmp_path) -> Path:
    """A tiny native model folder (no tokenizer: what save_pretrained of a model alone writes)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1))
    model.reset_parameters()
    return save_hf(model, tmp_path / "model")


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"rms_norm_eps": "abc"}, r"config\.json: 'rms_norm_eps' must be a positive finite number, got 'abc'"),
        ({"rope_theta": None, "rope_parameters": None},
         r"config\.json: 'rope_theta' must be a positive finite number, got None"),
        ({"vocab_size": 10**12}, r"config\.json: 'vocab_size' must be at most 4,194,304"),
        ({"vocab_size": 4_000_000, "hidden_size": 4096}, r"config\.json describes a model of [\d,]+ parameters but "
                                                          r"its weights hold [\d,]+ values"),
        ({"hidden_size": 16.0}, r"'hidden_size' must be a positive integer, got 16\.0"),
        ({"rms_norm_eps": 10**400}, r"'rms_norm_eps' must be a positive finite number, got 1000"),
        ({"num_hidden_layers": True}, r"'num_hidden_layers' must be a positive integer, got True"),
        ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings' must be true or false"),
        ({"rope_scaling": [1, 2]}, r"'rope_scaling' must be an object or null"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "x"}, "rope_parameters": None},
         r"'rope_scaling\.factor' must be a positive"),
        ({"rope_parameters": {"rope_theta": "1e4"}}, r"'rope_parameters\.rope_theta' must be a positive"),
        ({"eos_token_id": "</s>"}, r"'eos_token_id' must be a token id"),
        ({"max_position_embeddings": -1}, r"'max_position_embeddings' must be a positive integer"),
        ({"num_key_value_heads": 3}, r"config\.json: num_attention_heads \(2\) must be a multiple of"),
        ({"hidden_act": ["silu"]}, r"hidden_act \['silu'\] is not supported"),
    ],
)
def test_a_bad_value_names_the_file_and_the_key(folder, changes, message):
    edit_config(folder, **changes)
    with pytest.raises(ModelError, match=message):
        entrenar.load(folder, device="cpu")


@pytest.mark.parametrize(
    "text,message",
    [
        ("[1, 2]", r"config\.json: expected a JSON object, got a list"),
        ("{not json", r"config\.json line 1: invalid JSON"),
        ("[" * 100_000 + "]" * 100_000, r"config\.json: JSON nested too deeply"),
        (b"\xff\xfe{}", r"config\.json: not UTF-8 text"),
        ('{"vocab_size": ' + "9" * 5000 + "}", r"config\.json: invalid JSON: Exceeds the limit"),
    ],
)
def test_a_config_that_is_not_an_object_is_named(folder, text, message):
    path = folder / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ModelError, match=message):
        entrenar.load(folder, device="cpu")
    with pytest.raises(ModelError, match=message):
        entrenar.read_model_config(folder)


def shard(folder: Path) -> None:
    """Turn the folder's single file into a one-shard index, as large models are saved."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(folder / "model-00001-of-00001.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "weight_map,message",
    [
        (["model-00001-of-00001.safetensors"], r"index\.json: 'weight_map' must be an object"),
        ({"a": 3}, r"index\.json: 'weight_map' names 3, not a file name"),
        ({"a": "../model-00001-of-00001.safetensors"}, r"'weight_map' names '\.\./model-0000"),
        ({"a": "missing.safetensors"}, r"weight file missing\.safetensors named in model\.safetensors\.index\.json "
                                       r"is missing"),
    ],
)
def test_a_damaged_index_is_named(folder, weight_map, message):
    shard(folder)
    entrenar.load(folder, device="cpu")  # the sharded folder loads as it is
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match=message):
        entrenar.load(folder, device="cpu")


def mutations(config: dict, rng: random.Random) -> list[dict]:
    """Configs with one value replaced by a value of another type or an extreme of the same."""
    odd_values = [None, True, False, -1, 0, 1, 2, 3, 7, 10**6, 10**12, 2**63, -(10**9), 1.5, 1e-30, 1e308,
                  float("nan"), float("inf"), "", "abc", "16", [], [1], {}, {"a": 1}, [[[[]]]]]
    out = []
    for key in sorted(config):
        for value in rng.sample(odd_values, 6):
            out.append({**config, key: value})
    for value in odd_values:  # keys a config may lack
        for key in ("rope_scaling", "rope_parameters", "head_dim", "sliding_window", "use_sliding_window"):
            out.append({**config, key: value})
    return out


def test_mutated_configs_load_or_raise_a_model_error(folder):
    """Fuzz: each mutated config.json loads (and computes) or is refused with a ModelError, never anything else."""
    original = json.loads((folder / "config.json").read_text())
    outcomes = {"loaded": 0, "refused": 0}
    for config in mutations(original, random.Random(0)):
        (folder / "config.json").write_text(json.dumps(config))  # NaN/Infinity as Python's json writes them
        try:
            model, tokenizer = entrenar.load(folder, device="cpu")
        except EntrenarError as e:
            assert isinstance(e, ModelError), (config, e)
            assert str(folder / "config.json") in str(e) or str(folder) in str(e), e
            outcomes["refused"] += 1
            continue
        assert tokenizer is None
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        outcomes["loaded"] += 1
    assert outcomes["loaded"] > 20 and outcomes["refused"] > 100, outcomes


def test_a_folder_without_tokenizer_loads_with_none_and_text_commands_say_so(folder, capsys, tmp_path, monkeypatch):
    from entrenar.cli.main import main

    model, tokenizer = entrenar.load(folder, device="cpu")
    assert tokenizer is None and isinstance(model, Transformer)
    with monkeypatch.context() as patch:  # said before any weight is read
        patch.setattr(entrenar, "load", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main(["generate", str(folder), "--prompt", "hi"]) == 2
    assert "the model has no tokenizer" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    for argv in (["generate", folder, "--prompt", "hi"], ["eval", folder, "--data", data],
                 ["chat", folder]):
        assert main([str(a) for a in argv] + ["--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {folder}: the model has no tokenizer (no tokenizer.json in the folder); copy the " \
                      "tokenizer files of the model it came from into it\n"
    out = tmp_path / "exported"
    assert main(["export", str(folder), "--output", str(out), "--dtype", "bf16"]) == 0  # no text needed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert main(["export", str(folder), "--output", str(tmp_path / "m.gguf"), "--gguf", "f16"]) == 2
    assert "the model has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_damaged_tokenizer_files_are_named(tmp_path, name):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from tiny_chat_tokenizer import chat_tokenizer

    chat_tokenizer().save(tmp_path)
    (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
    from entrenar.data.tokenizer import Tokenizer

    with pytest.raises(ModelError, match=rf"{name}: invalid JSON"):
        Tokenizer.from_folder(tmp_path)
