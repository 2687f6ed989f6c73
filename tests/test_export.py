"""entrenar.export: adapters PEFT loads, merged folders transformers loads, GGUF files llama.cpp's readers load.

The reference everywhere is entrenar's own base + adapter model (checked
against PEFT in test_lora_peft.py): every exported form must compute the same
logits, and every exported tokenizer the same ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import entrenar
from entrenar.adapters.lora import LoraConfig, apply_lora, lora_layers, save_adapter
from entrenar.errors import AdapterError, ConfigError, ModelError, QuantError
from entrenar.export import export
from entrenar.export.gguf_write import write_gguf
from entrenar.models.hf import load_hf

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from tiny_chat_tokenizer import CHATML, chat_tokenizer  # noqa: E402

VOCAB = 320  # >= the chat tokenizer's 300 tokens
TEXTS = [
    "The capital of France is Paris.",
    "<|im_start|>user\nWhat is the capital?<|im_end|>\n<|im_start|>assistant\n",
    "  spaces,\ttabs and ünïcödé 123",
]
GENERATION = {"eos_token_id": [1, 3], "temperature": 0.6, "top_p": 0.9}  # EOS and <|im_end|> both stop


def make_base(folder: Path, family: str = "llama", dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A tiny transformers model with the chat tokenizer and a generation config that lists two EOS ids."""
    from conftest import make_hf_model

    model = make_hf_model(family, **{"vocab_size": VOCAB, **overrides}).to(dtype)
    model.save_pretrained(folder)
    chat_tokenizer().save(folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


def make_adapter(base: Path, folder: Path, target_modules: str | list[str] = "all-linear") -> Path:
    """A LoRA adapter for ``base`` with nonzero B, so merging changes the logits."""
    model = load_hf(base)
    cfg = LoraConfig(r=4, alpha=8, target_modules=target_modules)
    apply_lora(model, cfg)
    torch.manual_seed(1)
    for _, layer in lora_layers(model):
        torch.nn.init.normal_(layer.lora_B.weight, std=0.05)
    return save_adapter(model, folder, cfg, base_model_name_or_path="tiny/base")


@pytest.fixture
def base(tmp_path):
    return make_base(tmp_path / "base")


@pytest.fixture
def adapter(base, tmp_path):
    return make_adapter(base, tmp_path / "adapter")


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(seed))


def reference_logits(base: Path, adapter: Path) -> torch.Tensor:
    model, _ = entrenar.load(base, adapter=adapter, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        return model(ids())


def transformers_logits(folder: Path, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(ids()).logits


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# -- adapter only -------------------------------------------------------------


def test_adapter_export_loads_in_peft_with_the_same_logits(base, adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    inputs = snapshot(base) | snapshot(adapter)
    out = tmp_path / "exported"
    assert export(base, adapter, out) == [out]

    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny/base"
    assert len(config["target_modules"]) == 14  # "all-linear" written out, as PEFT writes it
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids()).logits, reference_logits(base, adapter), atol=1e-5, rtol=0)
    assert snapshot(base) | snapshot(adapter) == inputs
    assert leftovers(tmp_path) == []


def test_adapter_export_keeps_the_stored_dtype_and_reads_only_the_base_config(base, adapter, tmp_path):
    weights = adapter / "adapter_model.safetensors"
    half = {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}
    save_file(half, weights)
    (base / "model.safetensors").unlink()  # the base's weights are not needed to check the adapter's shapes

    out = export(base, adapter, tmp_path / "exported")[0]
    saved = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == half.keys()
    assert all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], half[k]) for k in half)


def test_adapter_for_another_model_is_refused(base, tmp_path):
    other = make_adapter(make_base(tmp_path / "qwen3", "qwen3"), tmp_path / "qwen3-adapter")
    for merge in (False, True):
        with pytest.raises(AdapterError, match=r"qwen3-adapter.*'model.layers.0.self_attn.q_proj.lora_B.weight'"):
            export(base, other, tmp_path / "out", merge=merge)
    assert not (tmp_path / "out").exists()


