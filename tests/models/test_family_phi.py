"""Phi-3 / Phi-4 against transformers and peft: fused qkv_proj and gate_up_proj kept as the checkpoint's modules,
longrope RoPE (short and long factors) and partial rotary."""

from __future__ import annotations

import copy

import pytest
import torch
from family_checks import (
    check_adapters_cross_load,
    check_dry_run_notes,
    check_gguf_export_round_trip,
    check_gguf_load,
    check_inspect,
    check_kernels_keep_logits,
    check_logits,
    check_lora_step_matches_peft,
    check_packed_equals_documents,
    check_padded_batch,
    check_qlora_base,
    check_save_round_trip,
    make_checkpoint,
)

import entrenar
from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig
from entrenar.models.hf import load_hf

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# head_dim 16, half of it rotated: 4 factors each; the original context (16) is shorter than the long test rows.
LONGROPE = dict(max_position_embeddings=64, original_max_position_embeddings=16, partial_rotary_factor=0.5,
                rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.9],
                              "long_factor": [2.0, 3.5, 5.0, 9.0]})
TARGETS = ["qkv_proj", "gate_up_proj"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3") / "model", "Phi3Config", "Phi3ForCausalLM", **SHAPE)


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3lr") / "model", "Phi3Config", "Phi3ForCausalLM",
                           **SHAPE, **LONGROPE)


