"""GGUF writing: files that entrenar's reader, gguf's own reader and transformers read back as written.

The references are independent of the writer: tensor names from the gguf
package's HF -> GGUF name map, the q/k permutation from llama.cpp's converter
(tests/gguf_fixtures.py), Q8_0/Q4_0 blocks from ``gguf.quants``, and logits
of the model that was written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import entrenar
from conftest import make_hf_model
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError, QuantError
from entrenar.export.gguf_write import permute_rope_rows, tokenizer_metadata, write_gguf
from entrenar.models.config import ModelConfig
from entrenar.models.gguf import read_gguf, unpermute_rope_rows
from entrenar.models.hf import load_hf
from entrenar.quant.int import dequantize_q4_0, dequantize_q8_0, quantize_q4_0, quantize_q8_0
from gguf_fixtures import SAMPLE_TEXTS, permute, train_byte_level_tokenizer, train_sentencepiece_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from tiny_chat_tokenizer import BOS, CHATML, EOS, chat_backend, chat_tokenizer  # noqa: E402

VOCAB = 320  # the chat tokenizer has 300 tokens; ids 300-319 become [PADn] rows, as in real files
FAMILIES = {
    "llama": {},
    "llama3-scaled-tied-bias": {},
    "qwen2": {},
    "qwen3": {},
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}
CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "model_type",
)  # fmt: skip
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


@pytest.fixture
def native(tmp_path):
    """A native entrenar model of a family (loaded from a saved transformers model) and the chat tokenizer."""

    def build(family: str, **overrides):
        hf_family = "llama" if family == "llama-linear-rope" else family
        hf = make_hf_model(hf_family, **{"vocab_size": VOCAB, **FAMILIES.get(family, {}), **overrides})
        hf.save_pretrained(tmp_path / family)
        return load_hf(tmp_path / family).eval(), chat_tokenizer()

    return build


def logits(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


def raw_tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f16_file_reads_back_as_written(native, tmp_path, family):
    model, tok = native(family)
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f16", name="Tiny")
    g = read_gguf(path)

    state = {
        k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    assert g.tensor_names() == list(state)
    for name, tensor in state.items():
        stored = tensor if tensor.dim() == 1 else tensor.half()  # norms and biases stay F32
        assert g.quant_types()[name] == ("F32" if tensor.dim() == 1 else "F16"), name
        assert torch.equal(g.tensor(name), stored.float()), name

    ours = ModelConfig.from_hf(g.hf_config)
    assert {f: getattr(ours, f) for f in CONFIG_FIELDS} == {f: getattr(model.config, f) for f in CONFIG_FIELDS}
    loaded, _ = entrenar.load(path, device="cpu")
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-2, rtol=0)


def test_metadata_is_what_llama_cpp_reads(native, tmp_path):
    model, tok = native("qwen3")
    c = model.config
    fields = gguf.GGUFReader(write_gguf(model, tok, tmp_path / "m.gguf", "q8_0", name="Tiny")).fields
    expected = {
        "general.architecture": "qwen3",
        "general.name": "Tiny",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "qwen3.context_length": c.max_position_embeddings,
        "qwen3.embedding_length": 64,
        "qwen3.block_count": 2,
        "qwen3.feed_forward_length": 128,
        "qwen3.attention.head_count": 4,
        "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 32,  # != 64 / 4: the key llama.cpp needs for Qwen3
        "qwen3.attention.value_length": 32,
        "qwen3.rope.freq_base": pytest.approx(c.rope_theta),
        "qwen3.attention.layer_norm_rms_epsilon": pytest.approx(c.rms_norm_eps),
        "qwen3.vocab_size": VOCAB,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    assert {k: fields[k].contents() for k in expected} == expected


def test_tensor_names_follow_gguf_and_llama_q_k_rows_are_permuted(native, tmp_path):
    model, tok = native("llama3-scaled-tied-bias")  # llama, with q/k biases (permuted too) and rope_freqs
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f32")
    raw = raw_tensors(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    heads = {"q_proj": model.config.num_heads, "k_proj": model.config.num_kv_heads}
    expected = {"rope_freqs.weight"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp reads a missing output.weight as token_embd
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        expected.add(gguf_name)
        data = tensor.numpy()
        proj = name.split(".")[-2]
        if proj in heads:
            data = permute(data, heads[proj])  # the converter's permutation
            assert not np.array_equal(data, tensor.numpy())
        assert np.array_equal(np.array(raw[gguf_name].data).reshape(data.shape), data), name
    assert set(raw) == expected

    model, tok = native("qwen2")  # other architectures are stored as they are
    raw = raw_tensors(write_gguf(model, tok, tmp_path / "q.gguf", "f32"))
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"].numpy()
    assert np.array_equal(np.array(raw["blk.0.attn_k.weight"].data), k)


@pytest.mark.parametrize("n_head, rows, cols", [(4, 64, 32), (2, 32, None), (1, 4, 3)])
def test_permute_matches_the_converter_and_inverts_the_reader(n_head, rows, cols):
    w = torch.randn((rows, cols) if cols else (rows,))
    assert np.array_equal(permute_rope_rows(w, n_head).numpy(), permute(w.numpy(), n_head))
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, n_head), n_head), w)
    with pytest.raises(ModelError, match="not a multiple"):
        permute_rope_rows(torch.zeros(6, 2), 2)


@pytest.mark.parametrize(
    "qtype, kind, ours, our_inverse",
    [("q8_0", Q.Q8_0, quantize_q8_0, dequantize_q8_0), ("q4_0", Q.Q4_0, quantize_q4_0, dequantize_q4_0)],
)
def test_block_quantized_file(native, tmp_path, qtype, kind, ours, our_inverse):
    model, tok = native("llama")
    path = write_gguf(model, tok, tmp_path / "m.gguf", qtype)
    raw, g = raw_tensors(path), read_gguf(path)
    heads = {"q_proj": model.config.num_heads, "k_proj": model.config.num_kv_heads}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    roundtrip = {}
    output = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    for name, tensor in model.state_dict().items():
        t = raw[names.get_name(name, try_suffixes=(".weight",))]
        if tensor.dim() == 1:
            assert t.tensor_type == Q.F32, name
            continue
        if name == output:
            # llama-quantize's rule: the output matrix gets Q6_K, Q8_0 when rows (64 here) are not 256-blocks
            assert t.tensor_type == Q.Q8_0, name
            continue
        assert t.tensor_type == kind, name
        stored = tensor
        proj = name.split(".")[-2]
        if proj in heads:
            stored = torch.from_numpy(permute(tensor.numpy(), heads[proj]))
        data = np.array(t.data)
        assert np.array_equal(data, ours(stored)), name  # entrenar's quantizer, byte for byte
        assert np.array_equal(data, gguf.quants.quantize(stored.numpy(), kind)), name  # ggml's reference
        reference = torch.from_numpy(gguf.quants.dequantize(data, kind).copy())
        assert torch.equal(our_inverse(data), reference), name
        roundtrip[name] = unpermute_rope_rows(reference, heads[proj]) if proj in heads else reference
        assert torch.equal(g.tensor(name), roundtrip[name]), name

    # The file runs as the model with its weights replaced by their quantized values.
    loaded, _ = entrenar.load(path, device="cpu")
    with torch.no_grad():
        for name, w in roundtrip.items():
            model.get_parameter(name).copy_(w)
        raw_t = raw[names.get_name(output, try_suffixes=(".weight",))]
        model.get_parameter(output).copy_(torch.from_numpy(gguf.quants.dequantize(np.array(raw_t.data), Q.Q8_0)))
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-5, rtol=0)


def test_q8_0_logits_stay_close_to_the_float_model(native, tmp_path):
    model, tok = native("qwen2")
    loaded, _ = entrenar.load(write_gguf(model, tok, tmp_path / "m.gguf", "q8_0"), device="cpu")
    torch.testing.assert_close(logits(loaded), logits(model), atol=5e-2, rtol=0)


def test_rows_that_do_not_split_into_blocks_fall_back_to_f16(native, tmp_path):
    model, tok = native("llama", intermediate_size=80)  # down_proj rows of 80 values: not whole 32-blocks
    g = read_gguf(write_gguf(model, tok, tmp_path / "m.gguf", "q8_0"))
    assert g.quant_types()["model.layers.0.mlp.down_proj.weight"] == "F16"
    assert g.quant_types()["model.layers.0.mlp.up_proj.weight"] == "Q8_0"


def test_tokenizer_reads_back_with_the_same_ids(native, tmp_path):
    model, _ = native("qwen2")
    tok = Tokenizer(chat_backend(), bos_token="<|begin_of_text|>", eos_token=EOS, pad_token="<|im_end|>",
                    extra_eos_ids=[3, 2], chat_template={"default": CHATML, "tool_use": "{{ tools }}"})  # fmt: skip
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f16")
    back = read_gguf(path).tokenizer
    for text in [*SAMPLE_TEXTS, "<|im_start|>user\nWhat is the capital of France?<|im_end|>"]:
        for add in (True, False):
            assert back.encode(text, add) == tok.encode(text, add), text
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert (back.bos_id, back.eos_ids, back.pad_id) == (0, [1, 3, 2], 3)  # extra EOS ids as eot and eom
    assert back.chat_template == CHATML

    fields = gguf.GGUFReader(path).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert tokens[300:] == [f"[PAD{i}]" for i in range(300, VOCAB)] and set(types[300:]) == {gguf.TokenType.UNUSED}
    assert types[:4] == [gguf.TokenType.CONTROL] * 4 and types[100] == gguf.TokenType.NORMAL
    assert fields["tokenizer.chat_template.tool_use"].contents() == "{{ tools }}"


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizer_is_named_by_how_it_splits_text(pre):
    backend = train_byte_level_tokenizer(pre)
    tok = Tokenizer(backend, eos_token="<|endoftext|>")
    meta = tokenizer_metadata(tok, backend.get_vocab_size() + 5)
    assert meta["tokenizer.ggml.pre"] == pre


def test_transformers_loads_the_f16_file(native, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for family in ("llama", "qwen2"):
        model, tok = native(family)
        path = write_gguf(model, tok, tmp_path / f"{family}.gguf", "f16")
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
        ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, logits_of(model, ids), atol=1e-2, rtol=0)
        their_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        for text in SAMPLE_TEXTS[:4]:
            # Whether transformers' GGUF tokenizer adds BOS changed between releases; compare the text's own ids.
            theirs_ids = their_tok(text, add_special_tokens=False)["input_ids"]
            assert theirs_ids == tok.encode(text, add_special_tokens=False), text


# -- SentencePiece-style and character-level vocabularies ------------------------

SP_VOCAB = 440  # the SentencePiece tokenizer has 420 tokens; 420-439 become [PADn] rows


def plain_texts() -> list[str]:
    """SAMPLE_TEXTS without the chat tokens, which are no tokens of the SentencePiece vocabulary."""
    return [text for text in SAMPLE_TEXTS if "<|" not in text]


@pytest.mark.parametrize("dummy_prefix", [True, False], ids=["llama2-mistral", "gemma-no-prefix"])
def test_sentencepiece_tokenizer_is_written_as_llama_cpp_reads_it(native, tmp_path, dummy_prefix):
    backend, sp = train_sentencepiece_tokenizer(tmp_path / "sp", dummy_prefix)
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHATML)
    for text in plain_texts():  # the fixture is the tokenizer sentencepiece defines
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
    model, _ = native("llama", vocab_size=SP_VOCAB)
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f16")

    # llama.cpp's reader: the converter's SentencePiece fields, types as sentencepiece gives them.
    fields = gguf.GGUFReader(path).fields
    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    kinds = [
        gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
        else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.USER_DEFINED if pieces[i] == "<think>"
        else gguf.TokenType.NORMAL
        for i in range(sp.vocab_size())
    ]  # fmt: skip
    n = sp.vocab_size()
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.tokens"].contents() == pieces + [f"[PAD{i}]" for i in range(n, SP_VOCAB)]
    assert fields["tokenizer.ggml.token_type"].contents() == kinds + [gguf.TokenType.UNUSED] * (SP_VOCAB - n)
    assert kinds.count(gguf.TokenType.BYTE) == 256
    assert fields["tokenizer.ggml.scores"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32]
    assert len(fields["tokenizer.ggml.scores"].contents()) == SP_VOCAB
    assert "tokenizer.ggml.merges" not in fields  # llama.cpp merges SentencePiece tokens by score
    expected = {
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": dummy_prefix,
        "tokenizer.chat_template": CHATML,
    }
    assert {k: fields[k].contents() for k in expected} == expected

    # The vocabulary read back (merges recovered from the scores, as llama.cpp merges) gives the same ids.
    back = read_gguf(path).tokenizer
    texts = [*plain_texts(), "[INST] What is 2+2?[/INST] <think>four</think> 4</s>", " [INST]x"]
    for text in texts:
        for add in (True, False):
            assert back.encode(text, add) == tok.encode(text, add), text
    if dummy_prefix:
        # transformers reads no add_space_prefix (it always prefixes a SentencePiece vocabulary) and, through
        # its Metaspace pre-tokenizer, adds no prefix to text that starts with a space, as llama.cpp does.
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        for text in plain_texts():
            if not text[:1].isspace():
                assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text, False), text


def test_sentencepiece_ids_survive_a_round_trip_through_transformers_and_logits_match(native, tmp_path):
    from transformers import AutoModelForCausalLM

    backend, _ = train_sentencepiece_tokenizer(tmp_path / "sp")
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    model, _ = native("llama", vocab_size=SP_VOCAB)
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    ids = torch.tensor([tok.encode(SAMPLE_TEXTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids), atol=1e-4, rtol=0)


def test_a_metaspace_tokenizer_is_written_to_tokenize_as_sentencepiece_does(native, tmp_path):
    """transformers' own LlamaTokenizer puts no "▁" before text that starts with a space; sentencepiece, which
    the model was trained with (and llama.cpp, which follows it), does: the GGUF follows sentencepiece, with a note."""
    from transformers import LlamaTokenizer

    _, sp = train_sentencepiece_tokenizer(tmp_path / "sp")
    backend = LlamaTokenizer.from_pretrained(tmp_path / "sp").backend_tokenizer
    tok = Tokenizer(backend, eos_token="</s>", unk_token="<unk>")
    assert tok.encode(" a", False) != sp.encode(" a")  # where transformers' file and sentencepiece differ
    model, _ = native("llama", vocab_size=SP_VOCAB)
    with pytest.warns(UserWarning, match="Metaspace pre-tokenizer adds no '▁' before text that starts"):
        path = write_gguf(model, tok, tmp_path / "m.gguf")
    back = read_gguf(path).tokenizer
    for text in [*plain_texts(), " a", "  two leading spaces"]:
        assert back.encode(text, False) == sp.encode(text), text  # the reference: sentencepiece itself


def test_bpe_with_byte_fallback_whose_merges_llama_cpp_cannot_follow_is_refused(native, tmp_path):
    """llama.cpp joins any two adjacent tokens that form a token, best score first: with "abc" = "a" + "bc"
    not a merge, "abc" stays ["a", "bc"] in the tokenizer and would become ["abc"] in llama.cpp."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "bc": 4, "ab": 5, "abc": 6}
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    assert backend.encode("abc").tokens == ["a", "bc"]
    model, _ = native("llama")
    with pytest.raises(ModelError, match="token 'abc' is 'a' \\+ 'bc', a pair the tokenizer never merges"):
        write_gguf(model, Tokenizer(backend, unk_token="<unk>"), tmp_path / "m.gguf")