def test_missing_adapter_is_named(base, tmp_path):
    with pytest.raises(AdapterError, match="nowhere: no such adapter folder"):
        export(base, tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(AdapterError, match="base: is not an adapter folder"):
        export(base, base, tmp_path / "out")
    with pytest.raises(ModelError, match="missing: no such model"):
        export(tmp_path / "missing", tmp_path / "nowhere", tmp_path / "out")


# -- merged -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_merged_folder_loads_in_transformers_with_the_same_logits_and_ids(tmp_path, family):
    from transformers import AutoTokenizer, GenerationConfig

    base = make_base(tmp_path / "base", family)
    adapter = make_adapter(base, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert export(base, adapter, out, merge=True) == [out]

    torch.testing.assert_close(transformers_logits(out), reference_logits(base, adapter), atol=1e-5, rtol=0)
    theirs, ours = AutoTokenizer.from_pretrained(out), chat_tokenizer()
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.temperature, generation.top_p) == ([1, 3], 0.6, 0.9)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model, tokenizer = entrenar.load(out, device="cpu")
    assert tokenizer.eos_ids == [1, 3] and tokenizer.chat_template == CHATML


def test_merge_keeps_the_base_dtype_with_one_rounding(tmp_path):
    base = make_base(tmp_path / "base", dtype=torch.bfloat16)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    out = export(base, adapter, tmp_path / "merged", merge=True)[0]

    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    merged = load_file(out / "model.safetensors")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    name = "model.layers.1.self_attn.q_proj.weight"
    lora = load_file(adapter / "adapter_model.safetensors")
    a, b = (lora[f"base_model.model.{name[:-7]}.lora_{x}.weight"] for x in "AB")
    expected = (load_file(base / "model.safetensors")[name].float() + b @ a * 2.0).to(torch.bfloat16)
    assert torch.equal(merged[name], expected)


@pytest.mark.parametrize("qtype, atol", [("f16", 1e-2), ("q8_0", 5e-2)])
def test_merged_gguf_runs_like_the_merged_model(base, adapter, tmp_path, qtype, atol):
    out = tmp_path / "merged"
    gguf_path = out / f"model-{qtype}.gguf"
    assert export(base, adapter, out, merge=True, gguf=qtype) == [out, gguf_path]

    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.chat_template"].contents() == CHATML
    model, tokenizer = entrenar.load(gguf_path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), transformers_logits(out), atol=atol, rtol=0)
    assert [tokenizer.encode(t) for t in TEXTS] == [chat_tokenizer().encode(t) for t in TEXTS]
    assert tokenizer.eos_ids == [1, 3]
    if qtype == "f16":  # transformers' own GGUF loader reads the same model
        theirs = transformers_logits(out, gguf_file=gguf_path.name)
        torch.testing.assert_close(theirs, transformers_logits(out), atol=atol, rtol=0)


def test_output_ending_in_gguf_writes_only_that_file(base, adapter, tmp_path):
    out = tmp_path / "tiny-q8.gguf"
    assert export(base, adapter, out, merge=True, gguf="q8_0") == [out]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base", "tiny-q8.gguf"]
    # named after the base and the adapter (a folder named "adapter" by the folder it is in), not the output
    assert gguf.GGUFReader(out).fields["general.name"].contents() == f"base + {tmp_path.name}"


DESCRIBED = {"general.license": "apache-2.0", "general.organization": "TinyOrg", "general.basename": "tiny",
             "general.size_label": "1M", "general.finetune": "Instruct", "general.languages": ["en", "fr"],
             "general.tags": ["text-generation"]}  # fmt: skip


def test_gguf_export_carries_the_inputs_description_and_is_named_after_base_and_adapter(base, tmp_path):
    from gguf import GGUFWriter

    # A GGUF input as llama.cpp's converter writes one: its general.* keys, written here by gguf's own writer.
    model, tokenizer = entrenar.load(base, device="cpu")
    plain = write_gguf(model, tokenizer, tmp_path / "plain.gguf", "f16")
    source = tmp_path / "Tiny-1M-Instruct.gguf"
    reader = gguf.GGUFReader(plain)
    writer = GGUFWriter(source, "llama")
    writer.add_name("Tiny 1M Instruct")
    for key, value in DESCRIBED.items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_string(key, value)
    for key, f in reader.fields.items():
        if not key.startswith(("general.", "GGUF.")):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_shape=tuple(int(x) for x in reversed(t.shape)),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    adapter = make_adapter(base, tmp_path / "my-run" / "adapter")
    out = tmp_path / "export-q8_0"
    export(source, adapter, out, gguf="q8_0")
    fields = gguf.GGUFReader(out / "model-q8_0.gguf").fields
    assert fields["general.name"].contents() == "Tiny 1M Instruct + my-run"
    for key, value in DESCRIBED.items():
        assert fields[key].contents() == value, key
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0  # the writer's, not the input's


def test_gguf_export_of_a_hf_folder_takes_license_and_languages_from_its_model_card(base, adapter, tmp_path):
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "TinyOrg/Tiny-1M"}))
    (base / "README.md").write_text("---\nlicense: mit\nlanguage:\n- en\n- de\n---\n# Tiny\n")
    out = export(base, adapter, tmp_path / "x.gguf", gguf="f16")[0]
    fields = gguf.GGUFReader(out).fields
    assert fields["general.name"].contents() == f"Tiny-1M + {tmp_path.name}"
    assert fields["general.license"].contents() == "mit"
    assert fields["general.languages"].contents() == ["en", "de"]
    assert fields["general.organization"].contents() == "TinyOrg"


def test_gguf_base_is_dequantized_then_merged(base, adapter, tmp_path):
    model, tokenizer = entrenar.load(base, device="cpu")
    for qtype, dtype in (("f32", "float32"), ("q8_0", "float16")):
        gguf_base = write_gguf(model, tokenizer, tmp_path / f"base-{qtype}.gguf", qtype)
        out = tmp_path / f"merged-{qtype}"
        export(gguf_base, adapter, out, merge=True)
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        atol = 1e-5 if qtype == "f32" else 1e-2  # float16 weights for a quantized base
        torch.testing.assert_close(transformers_logits(out), reference_logits(gguf_base, adapter), atol=atol, rtol=0)
    # The adapter alone can be checked against a GGUF base too.
    assert (export(gguf_base, adapter, tmp_path / "adapter-again")[0] / "adapter_config.json").is_file()


