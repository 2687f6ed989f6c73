"""YaRN and dynamic NTK RoPE against transformers: inverse frequencies, attention factor, and a Llama's logits."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_logits_and_gradients, check_packed_equals_documents, save_family

from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig, rope_inv_freq
from entrenar.models.hf import load_hf

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
        "beta_slow": 2.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def reference(config_kwargs: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, **config_kwargs)
    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)


def ours(config_kwargs: dict) -> ModelConfig:
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, **config_kwargs}
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize("extra", [{}, {"truncate": False}, {"attention_factor": 0.7},
                                   {"mscale": 1.0, "mscale_all_dim": 0.5}, {"beta_fast": None, "beta_slow": None}])
def test_yarn_frequencies_and_attention_factor_equal_transformers(extra):
    from entrenar.models.rope_scaling import rope_attention_scaling

    kwargs = {"rope_scaling": {**YARN, **extra}, "max_position_embeddings": 64, "rope_theta": 5000.0}
    inv_freq, factor = reference(kwargs)
    config = ours(kwargs)
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, atol=0, rtol=1e-6)
    assert rope_attention_scaling(config) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("seq_len", [None, 20, 32, 77])
def test_dynamic_frequencies_equal_transformers(seq_len):
    kwargs = {"rope_scaling": DYNAMIC, "max_position_embeddings": 32}
    inv_freq, factor = reference(kwargs, seq_len)
    assert factor == 1.0
    torch.testing.assert_close(rope_inv_freq(ours(kwargs), seq_len), inv_freq, atol=0, rtol=1e-6)


@pytest.mark.parametrize("scaling", [YARN, DYNAMIC], ids=["yarn", "dynamic"])
def test_llama_with_scaled_rope_matches_transformers(tmp_path, scaling):
    # 48 positions: past yarn's original 16 and dynamic's max_position_embeddings 32, so the scaling acts.
    folder, ref = save_family(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM", rope_scaling=dict(scaling),
                              max_position_embeddings=32, attention_bias=True)
    check_logits_and_gradients(folder, ref, t=48)
    lengths = (7, 40, 5) if scaling is DYNAMIC else (7, 30, 19)
    check_packed_equals_documents(load_hf(folder).eval(), lengths=lengths)


def test_dynamic_grows_with_the_longest_position(tmp_path):
    """Dynamic NTK is not the unscaled RoPE past max_position_embeddings (the test above could not tell)."""
    from entrenar.models.hf import load_hf

    folder, _ = save_family(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM", rope_scaling=dict(DYNAMIC),
                            max_position_embeddings=32)
    model = load_hf(folder).eval()
    plain = load_hf(folder).eval()
    plain.config = plain.config.replace(rope_scaling=None)
    ids = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :32]), plain(ids[:, :32]), atol=0, rtol=0)
        assert (model(ids) - plain(ids)).abs().max() > 1e-3


@pytest.mark.parametrize("scaling, key", [({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
                                          ({"rope_type": "dynamic", "factor": -1.0}, "factor")])
def test_missing_or_bad_scaling_numbers_are_named(scaling, key):
    with pytest.raises(ModelError, match=rf"rope_scaling\.{key}"):
        ours({"rope_scaling": scaling})


def test_gguf_export_refuses_what_llama_cpp_would_rotate_otherwise(tmp_path):
    import sys
    from pathlib import Path

    from entrenar.export.gguf_write import write_gguf
    from entrenar.models.hf import load_hf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from tiny_chat_tokenizer import chat_tokenizer

    folder, _ = save_family(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM", rope_scaling=dict(YARN),
                            max_position_embeddings=64, vocab_size=320)
    with pytest.raises(ModelError, match="'yarn' RoPE scaling"):
        write_gguf(load_hf(folder), chat_tokenizer(), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()