@pytest.mark.parametrize("kind, message", [
    ("unigram", "does not support Unigram tokenizers"),
    ("words", "WordLevel tokenizer has tokens of several characters \\(such as 'hello'\\)"),
    ("wordpiece", "does not support WordPiece tokenizers"),
])  # fmt: skip
def test_vocabularies_llama_cpp_cannot_reproduce_are_refused_by_name(native, tmp_path, kind, message):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    backend = Backend({
        "unigram": lambda: models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], unk_id=0),
        "words": lambda: models.WordLevel({"<unk>": 0, "hello": 1, "a": 2}, unk_token="<unk>"),
        "wordpiece": lambda: models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"),
    }[kind]())  # fmt: skip
    model, _ = native("llama")
    with pytest.raises(ModelError, match=message):
        write_gguf(model, Tokenizer(backend), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_quickstart_full_fine_tune_exports_to_gguf_with_its_tokenizer(tmp_path, monkeypatch):
    """The quickstart's character-level WordLevel vocabulary, as a SentencePiece vocabulary without the space
    prefix: each character one token, so llama.cpp reproduces it on the text the model knows."""
    from entrenar import quickstart
    from entrenar.config import load_recipe
    from entrenar.export import export
    from entrenar.train.loop import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quickstart, "accuracy", lambda *args, **kwargs: 0.0)  # 400 greedy answers: not the subject
    steps = ["training.max_steps=2", "training.eval_every=0", "training.save_every=0", "schedule.warmup_steps=1"]
    run = train(load_recipe(None, steps), progress=False).run_dir
    original, tok = entrenar.load(run, device="cpu")
    with pytest.warns(UserWarning, match="no byte-fallback tokens.*'0123456789\\+='"):
        (path,) = export(run, None, tmp_path / "quickstart.gguf", gguf="f32")

    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.tokens"].contents() == [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    assert fields["tokenizer.ggml.token_type"].contents() == [3, 3, 3, 2] + [1] * 12  # <pad> <s> </s> <unk>
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True

    loaded, back = entrenar.load(path, device="cpu")
    texts = ["47+38=85", "0123456789+=", "9+9=18</s>", "<s>1+1=2</s><pad><pad>", ""]
    for text in texts:
        for add in (True, False):
            assert back.encode(text, add) == tok.encode(text, add), text
    ids = torch.tensor([tok.encode("47+38=")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), original(ids), atol=1e-5, rtol=0)

    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in texts[:3]:
        assert theirs(text)["input_ids"] == tok.encode(text), text


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids)


