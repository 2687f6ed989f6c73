"""SmolLM3 against transformers: no RoPE on the layers no_rope_layers marks, sliding layers when it asks for them."""

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

SMOLLM3 = dict(num_hidden_layers=4, tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture
def smollm3(tmp_path):
    return save_family(tmp_path / "smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", **SMOLLM3)


def test_logits_and_gradients_match_transformers(smollm3):
    folder, ref = smollm3
    model = load_hf(folder)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, True, True, False]
    check_logits_and_gradients(folder, ref)
    check_padded_batch(load_hf(folder).eval(), ref, lengths=(40, 23))


def test_nope_layer_matters(smollm3):
    """The fourth layer really runs without RoPE: turning it on there changes the logits."""
    folder, _ = smollm3
    model = load_hf(folder).eval()
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        before = model(ids)
        model.model.layers[3].self_attn.use_rope = True
        assert (model(ids) - before).abs().max() > 1e-4


def test_sliding_layers_and_tied_embeddings(tmp_path):
    folder, ref = save_family(tmp_path / "s", "SmolLM3Config", "SmolLM3ForCausalLM", num_hidden_layers=4,
                              use_sliding_window=True, sliding_window=8, tie_word_embeddings=True)
    assert ref.config.layer_types.count("sliding_attention") == 1  # transformers slides the NoPE layers only
    check_logits_and_gradients(folder, ref, t=40)
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(7, 30, 19))


def test_packed_and_saved(smollm3, tmp_path):
    folder, ref = smollm3
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(7, 30, 19))
    check_save_round_trip(folder, ref, tmp_path / "saved")


def test_lora_qlora_and_inspect(smollm3, tmp_path, capsys):
    folder, ref = smollm3
    check_lora_step_matches_peft(folder, ref, ["q_proj", "v_proj", "down_proj"])
    check_qlora_base(folder)
    check_inspect(capsys, folder, ref)


def test_gguf_as_llama_cpp_writes_it(tmp_path):
    """A SmolLM3 GGUF (q/k rows permuted as the converter's LlamaModel does; NoPE every fourth layer, which
    llama.cpp fixes and the file does not say) loads with transformers' logits."""
    import entrenar
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer, write_gguf

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab = tokenizer.get_vocab_size() + 15  # the rest [PADn] tokens, as in real files
    _, ref = save_family(tmp_path / "s", "SmolLM3Config", "SmolLM3ForCausalLM", **SMOLLM3, vocab_size=vocab)
    path = write_gguf(tmp_path / "smollm3.gguf", ref, vocab=byte_level_vocab(tokenizer, vocab),
                      special_ids={"bos": 1, "eos": 2})
    model, _ = entrenar.load(path, device="cpu")
    assert model.config.model_type == "smollm3" and model.config.no_rope_layers == (1, 1, 1, 0)
    ids = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_kernels_leave_the_nope_layers_unturned(smollm3):
    """apply_kernels (the fused block, RoPE, SwiGLU, LoRA layers) on SmolLM3 gives the plain model's logits."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import FusedBlock, apply_kernels

    folder, _ = smollm3
    models = []
    for fused in (False, True):
        model = load_hf(folder).eval()
        torch.manual_seed(7)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        if fused:
            apply_kernels(model)
            assert isinstance(model.model.layers[3], FusedBlock)
        models.append(model)
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(models[1](ids), models[0](ids), atol=1e-5, rtol=0)


def test_written_as_gguf_and_read_back(tmp_path):
    """``entrenar export --gguf`` of SmolLM3: the file (q/k permuted as for llama) loads with the model's logits;
    a NoPE pattern llama.cpp would not follow is refused."""
    import sys
    from pathlib import Path

    import entrenar
    from entrenar.errors import ModelError
    from entrenar.export.gguf_write import write_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from tiny_chat_tokenizer import chat_tokenizer

    folder, _ = save_family(tmp_path / "s", "SmolLM3Config", "SmolLM3ForCausalLM", **SMOLLM3, vocab_size=320)
    model = load_hf(folder).eval()
    path = write_gguf(model, chat_tokenizer(), tmp_path / "s.gguf", "f32")
    back, _ = entrenar.load(path, device="cpu")
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=1e-5, rtol=0)
    model.config = model.config.replace(no_rope_layers=(1, 1, 0, 1))
    with pytest.raises(ModelError, match="every fourth layer"):
        write_gguf(model, chat_tokenizer(), tmp_path / "t.gguf", "f32")
