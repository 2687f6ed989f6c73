"""GLM-4 (Glm4ForCausalLM) against transformers: partial interleaved RoPE, post-attention and post-MLP norms,
the fused gate_up_proj, q/k/v biases without an o_proj bias."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    check_inspect,
    check_logits_and_gradients,
    check_lora_step_matches_peft,
    check_packed_equals_documents,
    check_padded_batch,
    check_qlora_base,
    check_save_round_trip,
    save_family,
)

from entrenar.models.hf import load_hf


@pytest.fixture
def glm4(tmp_path):
    return save_family(tmp_path / "glm4", "Glm4Config", "Glm4ForCausalLM", head_dim=32)


def test_logits_and_gradients_match_transformers(glm4):
    folder, ref = glm4
    model = load_hf(folder)
    assert model.config.rotary_dim == 16 and model.config.rope_interleave
    check_logits_and_gradients(folder, ref)
    check_padded_batch(load_hf(folder).eval(), ref, lengths=(40, 23))


def test_yarn_on_a_partial_rotary(tmp_path):
    folder, ref = save_family(tmp_path / "g", "Glm4Config", "Glm4ForCausalLM", head_dim=32,
                              max_position_embeddings=64,
                              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5})
    check_logits_and_gradients(folder, ref)


def test_packed_and_saved(glm4, tmp_path):
    folder, ref = glm4
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(7, 30, 19))
    check_save_round_trip(folder, ref, tmp_path / "saved")


def test_lora_on_fused_projections_qlora_and_inspect(glm4, tmp_path, capsys):
    folder, ref = glm4
    check_lora_step_matches_peft(folder, ref, ["q_proj", "gate_up_proj", "down_proj"])
    check_qlora_base(folder)
    check_inspect(capsys, folder, ref)


def test_kernels_keep_the_post_norms(glm4):
    """apply_kernels leaves GLM-4's blocks their own forward (the fused block has no post norms)."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import apply_kernels

    folder, _ = glm4
    plain, fused = load_hf(folder).eval(), load_hf(folder).eval()
    for model in (plain, fused):
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    apply_kernels(fused)
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=0)


def test_gguf_as_llama_cpp_writes_it(tmp_path):
    """A GLM-4 GGUF (rope.dimension_count the rotated half, ffn_up the fused gate_up_proj, post_attention_norm
    and post_ffw_norm the norms after attention and MLP) loads with transformers' logits."""
    import entrenar
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer, write_gguf

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab = tokenizer.get_vocab_size() + 15  # the rest [PADn] tokens, as in real files
    _, ref = save_family(tmp_path / "g", "Glm4Config", "Glm4ForCausalLM", head_dim=32, vocab_size=vocab)
    path = write_gguf(tmp_path / "glm4.gguf", ref, vocab=byte_level_vocab(tokenizer, vocab),
                      special_ids={"bos": 1, "eos": 2}, extra_kv={"rope.dimension_count": ("uint32", 16)})
    model, _ = entrenar.load(path, device="cpu")
    assert model.config.model_type == "glm4" and model.config.rotary_dim == 16
    ids = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_rope_on_the_rotated_part_gives_the_plain_logits(glm4):
    """On CUDA the fused RoPE kernel turns GLM-4's rotated half (moved to half-split pairs first)."""
    from entrenar.kernels import apply_kernels

    folder, _ = glm4
    plain = load_hf(folder, dtype=torch.bfloat16, device="cuda").eval()
    fused = load_hf(folder, dtype=torch.bfloat16, device="cuda").eval()
    apply_kernels(fused)
    ids = torch.randint(0, 128, (2, 40), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).float(), plain(ids).float(), atol=2e-2, rtol=2e-2)


def test_written_as_gguf_and_read_back(tmp_path):
    """``entrenar export --gguf`` of GLM-4 (rotated part, fused ffn_up, post norms): it loads with the model's
    logits, and gguf's own name map agrees with the names written."""
    import sys
    from pathlib import Path

    import gguf

    import entrenar
    from entrenar.export.gguf_write import write_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from tiny_chat_tokenizer import chat_tokenizer

    folder, _ = save_family(tmp_path / "g", "Glm4Config", "Glm4ForCausalLM", head_dim=32, vocab_size=320)
    model = load_hf(folder).eval()
    path = write_gguf(model, chat_tokenizer(), tmp_path / "g.gguf", "f32")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4, 2)
    expected = {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in model.state_dict()}
    assert {t.name for t in gguf.GGUFReader(path).tensors} == expected
    back, _ = entrenar.load(path, device="cpu")
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=1e-5, rtol=0)


def test_whole_head_rotary_survives_a_save(tmp_path):
    """A GLM-4 config that rotates the whole head (partial_rotary_factor 1) is written with its factor: transformers'
    Glm4Config (and entrenar's reader) would otherwise fall back to the family's default of half the head."""
    import transformers

    from entrenar.models.config import ModelConfig

    config = ModelConfig.from_hf({**transformers.Glm4Config(head_dim=32, partial_rotary_factor=1.0).to_dict()})
    assert config.rotary_dim == 32
    saved = config.to_hf()
    assert ModelConfig.from_hf(saved).rotary_dim == 32
    assert transformers.Glm4Config(**saved).rope_parameters["partial_rotary_factor"] == 1.0