# -- errors -------------------------------------------------------------------


def test_unsupported_type_is_named(native, tmp_path):
    model, tok = native("llama")
    with pytest.raises(QuantError, match="'q5_k' is not supported.*f16, q8_0"):
        write_gguf(model, tok, tmp_path / "m.gguf", "q5_k")
    assert not (tmp_path / "m.gguf").exists()


def test_tokenizer_larger_than_the_embedding_is_refused(native, tmp_path):
    model, tok = native("llama", vocab_size=256)
    with pytest.raises(ModelError, match="300 tokens but the model's embedding only 256 rows"):
        write_gguf(model, tok, tmp_path / "m.gguf")


def test_unknown_pre_tokenizer_is_refused(native, tmp_path):
    from tokenizers import pre_tokenizers

    model, _ = native("llama")
    backend = chat_backend().from_str(chat_backend().to_str())  # a copy
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel()])
    with pytest.raises(ModelError, match="splits text unlike any llama.cpp knows"):
        write_gguf(model, Tokenizer(backend, eos_token=EOS), tmp_path / "m.gguf")


def test_post_processor_that_gguf_cannot_describe_is_refused(native, tmp_path):
    from tokenizers import processors

    model, _ = native("llama")
    backend = chat_backend().from_str(chat_backend().to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 2)]
    )
    with pytest.raises(ModelError, match=r"turns \[68\] into \[2, 68\].*BOS id 0"):
        write_gguf(model, Tokenizer(backend, bos_token=BOS, eos_token=EOS), tmp_path / "m.gguf")
    # Without a named BOS token, the one the post-processor adds is BOS.
    path = write_gguf(model, Tokenizer(backend, eos_token=EOS), tmp_path / "m.gguf")
    assert read_gguf(path).tokenizer.encode("a") == [2, 68]


def test_model_with_lora_layers_is_refused(native, tmp_path):
    model, tok = native("llama")
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ModelError, match="'model.layers.0.self_attn.q_proj.base_layer.weight' has no llama.cpp name"):
        write_gguf(model, tok, tmp_path / "m.gguf")


@pytest.mark.parametrize("value, error, message", [(1e6, QuantError, "exceed the float16 range"),
                                                   (float("nan"), ModelError, "NaN/inf")])
def test_bad_values_name_the_tensor(native, tmp_path, value, error, message):
    model, tok = native("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = value
    with pytest.raises(error, match=f"model.layers.1.mlp.up_proj.weight.*{message}"):
        write_gguf(model, tok, tmp_path / "m.gguf", "f16")


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(native, tmp_path):
    model, tok = native("llama")
    path = write_gguf(model, tok, tmp_path / "m.gguf", "f16")
    before = path.read_bytes()
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")  # refused before the file is begun (entrenar.io.finite)
    with pytest.raises(ModelError, match="model.norm.weight"):
        write_gguf(model, tok, path, "q8_0")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["m.gguf"]
