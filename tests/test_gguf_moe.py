"""GGUF MoE files (llama.cpp's stacked expert tensors) load with transformers' logits."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_model
from entrenar.models.gguf import load_gguf, read_gguf
from entrenar.models.moe import moe_blocks
from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer, write_moe_gguf


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_gguf_loads_with_transformers_logits(tmp_path, family):
    tokenizer = train_byte_level_tokenizer("smollm", vocab_size=300)
    vocab_size = tokenizer.get_vocab_size()
    overrides = {"qwen3_moe": {"decoder_sparse_step": 1, "norm_topk_prob": True}}.get(family, {})
    ref = make_hf_model(family, vocab_size=vocab_size, **overrides)
    path = write_moe_gguf(tmp_path / f"{family}.gguf", ref, vocab=byte_level_vocab(tokenizer, vocab_size))
    gguf_model = read_gguf(path)
    assert gguf_model.hf_config["model_type"] == family
    model, _ = load_gguf(path)
    assert len(moe_blocks(model)) == ref.config.num_hidden_layers
    ids = torch.randint(0, vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_missing_expert_tensor_is_named(tmp_path):
    from entrenar.errors import ModelError

    ref = make_hf_model("qwen3_moe", decoder_sparse_step=1, norm_topk_prob=True)
    path = write_moe_gguf(tmp_path / "m.gguf", ref, skip=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_up_exps\.weight"):
        read_gguf(path)
