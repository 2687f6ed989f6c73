"""OLMo 2 against transformers and peft: norms after attention and MLP (no norm before them), q/k norms over the
whole projection."""

from __future__ import annotations

import pytest
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

from entrenar.kernels import FusedBlock
from entrenar.models.hf import load_hf

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=True, pad_token_id=0, eos_token_id=2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("olmo2") / "model", "Olmo2Config", "Olmo2ForCausalLM", **SHAPE)


def test_modules_are_the_checkpoints(olmo2):
    folder, ref = olmo2
    model = load_hf(folder)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in ref.named_parameters()}
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)  # the whole projection's


def test_logits_match_transformers(olmo2):
    folder, ref = olmo2
    model = load_hf(folder).eval()
    check_logits(model, ref, 12)
    check_padded_batch(model, ref)
    check_packed_equals_documents(model)


def test_save_in_olmo2_layout(olmo2, tmp_path):
    folder, ref = olmo2
    check_save_round_trip(folder, ref, tmp_path / "saved")


def test_lora_step_matches_peft(olmo2):
    folder, ref = olmo2
    check_lora_step_matches_peft(folder, ref, TARGETS)


def test_adapters_load_both_ways(olmo2, tmp_path):
    folder, ref = olmo2
    check_adapters_cross_load(folder, ref, ["q_proj", "v_proj", "down_proj"], tmp_path)


def test_qlora_base(olmo2):
    check_qlora_base(olmo2[0])


def test_kernels_leave_post_norm_blocks_plain(olmo2):
    """No norm feeds OLMo 2's projections: the norm-in-projection block is not swapped in; the rest is."""
    from entrenar.kernels import apply_kernels

    model = load_hf(olmo2[0])
    changed = apply_kernels(model)
    assert changed and not any(isinstance(m, FusedBlock) for m in model.modules())
    check_kernels_keep_logits(olmo2[0])


def test_gguf_as_llama_cpp_writes_olmo2_loads_with_transformers_logits(tmp_path):
    """llama.cpp's olmo2 layout: post_attention_norm and post_ffw_norm, whole-projection attn_q_norm/attn_k_norm,
    q/k rows not permuted (NeoX RoPE)."""
    model, tokenizer = check_gguf_load(tmp_path, "Olmo2Config", "Olmo2ForCausalLM", SHAPE)
    assert model.config.post_norm
    check_gguf_export_round_trip(model, tokenizer, tmp_path)


def test_dry_run_says_what_the_kernels_do(olmo2, tmp_path):
    check_dry_run_notes(olmo2[0], tmp_path, "post-norm blocks: the norm-in-projection node stays off")


def test_inspect_counts_parameters_as_transformers_and_peft(olmo2, capsys):
    check_inspect(capsys, olmo2[0], olmo2[1], ["q_proj", "k_proj", "down_proj"])
