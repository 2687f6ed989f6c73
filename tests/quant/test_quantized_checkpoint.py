"""Quantized model folders: every layout round-trips to the same modules and logits; damaged folders and bad
settings are errors naming the tensor and file (or layer and key); PTQ of a folder never touches its input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import entrenar
from entrenar import quickstart
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.errors import ConfigError, ModelError, QuantError
from entrenar.evaluation.loss import evaluate_file
from entrenar.export.quantize import parse_method, quantize_model, quantize_pretrained
from entrenar.models.config import ModelConfig
from entrenar.models.hf import save_hf
from entrenar.models.transformer import Transformer
from entrenar.quant.checkpoint import load_quantized, quantization_config, save_quantized
from entrenar.quant.int import QuantLinear, quantize_model_int
from entrenar.quant.nf4.format import NF4Linear, quantize_model_nf4
from entrenar.quant.qat import QATConfig, convert_qat, prepare_qat

LAYER = "model.layers.0.mlp.up_proj"  # in_features 64, out_features 128


def tiny_model(seed: int = 0, **config) -> Transformer:
    torch.manual_seed(seed)
    base = dict(vocab_size=quickstart.build_tokenizer().vocab_size, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, model_type="llama")
    model = Transformer(ModelConfig(**{**base, **config}))
    model.reset_parameters()
    return model.eval()


def qat_converted(model: Transformer, cfg: QATConfig) -> None:
    """Fake-quantize, take a few steps (so LSQ steps and activation steps move), convert to integers."""
    prepare_qat(model, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step()
    convert_qat(model)


LAYOUTS = {
    "nf4": lambda m: quantize_model_nf4(m),
    "nf4-fp32-absmax-128": lambda m: quantize_model_nf4(m, blocksize=128, double_quant=False),
    "int8-channel": lambda m: quantize_model_int(m, bits=8),
    "int4-group32-asymmetric-percentile": lambda m: quantize_model_int(
        m, bits=4, group_size=32, symmetric=False, calibration="percentile", percentile=99.0),
    "int3-group16": lambda m: quantize_model_int(m, bits=3, group_size=16),
    "int6-channel-asymmetric": lambda m: quantize_model_int(m, bits=6, symmetric=False),
    "qat-int4-tensor-lsq-static-act8": lambda m: qat_converted(
        m, QATConfig(bits=4, granularity="tensor", backward="lsq", act_bits=8)),
    "qat-int2-group16-ste-dynamic-act6": lambda m: qat_converted(
        m, QATConfig(bits=2, granularity="group", group_size=16, backward="ste", act_bits=6)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", [{}, {"tie_word_embeddings": True, "qkv_bias": True, "o_bias": True,
                                         "mlp_bias": True}], ids=["llama", "tied-bias"])
def test_every_layout_loads_back_into_the_same_modules_with_identical_logits(tmp_path, layout, family):
    model = tiny_model(**family)
    LAYOUTS[layout](model)
    tokenizer = quickstart.build_tokenizer()
    save_quantized(model, tokenizer, tmp_path / "q", info={"note": "test"})

    loaded, loaded_tokenizer = entrenar.load(tmp_path / "q", device="cpu")
    assert loaded_tokenizer.encode("1+2=3") == tokenizer.encode("1+2=3")
    saved_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert saved_state.keys() == loaded_state.keys()
    for key, tensor in saved_state.items():
        assert loaded_state[key].dtype == tensor.dtype and torch.equal(loaded_state[key], tensor), key
    for name, module in model.named_modules():
        assert type(loaded.get_submodule(name)) is type(module), name
    assert isinstance(loaded.lm_head, nn.Linear)  # the output head is never quantized
    if family:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_config_json_describes_the_layers(tmp_path):
    model = tiny_model()
    quantize_model_int(model, bits=4, group_size=32, symmetric=False)
    save_quantized(model, quickstart.build_tokenizer(), tmp_path / "q", info={"source": "ptq"})
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 64
    entry = config["quantization_config"]
    assert entry == {
        "quant_method": "entrenar", "format_version": 1, "method": "int", "bits": 4, "symmetric": False,
        "granularity": "group", "group_size": 32, "activation_bits": None, "activation_scale": None,
        "modules": [f"model.layers.{i}.{p}" for i in range(2) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],
        "source": "ptq",
    }
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    assert tensors[f"{LAYER}.weight_codes"].shape == (128, 32) and tensors[f"{LAYER}.weight_codes"].dtype == torch.uint8
    scale = tensors[f"{LAYER}.weight_scale"]
    assert scale.shape == (128, 2) and scale.dtype == torch.float32
    assert tensors[f"{LAYER}.weight_zero"].shape == (128, 2)
    assert f"{LAYER}.weight" not in tensors and "lm_head.weight" in tensors
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    assert entrenar.read_model_config(tmp_path / "q").hidden_size == 64


def test_a_quantized_folder_loads_in_bfloat16_with_fp32_scales(tmp_path, monkeypatch):
    model = tiny_model()
    quantize_model_int(model, bits=8)
    save_quantized(model, None, tmp_path / "q")
    quickstart.build_tokenizer().save(tmp_path / "q")
    allocated: list[torch.dtype] = []  # what leaves the meta device: the unquantized weights already in bf16
    to_empty = nn.Module.to_empty

    def spy(module, *args, **kwargs):
        allocated.extend(p.dtype for p in module.parameters() if p.is_meta)
        return to_empty(module, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to_empty", spy)
    loaded, _ = entrenar.load(tmp_path / "q", dtype="bfloat16", device="cpu")
    assert allocated and set(allocated) == {torch.bfloat16}
    layer = loaded.get_submodule(LAYER)
    assert layer.weight_scale.dtype == torch.float32 and loaded.lm_head.weight.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.bfloat16
    reference = copy.deepcopy(model).to(torch.bfloat16)
    reference.inv_freq = model.inv_freq  # loading keeps the RoPE frequencies in fp32, whatever the weights' dtype
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), reference(ids))
    with pytest.raises(QuantError, match=r"already quantized; load it without quantize='nf4'"):
        entrenar.load(tmp_path / "q", quantize="nf4", device="cpu")


# ---------------------------------------------------------------- damaged folders


@pytest.fixture
def int3_folder(tmp_path):
    model = tiny_model()
    quantize_model_int(model, bits=3, group_size=16)
    return save_quantized(model, quickstart.build_tokenizer(), tmp_path / "q")


def rewrite_tensors(folder, edit) -> str:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return str(path)


def rewrite_entry(folder, **changes) -> str:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))
    return str(path)


def test_a_codes_tensor_of_the_wrong_length_names_tensor_and_file(int3_folder):
    def truncate(t):
        t[f"{LAYER}.weight_codes"] = t[f"{LAYER}.weight_codes"][:, :-1].contiguous()

    path = rewrite_tensors(int3_folder, truncate)
    with pytest.raises(QuantError, match=rf"^{path}: tensor '{LAYER}\.weight_codes' has shape \(128, 23\), "
                                         r"expected \(128, 24\)$"):
        load_quantized(int3_folder)


def test_a_missing_scale_names_tensor_and_file(int3_folder):
    rewrite_tensors(int3_folder, lambda t: t.pop(f"{LAYER}.weight_scale"))
    with pytest.raises(QuantError, match=rf"tensor '{LAYER}\.weight_scale' is missing from model\.safetensors$"):
        load_quantized(int3_folder)


@pytest.mark.parametrize(
    "buffer,value,message",
    [
        ("weight_scale", float("nan"), "holds a scale that is not a finite positive number"),
        ("weight_scale", -1.0, "holds a scale that is not a finite positive number"),
        # (3-bit codes are stored at their width since format 2: every bit pattern is a code of the grid)
    ],
)
def test_values_no_quantizer_writes_are_refused(int3_folder, buffer, value, message):
    def poison(t):
        t[f"{LAYER}.{buffer}"][0, 0] = value

    path = rewrite_tensors(int3_folder, poison)
    with pytest.raises(QuantError, match=rf"^{path}: tensor '{LAYER}\.{buffer}' {message}$"):
        load_quantized(int3_folder)


def test_wrong_dtype_and_foreign_tensors_are_named(int3_folder):
    def as_float(t):
        t[f"{LAYER}.weight_codes"] = t[f"{LAYER}.weight_codes"].float()

    path = rewrite_tensors(int3_folder, as_float)
    with pytest.raises(QuantError, match=rf"^{path}: tensor '{LAYER}\.weight_codes' has dtype torch.float32, "
                                         r"expected torch.uint8$"):
        load_quantized(int3_folder)

    def unquantized_weight(t):
        t[f"{LAYER}.weight_codes"] = t[f"{LAYER}.weight_codes"].to(torch.uint8)
        t[f"{LAYER}.weight"] = torch.zeros(128, 64)

    rewrite_tensors(int3_folder, unquantized_weight)
    with pytest.raises(QuantError, match=rf"tensor '{LAYER}\.weight' does not belong to this model \(int, 3 bits"):
        load_quantized(int3_folder)

    def bad_embedding(t):
        t.pop(f"{LAYER}.weight")
        t["model.embed_tokens.weight"] = torch.zeros(3, 64)

    rewrite_tensors(int3_folder, bad_embedding)
    with pytest.raises(ModelError, match=r"tensor 'model\.embed_tokens\.weight' has shape \(3, 64\)"):
        load_quantized(int3_folder)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"bits": 9}, r"quantization_config\.bits must be an integer in \[2, 8\], got 9"),
        ({"granularity": "row"}, r"quantization_config\.granularity must be one of"),
        ({"format_version": 3}, r"quantization_config\.format_version must be one of \(1, 2\)"),
        ({"modules": []}, r"quantization_config\.modules must be a non-empty list"),
        ({"group_size": 24}, r"quantization_config\.modules: model\.layers\.0\.self_attn\.q_proj: group_size 24 "
                             r"does not divide in_features 64"),
        ({"modules": ["model.layers.0.mlp.up_prj"]},
         r"quantization_config\.modules: 'model\.layers\.0\.mlp\.up_prj' is not a module of this llama model"),
        ({"modules": ["model.layers.0.mlp"]},
         r"quantization_config\.modules: 'model\.layers\.0\.mlp' is a MLP, not a linear layer"),
        ({"method": "gptq"}, r"quantization_config\.method must be 'int' or 'nf4', got 'gptq'"),
    ],
)
def test_a_bad_quantization_config_names_the_key(int3_folder, changes, message):
    path = rewrite_entry(int3_folder, **changes)
    with pytest.raises(QuantError, match=rf"^{path}: {message}"):
        entrenar.load(int3_folder, device="cpu")


# ---------------------------------------------------------------- refusals when quantizing and saving


def test_quantizing_refuses_bad_settings_naming_the_layer():
    with pytest.raises(QuantError, match=r"^int9: unsupported bit width 9; integer quantization supports 2 to 8"):
        parse_method("int9")
    with pytest.raises(QuantError, match=r"unknown quantization method 'fp4'"):
        parse_method("fp4")
    model = tiny_model()
    with pytest.raises(QuantError, match=r"^group size 48 does not divide the input width of .* e\.g\. "
                                         r"model\.layers\.0\.self_attn\.q_proj \(64\)"):
        quantize_model(model, "int4", group_size=48)
    assert isinstance(model.get_submodule(LAYER), nn.Linear)  # nothing swapped
    with pytest.raises(QuantError, match="nf4 scales each block by its absolute maximum"):
        quantize_model(model, "nf4", symmetric=False)
    with torch.no_grad():
        model.get_submodule(LAYER).weight[3, 5] = float("inf")
    with pytest.raises(QuantError, match=rf"^{LAYER}\.weight: tensor of shape \(128, 64\) has 1 NaN/inf value"):
        quantize_model(model, "int8")
    with pytest.raises(QuantError, match=rf"^{LAYER}\.weight: weight of shape \(128, 64\) has 1 NaN/inf value"):
        quantize_model(model, "nf4")


def test_a_layer_one_group_wide_is_a_group_layer(tmp_path):
    """At group size 64 the 64-wide projections have one scale per row: the folder still says group 64."""
    model = tiny_model()
    quantize_model_int(model, bits=4, group_size=64)
    entry = quantization_config(model)
    assert (entry["granularity"], entry["group_size"]) == ("group", 64)
    reloaded = tiny_model()
    quantize_model_int(reloaded, patterns=["q_proj"], bits=4)  # per channel, 64 wide: group 64 when told so
    assert quantization_config(reloaded, group_size=64)["granularity"] == "group"
    assert quantization_config(reloaded)["granularity"] == "channel"


def test_saving_refuses_what_a_folder_cannot_describe(tmp_path):
    with pytest.raises(QuantError, match="has no quantized layers to save"):
        quantization_config(tiny_model())
    mixed = tiny_model()
    quantize_model_int(mixed, patterns=["q_proj"], bits=8)
    quantize_model_int(mixed, patterns=["k_proj"], bits=4)
    with pytest.raises(QuantError, match=r"^model\.layers\.0\.self_attn\.k_proj: bits=4 but "
                                         r"model\.layers\.0\.self_attn\.q_proj has bits=8"):
        save_quantized(mixed, None, tmp_path / "mixed")
    with_adapter = tiny_model()
    quantize_model_int(with_adapter, bits=8)
    apply_lora(with_adapter, LoraConfig(r=2, alpha=4, target_modules=["q_proj"]))
    with pytest.raises(QuantError, match=r"self_attn\.q_proj: the model has LoRA layers"):
        save_quantized(with_adapter, None, tmp_path / "adapter")
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------- a whole folder


@pytest.fixture
def model_folder(tmp_path):
    model = tiny_model()
    save_hf(model, tmp_path / "model")
    quickstart.build_tokenizer().save(tmp_path / "model")
    with open(tmp_path / "valid.jsonl", "w") as f:
        for a in range(24):
            f.write(json.dumps({"text": f"{a}+{a % 5}={a + a % 5}"}) + "\n")
    return tmp_path / "model"


def test_quantize_pretrained_reports_true_errors_and_perplexities(model_folder, tmp_path):
    data = tmp_path / "valid.jsonl"
    result = quantize_pretrained(model_folder, tmp_path / "int4", "int4", group_size=32, data=data, device="cpu",
                                 seq_len=64)
    original, tokenizer = entrenar.load(model_folder, device="cpu")
    loaded, _ = entrenar.load(tmp_path / "int4", device="cpu")
    assert [e.name for e in result.layers] == result.config["modules"] and len(result.layers) == 14
    for e in result.layers:  # ||W - W_q||_F / ||W||_F and max |W - W_q| of what was written
        w, w_q = original.get_submodule(e.name).weight, loaded.get_submodule(e.name).weight
        assert e.rel_frobenius == pytest.approx(((w - w_q).norm() / w.norm()).item(), rel=1e-5)
        assert e.max_abs == pytest.approx((w - w_q).abs().max().item(), rel=1e-5)
        assert 0 < e.rel_frobenius < 0.2
    assert result.before.loss == evaluate_file(original, tokenizer, data, seq_len=64).loss
    assert result.after.loss == evaluate_file(loaded, tokenizer, data, seq_len=64).loss
    assert result.before.loss != result.after.loss
    n = sum(original.get_submodule(e.name).weight.numel() for e in result.layers)
    assert result.bytes_before == 4 * n  # fp32
    assert result.bytes_after == n // 2 + 4 * (n // 32)  # two 4-bit codes per byte, one fp32 scale per 32 weights


def test_quantize_pretrained_never_touches_its_input(model_folder, tmp_path):
    before = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    with pytest.raises(ConfigError, match="the output is the input model"):
        quantize_pretrained(model_folder, model_folder, "int8", device="cpu")
    with pytest.raises(ConfigError, match="the output contains the input model"):
        quantize_pretrained(model_folder, tmp_path, "int8", device="cpu")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="notes: the folder exists and is not empty; pass overwrite=True to"):
        quantize_pretrained(model_folder, tmp_path / "notes", "int8", device="cpu")
    with pytest.raises(QuantError, match="group size 48 does not divide"):
        quantize_pretrained(model_folder, tmp_path / "out", "int4", group_size=48, device="cpu")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    quantize_pretrained(model_folder, tmp_path / "out", "int8", device="cpu")
    with pytest.raises(QuantError, match="already quantized"):
        quantize_pretrained(tmp_path / "out", tmp_path / "again", "int4", device="cpu")
    with pytest.raises(ConfigError, match="out: the folder exists and is not empty"):
        quantize_pretrained(model_folder, tmp_path / "out", "nf4", device="cpu")
    quantize_pretrained(model_folder, tmp_path / "out", "nf4", device="cpu", overwrite=True)
    assert isinstance(entrenar.load(tmp_path / "out", device="cpu")[0].get_submodule(LAYER), NF4Linear)
    assert {p.name: p.read_bytes() for p in model_folder.iterdir()} == before
    assert not any(isinstance(m, QuantLinear) for m in entrenar.load(model_folder, device="cpu")[0].modules())
