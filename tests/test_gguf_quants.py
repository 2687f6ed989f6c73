"""k-quant encoders against ggml's reference bytes, and llama-quantize's per-tensor type rules.

tests/data/ggml_k_quants.npz holds rows and the bytes ggml's own
``quantize_row_q{4,5,6}_K_ref`` made of them (ggml-org/ggml d99724f, built
with ``cc -O2`` for x86-64, no fused multiply-add); the rows include an all-zero
super-block, all-positive and all-negative rows, integers and outliers. The
expected type maps below are written out by hand from ``llama_tensor_get_type``
and ``tensor_type_fallback`` (llama.cpp src/llama-quant.cpp).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import make_hf_model
from entrenar.errors import QuantError
from entrenar.export.gguf_quants import quantize_k, tensor_types
from entrenar.export.gguf_write import write_gguf
from entrenar.models.gguf import read_gguf
from entrenar.models.hf import load_hf

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from tiny_chat_tokenizer import chat_tokenizer  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "ggml_k_quants.npz"


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_byte_identical_to_ggml_reference(kind):
    ref = np.load(FIXTURE)
    x = ref["inputs"]
    ours = quantize_k(x, kind)
    assert ours.shape == ref[kind].shape
    assert np.array_equal(ours, ref[kind])
    # and the gguf package's dequantizer reads them back close to the input
    back = gguf.quants.dequantize(ours, Q[kind])
    bound = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03}[kind]
    for row, (a, b) in enumerate(zip(x, back, strict=True)):
        assert np.abs(a - b).max() <= bound * max(np.abs(a).max(), 1e-6) + 1e-6, (kind, row)


def test_k_quant_rows_must_split_into_super_blocks():
    with pytest.raises(QuantError, match="multiple of 256"):
        quantize_k(np.zeros((2, 288), np.float32), "Q6_K")


def _names(n_layers: int, hidden: int, ffn: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    out = [("token_embd.weight", (1000, hidden))]
    for i in range(n_layers):
        out += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_q.weight", (hidden, hidden)),
                (f"blk.{i}.attn_k.weight", (hidden // 2, hidden)), (f"blk.{i}.attn_v.weight", (hidden // 2, hidden)),
                (f"blk.{i}.attn_output.weight", (hidden, hidden)), (f"blk.{i}.ffn_gate.weight", (ffn, hidden)),
                (f"blk.{i}.ffn_up.weight", (ffn, hidden)), (f"blk.{i}.ffn_down.weight", (hidden, ffn))]  # fmt: skip
    out.append(("output_norm.weight", (hidden,)))
    if not tied:
        out.append(("output.weight", (1000, hidden)))
    return out


def _by_role(types: dict[str, str], n_layers: int) -> dict[str, object]:
    roles = {"embd": types["token_embd.weight"], "output": types.get("output.weight")}
    for role in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        roles[role] = [types[f"blk.{i}.{role}.weight"] for i in range(n_layers)]
    return roles


# llama.cpp's _M mixes give attn_v and ffn_down more bits on layers i < n/8, i >= 7n/8, (i - n/8) % 3 == 2:
# for 8 layers that is 0, 3, 6, 7.
MORE = [True, False, False, True, False, False, True, True]


def test_q4_0_keeps_the_output_matrix_at_q6_k_and_an_untied_embedding_at_q4_0():
    roles = _by_role(tensor_types("q4_0", _names(8, 256, 512, tied=False)), 8)
    assert roles["output"] == "Q6_K" and roles["embd"] == "Q4_0"
    assert all(roles[r] == ["Q4_0"] * 8 for r in ("attn_q", "attn_v", "ffn_down", "ffn_up"))
    assert "blk.0.attn_norm.weight" not in tensor_types("q4_0", _names(8, 256, 512, tied=False))


def test_a_tied_embedding_is_the_output_matrix():
    assert _by_role(tensor_types("q4_0", _names(8, 256, 512, tied=True)), 8)["embd"] == "Q6_K"
    assert _by_role(tensor_types("q4_1", _names(8, 256, 512, tied=True)), 8)["embd"] == "Q6_K"
    assert _by_role(tensor_types("q8_0", _names(8, 256, 512, tied=True)), 8)["embd"] == "Q8_0"
    assert _by_role(tensor_types("f16", _names(8, 256, 512, tied=True)), 8)["embd"] == "F16"


@pytest.mark.parametrize("file_type, base", [("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K")])
def test_m_mixes_raise_attn_v_and_ffn_down_on_some_layers(file_type, base):
    roles = _by_role(tensor_types(file_type, _names(8, 256, 512, tied=False)), 8)
    more = ["Q6_K" if m else base for m in MORE]
    assert roles["attn_v"] == more and roles["ffn_down"] == more
    assert roles["attn_q"] == [base] * 8 and roles["ffn_up"] == [base] * 8 and roles["attn_output"] == [base] * 8
    assert roles["output"] == "Q6_K" and roles["embd"] == base


def test_rows_not_a_multiple_of_256_fall_back_like_llama_quantize():
    # SmolLM2-135M's shapes: hidden 576 (2.25 x 256), ffn 1536 (6 x 256), 30 layers, tied.
    names = _names(30, 576, 1536, tied=True)
    q4 = _by_role(tensor_types("q4_0", names), 30)
    assert q4["embd"] == "Q8_0" and q4["attn_q"] == ["Q4_0"] * 30  # Q6_K output -> Q8_0
    km = _by_role(tensor_types("q4_k_m", names), 30)
    assert km["embd"] == "Q8_0" and km["attn_q"] == ["Q5_0"] * 30 and km["ffn_up"] == ["Q5_0"] * 30
    n8 = 30 // 8
    more = [i < n8 or i >= 7 * 30 // 8 or (i - n8) % 3 == 2 for i in range(30)]
    assert km["attn_v"] == ["Q8_0" if m else "Q5_0" for m in more]  # Q6_K and Q4_K both fall back
    assert km["ffn_down"] == ["Q6_K" if m else "Q4_K" for m in more]  # 1536 columns: real k-quants
    q5 = _by_role(tensor_types("q5_k_m", names), 30)
    assert q5["attn_q"] == ["Q5_1"] * 30 and q5["ffn_down"] == ["Q6_K" if m else "Q5_K" for m in more]
    q6 = _by_role(tensor_types("q6_k", names), 30)
    assert q6["attn_q"] == ["Q8_0"] * 30 and q6["ffn_down"] == ["Q6_K"] * 30
    # rows that split into no block at all stay F16
    assert tensor_types("q4_k_m", [("blk.0.ffn_down.weight", (8, 80))]) == {"blk.0.ffn_down.weight": "F16"}


def test_q4_k_m_file_reads_back_through_gguf(tmp_path):
    hf = make_hf_model("llama", vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf").eval()
    path = write_gguf(model, chat_tokenizer(), tmp_path / "m.gguf", "q4_k_m")
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert raw["token_embd.weight"].tensor_type == Q.Q6_K  # tied: the output matrix's type
    assert raw["blk.1.attn_v.weight"].tensor_type == Q.Q6_K  # of 2 layers, the last (>= 7n/8) gets more bits
    assert raw["blk.0.attn_v.weight"].tensor_type == Q.Q4_K
    assert raw["blk.0.attn_q.weight"].tensor_type == Q.Q4_K
    assert raw["blk.0.attn_norm.weight"].tensor_type == Q.F32
    embd = model.state_dict()["model.embed_tokens.weight"]
    reference = gguf.quants.dequantize(np.array(raw["token_embd.weight"].data), Q.Q6_K)
    assert np.abs(reference - embd.numpy()).max() < 0.05 * embd.abs().max().item()
    g = read_gguf(path)
    assert torch.equal(g.tensor("model.embed_tokens.weight"), torch.from_numpy(reference.copy()))