def test_fused_projections_are_the_checkpoints_modules(phi3):
    folder, ref = phi3
    model = load_hf(folder)
    ours = {n for n, _ in model.named_parameters()}
    assert ours == {n for n, _ in ref.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in ours and "model.layers.0.mlp.gate_up_proj.weight" in ours


def test_logits_match_transformers(phi3):
    folder, ref = phi3
    model = load_hf(folder).eval()
    check_logits(model, ref, 12)
    check_padded_batch(model, ref)


@pytest.mark.parametrize("seq_len", [12, 40], ids=["short-factors", "long-factors"])
def test_longrope_and_partial_rotary_match_transformers(phi3_longrope, seq_len):
    """Up to original_max_position_embeddings (16) the short factors, beyond it the long ones, and cos/sin
    scaled by the attention factor; half of each head's dims rotated."""
    folder, ref = phi3_longrope
    model = load_hf(folder).eval()
    assert model.config.partial_rotary_factor == 0.5 and model.config.rope_scaling["rope_type"] == "longrope"
    check_logits(model, ref, seq_len)


def test_sliding_window_matches_transformers(tmp_path):
    """Phi-3-mini's sliding window, on rows longer than it (padded and not)."""
    folder, ref = make_checkpoint(tmp_path / "model", "Phi3Config", "Phi3ForCausalLM", **SHAPE, sliding_window=6)
    model = load_hf(folder).eval()
    assert model.config.sliding_window == 6
    check_logits(model, ref, 20)
    check_padded_batch(model, ref, lengths=(17, 11))


def test_longrope_factors_matter(phi3_longrope):
    """The long factors are read: swapping them for the short ones changes long rows (the test can fail)."""
    folder, ref = phi3_longrope
    model = load_hf(folder).eval()
    scaling = dict(model.config.rope_scaling, long_factor=model.config.rope_scaling["short_factor"])
    model.config = model.config.replace(rope_scaling=scaling)
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max() > 1e-3


def test_padded_and_packed_rows(phi3_longrope):
    folder, ref = phi3_longrope
    model = load_hf(folder).eval()
    check_padded_batch(model, ref, lengths=(13, 7))
    check_packed_equals_documents(model, lengths=(7, 9))


def test_save_in_phi3_layout(phi3_longrope, tmp_path):
    folder, ref = phi3_longrope
    check_save_round_trip(folder, ref, tmp_path / "saved")


def test_lora_step_on_fused_projections_matches_peft(phi3):
    folder, ref = phi3
    check_lora_step_matches_peft(folder, ref, TARGETS)


def test_adapters_load_both_ways(phi3, tmp_path):
    folder, ref = phi3
    check_adapters_cross_load(folder, ref, TARGETS, tmp_path)


def test_qlora_base_quantizes_the_fused_projections(phi3):
    check_qlora_base(phi3[0])


def test_kernels_cover_the_fused_projections(phi3):
    check_kernels_keep_logits(phi3[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernels_on_fused_halves_and_partial_rotary(phi3_longrope):
    """Triton's RoPE on the rotated dims only and SwiGLU on the (strided) halves of gate_up_proj."""
    check_kernels_keep_logits(phi3_longrope[0], device="cuda", atol=1e-4)


def test_inspect_estimates_name_the_fused_projections(phi3):
    from entrenar.loading import read_model_config
    from entrenar.train.memory import lora_params

    folder, ref = phi3
    config = read_model_config(folder)
    peft = pytest.importorskip("peft")
    every = TARGETS + ["o_proj", "down_proj"]
    theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, target_modules=every))
    assert lora_params(config, 4, "all-linear") == sum(p.numel() for n, p in theirs.named_parameters() if "lora_" in n)
    with pytest.raises(entrenar.errors.ConfigError, match="qkv_proj"):
        lora_params(config, 4, ["q_proj"])


def test_bad_longrope_factors_are_named():
    hf = {"model_type": "phi3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
          "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8}}
    with pytest.raises(ModelError, match="short_factor.*3 factors"):
        ModelConfig.from_hf(hf)
    hf["rope_scaling"] = {"type": "longrope", "short_factor": "x", "long_factor": [2.0] * 8}
    with pytest.raises(ModelError, match="config.json: 'rope_scaling.short_factor'"):
        ModelConfig.from_hf(hf)


def test_gguf_as_llama_cpp_writes_phi3_loads_with_transformers_logits(tmp_path):
    """llama.cpp's phi3 layout: fused attn_qkv and ffn_up, rope.dimension_count for the rotated dims, longrope as
    rope_factors_long/short tensors with the original context and attention factor in the metadata."""
    import math

    import numpy as np
    from gguf import GGMLQuantizationType as Q

    scaling = LONGROPE["rope_scaling"]
    orig, context = LONGROPE["original_max_position_embeddings"], LONGROPE["max_position_embeddings"]
    extra_kv = {"rope.dimension_count": ("uint32", 8), "rope.scaling.original_context_length": ("uint32", orig),
                "rope.scaling.attn_factor": ("float32", math.sqrt(1 + math.log(context / orig) / math.log(orig))),
                "attention.sliding_window": ("uint32", 0)}
    raw = {f"rope_factors_{kind}.weight": (np.array(scaling[f"{kind}_factor"], dtype=np.float32), Q.F32)
           for kind in ("long", "short")}
    model, tokenizer = check_gguf_load(tmp_path, "Phi3Config", "Phi3ForCausalLM", {**SHAPE, **LONGROPE}, extra_kv, raw,
                            seq_len=40)
    assert model.config.fused_qkv and model.config.rope_scaling["rope_type"] == "longrope"
    check_gguf_export_round_trip(model, tokenizer, tmp_path)


def test_dry_run_says_what_the_kernels_do(phi3, tmp_path):
    check_dry_run_notes(phi3[0], tmp_path, "fused qkv_proj/gate_up_proj")


def test_the_recipes_default_targets_adapt_qkv_proj_and_o_proj(phi3, tmp_path):
    """A recipe without target_modules adapts the attention projections: on Phi-3, qkv_proj and o_proj (the names
    q_proj/k_proj/v_proj do not exist there), written so that peft loads the adapter with equal logits."""
    import json

    peft = pytest.importorskip("peft")
    from entrenar.adapters.lora import apply_lora, lora_config_of, save_adapter
    from entrenar.config.sections import LoraSection

    folder, ref = phi3
    model = load_hf(folder).eval()
    cfg = lora_config_of(LoraSection())
    names = apply_lora(model, cfg)
    assert {name.rsplit(".", 1)[-1] for name in names} == {"qkv_proj", "o_proj"}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    save_adapter(model, tmp_path / "adapter", cfg)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == [
        "qkv_proj", "o_proj"]
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(ref), tmp_path / "adapter").eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, atol=1e-4, rtol=0)


def test_inspect_counts_parameters_as_transformers_and_peft(phi3, capsys):
    check_inspect(capsys, phi3[0], phi3[1], ["qkv_proj", "gate_up_proj"])


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_classifier_matches_transformers(tmp_path, left):
    """Phi3ForSequenceClassification: the fused backbone under a classification head, padded rows."""
    import transformers
    from family_checks import perturb

    from entrenar.models.classifier import load_classifier_folder

    torch.manual_seed(0)
    ref = transformers.Phi3ForSequenceClassification(transformers.Phi3Config(
        vocab_size=128, num_labels=3, **{**SHAPE, **LONGROPE})).eval()
    perturb(ref)
    ref.save_pretrained(tmp_path)
    ours = load_classifier_folder(tmp_path, torch.float32, "cpu").eval()
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    pad = slice(0, 8) if left else slice(12, 20)
    ids[1, pad], mask[1, pad] = 0, 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, mask), ref(input_ids=ids, attention_mask=mask).logits, atol=1e-4, rtol=0)