def test_quantized_checkpoint_is_refused(base, adapter, tmp_path):
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"base/config.json: the checkpoint is quantized.*'bitsandbytes'"):
        export(base, adapter, tmp_path / "out", merge=True)


# -- options and paths ----------------------------------------------------------


def test_option_errors_are_raised_before_anything_is_read_or_written(base, adapter, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(QuantError, match="GGUF type 'q4_k' is not supported"):
        export(base, adapter, out, merge=True, gguf="q4_k")
    with pytest.raises(ConfigError, match="m.gguf: the output is a .gguf file but no GGUF type"):
        export(base, adapter, tmp_path / "m.gguf", merge=True)
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        export(base, adapter, out, merge=True, dtype="fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]


def test_gguf_implies_merge(base, adapter, tmp_path):
    out = tmp_path / "m.gguf"
    assert export(base, adapter, out, gguf="f32") == [out]  # no merge=True needed
    model, _ = entrenar.load(out, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), reference_logits(base, adapter), atol=1e-5, rtol=0)


def test_a_model_without_adapter_exports_in_its_own_dtype_or_the_one_asked(tmp_path):
    base = make_base(tmp_path / "bf16-base", dtype=torch.bfloat16)
    out = export(base, None, tmp_path / "as-is")[0]
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(load_file(out / "model.safetensors"), load_file(base / "model.safetensors"))
    out32 = export(base, None, tmp_path / "fp32", dtype="fp32", gguf="f32")
    assert out32 == [tmp_path / "fp32", tmp_path / "fp32" / "model-f32.gguf"]
    assert {t.dtype for t in load_file(out32[0] / "model.safetensors").values()} == {torch.float32}
    ours, _ = entrenar.load(base, device="cpu", dtype=torch.float32)
    theirs, _ = entrenar.load(out32[1], device="cpu", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids()), ours(ids()), atol=0, rtol=0)


def test_an_unwritable_output_fails_before_the_model_is_read(base, adapter, tmp_path, monkeypatch):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.setattr("entrenar.export.load_merged", lambda *a, **k: pytest.fail("the model was loaded"))
    try:
        with pytest.raises(PermissionError, match="cannot write in this folder"):
            export(base, adapter, locked / "out", merge=True)
    finally:
        locked.chmod(0o700)


def test_an_unwritable_output_fails_before_the_model_is_read_even_as_root(base, adapter, tmp_path, monkeypatch):
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))

    monkeypatch.setattr("entrenar.io.outputs.tempfile.mkstemp", read_only)
    monkeypatch.setattr("entrenar.export.load_merged", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(OSError, match="cannot write in this folder.*Read-only") as caught:
        export(base, adapter, tmp_path / "out", merge=True)
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(tmp_path)


def test_export_never_writes_over_its_inputs(base, adapter, tmp_path):
    inputs = snapshot(tmp_path)
    for out, message in (
        (base, "the output is the base model"),
        (adapter, "the output is the adapter"),
        (tmp_path, "the output contains the base model"),
    ):
        for merge in (False, True):
            with pytest.raises(ConfigError, match=message):
                export(base, adapter, out, merge=merge)
    assert snapshot(tmp_path) == inputs


def test_an_existing_output_needs_overwrite_and_keeps_the_users_files(base, adapter, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="notes: the folder exists and is not empty; pass overwrite=True to"):
        export(base, adapter, notes, merge=True)
    assert snapshot(notes) == {"todo.txt": b"keep me"}

    out = tmp_path / "out"
    export(base, adapter, out, merge=True)
    (out / "README.md").write_text("my notes about this model")
    (out / "model-00001-of-00002.safetensors").write_text("a shard of an older, sharded export")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export(base, adapter, out)
    export(base, adapter, out, overwrite=True)  # another kind of output replaces ours, never the user's files
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert (out / "README.md").read_text() == "my notes about this model"
    export(base, adapter, out, merge=True, overwrite=True)
    assert (out / "README.md").read_text() == "my notes about this model"
    torch.testing.assert_close(transformers_logits(out), reference_logits(base, adapter), atol=1e-5, rtol=0)

    gguf_file = tmp_path / "m.gguf"
    export(base, adapter, gguf_file, gguf="f16")
    with pytest.raises(ConfigError, match="m.gguf: the file exists; pass overwrite=True to replace it"):
        export(base, adapter, gguf_file, gguf="f16")
    assert export(base, adapter, gguf_file, gguf="f16", overwrite=True) == [gguf_file]


def test_failed_export_leaves_the_previous_output(base, adapter, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(base, adapter, out, merge=True)
    before = snapshot(out)

    def broken_save(self, folder):
        raise OSError("disk full")

    monkeypatch.setattr("entrenar.data.tokenizer.Tokenizer.save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export(base, adapter, out, merge=True, gguf="f16", overwrite=True)
    assert snapshot(out) == before
    assert leftovers(tmp_path) == []
