"""A native model and its tokenizer -> a GGUF file that llama.cpp runs.

The inverse of :mod:`entrenar.models.gguf`, written the way llama.cpp's
``convert_hf_to_gguf.py`` writes the same model:

* architecture ``llama`` (Llama and Mistral), ``qwen2`` or ``qwen3`` with its
  hyper-parameters as ``{arch}.*`` metadata; Llama 3.1 RoPE scaling as a
  ``rope_freqs.weight`` tensor of per-frequency divisors, linear scaling as keys;
* tensors under llama.cpp's names, q_proj/k_proj rows permuted for ``llama``
  (interleaved RoPE pairs), 1-D tensors (norms, biases) in F32, 2-D weights in
  the type llama-quantize gives them for the file type
  (:func:`entrenar.export.gguf_quants.tensor_types`): Q8_0/Q4_0 blocks from
  :mod:`entrenar.quant.int`, k-quants from :mod:`entrenar.export.gguf_quants`,
  Q4_1/Q5_0/Q5_1 from the gguf package;
* the tokenizer as ``tokenizer.ggml.*`` lists, special ids, BOS/EOS flags and
  the chat template: byte-level BPE (Llama 3, Qwen, SmolLM) as llama.cpp's
  "gpt2" vocabulary (tokens, token types, merges and the name of its
  pre-tokenizer); BPE with byte fallback (Llama 2, Mistral, Gemma as
  ``tokenizer.json`` has them) and character-level WordLevel (the quickstart's)
  as its SentencePiece "llama" vocabulary (tokens, scores, token types with
  ``<0x..>`` byte tokens as BYTE, and whether a space is prefixed).

llama.cpp names a pre-tokenizer rather than storing it, so the name is chosen
by behaviour: the one whose normalizer and pre-tokenizer split a set of probe
texts exactly as the model's tokenizer does; likewise the space prefix of a
SentencePiece vocabulary. Its scores are chosen so that llama.cpp, which joins
the adjacent pair of best score, merges in the BPE model's order. The
tokenizer that :mod:`entrenar.models.gguf` rebuilds from the written lists
(which tokenizes as llama.cpp does) must then encode the probes to the same
ids, or the export is refused rather than shipped with a tokenizer that
silently differs. Unigram and WordPiece tokenizers are refused by name.

Tensors are converted and written one at a time, so peak memory is the model
plus one converted tensor. The file is written beside its target and renamed
into place.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from entrenar.errors import ModelError, QuantError
from entrenar.export.gguf_meta import GeneralMetadata
from entrenar.export.gguf_quants import FILE_TYPES, quantize_k, tensor_types
from entrenar.io import atomic, finite
from entrenar.models.config import rope_inv_freq
from entrenar.models.gguf import build_tokenizer, gemma_layout, gguf_tensor_name
from entrenar.models.rope_scaling import rope_attention_scaling
from entrenar.quant.int import check_finite, quantize_q4_0, quantize_q8_0

if TYPE_CHECKING:
    import gguf
    import tokenizers

    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer

# The file types offered, by the names llama.cpp's tools use; each tensor's type follows llama-quantize's rules.
GGUF_TYPES = tuple(FILE_TYPES)
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                  "olmo2": "olmo2", "granite": "granite", "gemma2": "gemma2", "gemma3_text": "gemma3"}
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# convert_hf_to_gguf.py permutes q/k rows for LlamaModel and its subclasses (Granite); the others keep HF's order.
_PERMUTED = ("llama", "granite")

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# SentencePiece's byte-fallback tokens.
_BYTE_TOKEN = re.compile("<0x[0-9A-F]{2}>")
# Byte-level pre-tokenizers llama.cpp knows, tried in this order (the reader knows how to build each).
_PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "qwen2")
# Texts on which the pre-tokenizers above differ: contractions, digit runs, unicode
# (composed and decomposed), runs of spaces, newlines and tabs, punctuation and code.
_PROBES = (
    "Hello world! It's a test, isn't it? We'LL see; they'd've done it.",
    "  leading spaces,   runs of    spaces and trailing  ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines \n ",
    "digits 1234567890 and 3.14159 and 2024-11-21, x1y22z333",
    "ünïcödé: café naïve Straße, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский",
    "e\u0301 (decomposed) vs \u00e9 (composed), \uff21\uff22 fullwidth",
    "code: def f(x):\n    return x**2  # square\n\t}}]);",
    "",
    " ",
)


def check_gguf_type(kind: str) -> str:
    """``kind`` in lower case if it is one of :data:`GGUF_TYPES`, else a :class:`QuantError`."""
    if not isinstance(kind, str) or kind.lower() not in GGUF_TYPES:
        raise QuantError(f"GGUF type {kind!r} is not supported (supported: {', '.join(GGUF_TYPES)})")
    return kind.lower()


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k permutation for the llama architecture.

    Each head's rows go from Hugging Face's half-split RoPE order (all first
    halves of the pairs, then all second halves) to llama.cpp's interleaved
    order; :func:`entrenar.models.gguf.unpermute_rope_rows` is its inverse.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot permute q/k rows for llama.cpp: {rows} rows is not a multiple of 2 x {n_head} heads")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- tensors ------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One tensor of the file: where it comes from and how it is stored."""

    gguf_name: str
    hf_name: str | None  # None for rope_freqs, which is computed from the config
    shape: tuple[int, ...]  # torch order
    kind: gguf.GGMLQuantizationType

    def byte_shape(self) -> tuple[tuple[int, ...], np.dtype]:
        """The numpy shape and dtype of the stored data (quantized rows as bytes)."""
        from gguf import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType as Q

        if self.kind == Q.F32:
            return self.shape, np.dtype(np.float32)
        if self.kind == Q.F16:
            return self.shape, np.dtype(np.float16)
        block, size = GGML_QUANT_SIZES[self.kind]
        return (*self.shape[:-1], self.shape[-1] // block * size), np.dtype(np.uint8)


def _plan(model: Transformer, qtype: str) -> list[_Entry]:
    """Every tensor of the file in the converter's order: rope_freqs first, then the state dict's.

    2-D weights get the type llama-quantize gives them in a ``qtype`` file
    (:func:`entrenar.export.gguf_quants.tensor_types`), 1-D tensors F32.
    """
    from gguf import GGMLQuantizationType as Q

    config = model.config
    assert config.head_dim is not None  # ModelConfig.__post_init__ fills it in
    arch = _ARCHITECTURES[config.model_type]
    entries = []
    if (config.rope_scaling or {}).get("rope_type") == "llama3":
        entries.append(_Entry(_ROPE_FREQS, None, (config.head_dim // 2,), Q.F32))
    if (config.rope_scaling or {}).get("rope_type") == "longrope":  # Phi-3: the factors as two tensors
        rotary = int(config.head_dim * config.partial_rotary_factor)
        entries += [_Entry(name, None, (rotary // 2,), Q.F32) for name in _LONGROPE_FACTORS]
    named = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        try:
            gguf_name = gguf_tensor_name(hf_name, arch)
        except KeyError:
            raise ModelError(
                f"tensor '{hf_name}' has no llama.cpp name; only a plain model can be written as GGUF "
                "(merge LoRA adapters and convert quantized layers first)"
            ) from None
        named.append((gguf_name, hf_name, tuple(tensor.shape)))
    types = tensor_types(qtype, [(g, shape) for g, _, shape in named])
    for gguf_name, hf_name, shape in named:
        entries.append(_Entry(gguf_name, hf_name, shape, Q[types[gguf_name]] if gguf_name in types else Q.F32))
    return entries


def _llama3_rope_divisors(model: Transformer) -> torch.Tensor:
    """What convert_hf_to_gguf.py stores as rope_freqs.weight: unscaled / scaled inverse frequencies."""
    config = model.config
    return rope_inv_freq(config.replace(rope_scaling=None)) / rope_inv_freq(config)


def _encode(entry: _Entry, tensor: torch.Tensor, arch: str, model: Transformer) -> np.ndarray:
    """The bytes of one tensor as stored: permuted for llama, in its storage type."""
    from gguf import GGMLQuantizationType as Q

    name = entry.hf_name or entry.gguf_name
    w = tensor.detach().to("cpu", torch.float32)
    check_finite(w, name)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        w = w + 1  # convert_hf_to_gguf.py stores Gemma's norms as the 1 + w they multiply by
    if arch in _PERMUTED and entry.hf_name is not None:
        if ".self_attn.q_proj." in entry.hf_name:
            w = permute_rope_rows(w, model.config.num_heads)
        elif ".self_attn.k_proj." in entry.hf_name:
            w = permute_rope_rows(w, model.config.num_kv_heads)
    if entry.kind == Q.F32:
        return w.numpy()
    if entry.kind == Q.F16:
        half = w.to(torch.float16)
        if torch.isinf(half).any():
            raise QuantError(f"{name}: values exceed the float16 range (largest |w| = {w.abs().max().item():.4g})")
        return half.numpy()
    if entry.kind == Q.Q8_0:
        return quantize_q8_0(w, name)
    if entry.kind == Q.Q4_0:
        return quantize_q4_0(w, name)
    if entry.kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize_k(w.numpy(), entry.kind.name)
    from gguf.quants import quantize  # Q4_1, Q5_0, Q5_1: the gguf package's ports of ggml's reference

    return quantize(w.numpy(), entry.kind)


def _tensors(model: Transformer, plan: list[_Entry], arch: str) -> Iterator[np.ndarray]:
    state = model.state_dict()
    for entry in plan:
        if entry.gguf_name in _LONGROPE_FACTORS:
            tensor = torch.tensor((model.config.rope_scaling or {})[_LONGROPE_FACTORS[entry.gguf_name]])
        else:
            tensor = _llama3_rope_divisors(model) if entry.hf_name is None else state[entry.hf_name]
        data = _encode(entry, tensor, arch, model)
        expected = entry.byte_shape()
        if (data.shape, data.dtype) != expected:  # a programming error, not the user's
            raise AssertionError(f"{entry.gguf_name}: encoded as {data.dtype}{data.shape}, planned {expected}")
        yield data


# -- metadata -----------------------------------------------------------------


def _add_general(writer: gguf.GGUFWriter, name: str | None, general: GeneralMetadata | None) -> None:
    """``general.name`` and the model-describing keys carried over from the input, with their stored types."""
    from gguf import GGUFValueType

    name = name or (general.name if general is not None else None)
    if name:
        writer.add_name(name)
    for key, (value, kind) in (general.keys if general is not None else {}).items():
        if kind is None:  # from a Hugging Face folder: strings and lists of strings
            if isinstance(value, list):
                writer.add_array(key, value)
            else:
                writer.add_string(key, str(value))
        else:
            vtype, sub = kind
            writer.add_key_value(key, value, vtype, sub_type=sub if vtype == GGUFValueType.ARRAY else None)


def _add_architecture(
    writer: gguf.GGUFWriter, model: Transformer, arch: str, qtype: str, name: str | None,
    general: GeneralMetadata | None = None,
) -> None:
    from gguf import GGML_QUANT_VERSION, LlamaFileType, RopeScalingType

    c = model.config
    assert c.head_dim is not None  # ModelConfig.__post_init__ fills it in
    writer.add_type("model")
    _add_general(writer, name, general)
    file_type = {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
        "q4_0": LlamaFileType.MOSTLY_Q4_0,
        "q4_1": LlamaFileType.MOSTLY_Q4_1,
        "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
        "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M,
        "q6_k": LlamaFileType.MOSTLY_Q6_K,
    }[qtype]
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(int(c.head_dim * c.partial_rotary_factor))
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    _add_family(writer, model, arch)
    if arch == "phi3":
        writer.add_sliding_window(c.sliding_window or 0)  # llama.cpp's phi3 reads it (0: none)
    elif arch in ("gemma2", "gemma3"):
        _add_gemma(writer, model, arch)
    elif c.sliding_window is not None and c.sliding_window < c.max_position_embeddings:
        warnings.warn(
            f"{c.model_type} sliding window ({c.sliding_window} tokens) is not written: llama.cpp's {arch} "
            "architecture attends to the whole context, so outputs differ beyond the window",
            stacklevel=3,
        )


def _add_family(writer: gguf.GGUFWriter, model: Transformer, arch: str) -> None:
    """Phi-3's longrope keys and Granite's multipliers, under the names convert_hf_to_gguf.py writes."""
    c = model.config
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_attn_factors(rope_attention_scaling(c))
    if arch == "granite":
        assert c.head_dim is not None  # ModelConfig.__post_init__ fills it in
        writer.add_attention_scale(c.head_dim ** -0.5 if c.attention_multiplier is None else c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)


def _check_gemma(model: Transformer, arch: str) -> None:
    """Refuse a Gemma model llama.cpp would run otherwise than it was trained: llama.cpp fixes the layer pattern
    (every 2nd / 6th layer global), Gemma 3's local RoPE base (10000), the attention scale (1/sqrt(head_dim), or
    1/sqrt(hidden / heads) for the 27B shapes) and, for Gemma 2, a head tied to the embeddings."""
    c = model.config
    expected = gemma_layout(arch, c.num_layers, c.hidden_size, c.num_heads, c.head_dim or 0)
    theirs = {"layer_types": c.layer_types, "query_pre_attn_scalar": float(c.query_pre_attn_scalar or c.head_dim or 0),
              "rope_local_theta": c.rope_local_theta if arch == "gemma3" else None,
              "tie_word_embeddings": c.tie_word_embeddings if arch == "gemma2" else True}
    for key, value in expected.items():
        if theirs[key] != value:
            raise ModelError(f"a {c.model_type} model with {key}={theirs[key]!r} cannot be written as GGUF: "
                             f"llama.cpp's {arch} architecture assumes {value!r}")


def _add_gemma(writer: gguf.GGUFWriter, model: Transformer, arch: str) -> None:
    """The keys convert_hf_to_gguf.py writes for Gemma 2/3: the window and the soft caps."""
    c = model.config
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    if c.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)


def _vocabulary_kind(model_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.model`` for a ``tokenizers`` model: "gpt2" or "llama", else a ModelError."""
    kind = model_json.get("type")
    if kind == "BPE":
        return "llama" if model_json.get("byte_fallback") else "gpt2"
    if kind == "WordLevel":
        return "llama"
    if kind == "Unigram":
        raise ModelError(
            "GGUF export does not support Unigram tokenizers: llama.cpp's SentencePiece vocabulary ('llama') "
            "merges pieces by score, while a Unigram model picks the most probable segmentation, so the file "
            "would tokenize differently (supported: byte-level BPE, BPE with byte fallback, character-level WordLevel)"
        )
    raise ModelError(
        f"GGUF export does not support {kind} tokenizers "
        "(supported: byte-level BPE, BPE with byte fallback, character-level WordLevel)"
    )


def check_gguf_tokenizer(tokenizer: Tokenizer) -> None:
    """Refuse, before any work, a tokenizer whose kind the GGUF writer cannot describe.

    Byte-level BPE (Llama 3, Qwen, SmolLM) is written as llama.cpp's "gpt2"
    vocabulary; BPE with byte fallback (Llama 2, Mistral, Gemma as converted to
    ``tokenizer.json``) and character-level WordLevel (the quickstart's) as its
    SentencePiece "llama" vocabulary. Whether a tokenizer of a supported kind
    is reproduced exactly is checked when its metadata is built.
    """
    _vocabulary_kind(json.loads(tokenizer.backend.to_str())["model"])


def tokenizer_metadata(tokenizer: Tokenizer, n_vocab: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of ``tokenizer``, as the GGUF reader reads it.

    Ids between the tokenizer's vocabulary and the model's ``n_vocab`` (padding
    rows of the embedding) become ``[PADn]`` tokens of type UNUSED, as in
    llama.cpp's converter. The tokenizer that :mod:`entrenar.models.gguf`
    rebuilds from the metadata must encode a set of probe texts to the same ids
    as ``tokenizer``, or the export is refused.
    """
    backend = tokenizer.backend
    if tokenizer.vocab_size > n_vocab:
        raise ModelError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only {n_vocab} rows"
        )
    model_json = json.loads(backend.to_str())["model"]
    kind = _vocabulary_kind(model_json)
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    specials = {name: backend.token_to_id(token) for name, token in tokenizer.special_tokens.items()}
    unk_id = specials.get("unk_token")
    if unk_id is None and model_json.get("unk_token") is not None:
        unk_id = backend.token_to_id(model_json["unk_token"])
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
        elif kind == "llama" and i == unk_id:
            tokens.append(by_id[i])
            types.append(_UNKNOWN)
        elif i in added:
            tokens.append(by_id[i])
            types.append(_CONTROL if added[i].special else _USER_DEFINED)
        else:
            tokens.append(by_id[i])
            byte = kind == "llama" and model_json.get("byte_fallback") and _BYTE_TOKEN.fullmatch(by_id[i])
            types.append(_BYTE if byte else _NORMAL)

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": kind,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
    }
    eos_ids = tokenizer.eos_ids
    ids = {
        "tokenizer.ggml.bos_token_id": tokenizer.bos_id,
        "tokenizer.ggml.eos_token_id": eos_ids[0] if eos_ids else None,
        # GGUF has two more end-of-generation ids; llama.cpp also stops on well-known end tokens by name.
        "tokenizer.ggml.eot_token_id": eos_ids[1] if len(eos_ids) > 1 else None,
        "tokenizer.ggml.eom_token_id": eos_ids[2] if len(eos_ids) > 2 else None,
        "tokenizer.ggml.padding_token_id": specials.get("pad_token"),
        "tokenizer.ggml.unknown_token_id": unk_id,
    }
    if len(eos_ids) > 3:
        warnings.warn(f"GGUF stores three end-of-sequence ids; {eos_ids[3:]} are left out", stacklevel=2)
    meta.update({k: v for k, v in ids.items() if v is not None})
    added_bos, add_eos = _added_special_tokens(tokenizer)
    if added_bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = added_bos
    meta["tokenizer.ggml.add_bos_token"] = added_bos is not None
    meta["tokenizer.ggml.add_eos_token"] = add_eos
    if kind == "gpt2":
        meta["tokenizer.ggml.merges"] = _merges(model_json)
        meta["tokenizer.ggml.pre"] = _pre_tokenizer_name(backend)
        _check_rebuilt_tokenizer(backend, build_tokenizer(meta, "<gguf being written>"), _PROBES)
    else:
        meta["tokenizer.ggml.pre"] = "default"
        meta["tokenizer.ggml.scores"] = _sentencepiece_scores(model_json, tokens, types)
        meta["tokenizer.ggml.add_space_prefix"] = _space_prefix(backend, meta)
    if tokenizer.chat_template is not None:
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def _merges(model_json: dict[str, Any]) -> list[str]:
    """A BPE model's merges as GGUF stores them: the two tokens separated by one space."""
    merges = []
    for n, merge in enumerate(model_json.get("merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(pair) != 2 or not all(pair):
            raise ModelError(f"tokenizer merge {n} ({merge!r}) is not two tokens without spaces; GGUF cannot store it")
        merges.append(" ".join(pair))
    return merges


def _sentencepiece_scores(model_json: dict[str, Any], tokens: list[str], types: list[int]) -> list[float]:
    """Token scores under which llama.cpp's SentencePiece tokenizer merges as the model does.

    llama.cpp starts from characters and repeatedly joins the adjacent pair
    whose concatenation is a token, best score first. That reproduces BPE when
    the score of a token falls with the rank of the merge that makes it and
    every pair of tokens that concatenates to a token is one of the merges (as
    in a tokenizer converted from SentencePiece); a WordLevel vocabulary is
    reproduced when it has no token of two or more characters to merge into.
    Anything else is refused, naming a token llama.cpp would form differently.
    """
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _NORMAL}
    if model_json["type"] == "WordLevel":
        long = next((t for t in vocab if len(t) > 1), None)
        if long is not None:
            raise ModelError(
                f"the WordLevel tokenizer has tokens of several characters (such as {long!r}); llama.cpp builds "
                "such tokens by joining smaller ones, which a word-level vocabulary lacks, so it cannot be written "
                "as GGUF (character-level WordLevel vocabularies can)"
            )
        return [0.0 if kind == _NORMAL else -1000.0 for kind in types]
    rank: dict[str, int] = {}
    pairs = set()
    for n, merge in enumerate(_merges(model_json)):
        left, right = merge.split(" ")
        pairs.add((left, right))
        rank.setdefault(left + right, n)
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in pairs:
                raise ModelError(
                    f"token {token!r} is {left!r} + {right!r}, a pair the tokenizer never merges; llama.cpp's "
                    "SentencePiece tokenizer joins any two tokens that form a token, so it would tokenize "
                    "differently (a BPE tokenizer converted from SentencePiece has every such merge)"
                )
    # Merged tokens score -rank; the rest (characters, bytes, special and padding tokens) below them all.
    floor = -float(len(pairs) + 1)
    return [-float(rank[t]) if t in rank and kind == _NORMAL else floor for t, kind in zip(tokens, types)]


def _space_prefix(backend: tokenizers.Tokenizer, meta: dict[str, Any]) -> bool:
    """``tokenizer.ggml.add_space_prefix``: whether text gets a leading "\u2581", found by encoding probes both ways.

    A vocabulary without byte-fallback tokens is probed only with text made of
    its own characters: llama.cpp cannot tokenize any other character.
    """
    probes: tuple[str, ...] = _PROBES
    if sum(kind == _BYTE for kind in meta["tokenizer.ggml.token_type"]) < 256:
        alphabet = [t for t, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
                    if kind == _NORMAL and len(t) == 1]
        warnings.warn(
            "the tokenizer has no byte-fallback tokens (<0x00>..<0xFF>): llama.cpp cannot tokenize text with "
            f"characters outside its vocabulary ({''.join(alphabet)!r}), which this tokenizer maps to its "
            "unknown token",
            stacklevel=3,
        )
        allowed = set(alphabet) | ({" "} if "\u2581" in alphabet else set())
        probes = (
            "".join(alphabet),
            "".join(reversed(alphabet)),
            "".join(alphabet[i % len(alphabet)] for i in range(0, 7 * len(alphabet), 3)) if alphabet else "",
            *("".join(c for c in text if c in allowed) for text in _PROBES),
        )
    # transformers' Llama/Mistral tokenizer.json (a Metaspace pre-tokenizer) puts no "\u2581" before text that
    # starts with a space, nor (prepend_scheme 'first') after a special token; SentencePiece, which the model was
    # trained with, and llama.cpp do. The GGUF follows SentencePiece, as llama.cpp's own conversion of the model
    # does (from tokenizer.model): the two agree everywhere else, which the probes check.
    metaspace = '"Metaspace"' in json.dumps(json.loads(backend.to_str())["pre_tokenizer"])
    if metaspace:
        probes = tuple(text.lstrip() for text in probes)
    errors = []
    for prefix in (True, False):
        candidate = {**meta, "tokenizer.ggml.add_space_prefix": prefix}
        try:
            _check_rebuilt_tokenizer(backend, build_tokenizer(candidate, "<gguf being written>"), probes,
                                     around_specials=not metaspace)
        except ModelError as e:
            errors.append(e)
            continue
        if metaspace and prefix:
            warnings.warn(
                "the tokenizer's Metaspace pre-tokenizer adds no '\u2581' before text that starts with a space or "
                "follows a special token; the GGUF tokenizes such text as SentencePiece and llama.cpp do (with "
                "'\u2581'), as llama.cpp's own conversion of this model would: ids differ there only",
                stacklevel=3,
            )
        return prefix
    raise ModelError(
        f"{errors[0]} (with and without llama.cpp's space prefix); llama.cpp's SentencePiece tokenizer turns "
        "spaces into '\u2581', adds one in front of the text and after every special token when the prefix is "
        "on, and normalizes nothing else"
    )


def _added_special_tokens(tokenizer: Tokenizer) -> tuple[int | None, bool]:
    """The id encoding puts in front (BOS, or None) and whether it appends EOS, from what the post-processor does."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    prefix = full[:start] if start is not None else full
    suffix = full[start + len(plain) :] if start is not None else full
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    # A tokenizer without a named BOS token whose post-processor still adds one: that one is BOS.
    bos_ok = prefix == [] or (len(prefix) == 1 and bos in (None, prefix[0]))
    if start is None or not bos_ok or suffix not in ([], [eos]):
        raise ModelError(
            f"the tokenizer's post-processor turns {plain} into {full}; GGUF can only say 'add BOS' "
            f"(BOS id {bos}) and 'add EOS' (EOS id {eos})"
        )
    return (prefix[0] if prefix else None), bool(suffix)


def _pieces(backend: tokenizers.Tokenizer, text: str) -> list[str]:
    """``text`` after the normalizer and pre-tokenizer: the pieces BPE then sees one by one."""
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    if backend.pre_tokenizer is None:
        return [text]
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def _pre_tokenizer_name(backend: tokenizers.Tokenizer) -> str:
    """llama.cpp's name for the normalizer + pre-tokenizer that splits the probe texts as ``backend`` does."""
    wanted = [_pieces(backend, text) for text in _PROBES]
    # The reader builds each candidate; a one-token vocabulary is enough to get its pre-tokenizer.
    stub = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}
    for pre in _PRE_TOKENIZERS:
        candidate = build_tokenizer({**stub, "tokenizer.ggml.pre": pre})
        if [_pieces(candidate, text) for text in _PROBES] == wanted:
            return pre
    raise ModelError(
        "the tokenizer's pre-tokenizer splits text unlike any llama.cpp knows by name "
        f"(tried {', '.join(_PRE_TOKENIZERS)}); it cannot be written as GGUF"
    )


def _check_rebuilt_tokenizer(
    original: tokenizers.Tokenizer, rebuilt: tokenizers.Tokenizer, probes: tuple[str, ...],
    around_specials: bool = True,
) -> None:
    specials = "".join(t.content for t in original.get_added_tokens_decoder().values())
    for text in (*probes, *([specials + probes[0] + specials] if around_specials else [])):
        for add in (False, True):
            ours = original.encode(text, add_special_tokens=add).ids
            theirs = rebuilt.encode(text, add_special_tokens=add).ids
            if ours != theirs:
                raise ModelError(
                    f"the tokenizer rebuilt from GGUF metadata encodes {text[:40]!r} as {theirs[:12]}..., "
                    f"the model's tokenizer as {ours[:12]}...; refusing to write a GGUF whose tokenizer differs"
                )


def _add_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any], chat_templates: dict[str, str]) -> None:
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in meta:
        writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        writer.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("eot_token_id", writer.add_eot_token_id),
        ("eom_token_id", writer.add_eom_token_id),
        ("padding_token_id", writer.add_pad_token_id),
        ("unknown_token_id", writer.add_unk_token_id),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            add(meta[f"tokenizer.ggml.{key}"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_add_eos_token(meta["tokenizer.ggml.add_eos_token"])
    if chat_templates:
        # The default one becomes tokenizer.chat_template, others tokenizer.chat_template.<name>.
        writer.add_chat_template([{"name": n, "template": t} for n, t in chat_templates.items()])


# -- the file -----------------------------------------------------------------


def write_gguf(
    model: Transformer,
    tokenizer: Tokenizer,
    path: str | Path,
    qtype: str = "f16",
    name: str | None = None,
    general: GeneralMetadata | None = None,
) -> Path:
    """Write ``model`` (a plain, merged :class:`Transformer`) and ``tokenizer`` as a GGUF file at ``path``.

    ``qtype`` is the file type (:data:`GGUF_TYPES`); ``name`` becomes
    ``general.name`` (default: ``general.name`` of ``general``, the
    model-describing metadata from :func:`entrenar.export.gguf_meta.describe`). Everything is checked before the file is
    created, and the file appears under ``path`` only once complete.
    """
    from gguf import GGUFWriter

    qtype = check_gguf_type(qtype)
    path = Path(path)
    if model.config.model_type not in _ARCHITECTURES:
        raise ModelError(f"writing GGUF files of {model.config.model_type} models is not supported "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    arch = _ARCHITECTURES[model.config.model_type]
    if arch in ("gemma2", "gemma3"):
        _check_gemma(model, arch)
    finite.check_finite(model.state_dict(), path, ModelError)
    plan = _plan(model, qtype)
    meta = tokenizer_metadata(tokenizer, model.config.vocab_size)

    def write(tmp: Path) -> None:
        writer = GGUFWriter(tmp, arch)
        _add_architecture(writer, model, arch, qtype, name, general)
        _add_tokenizer(writer, meta, tokenizer.chat_templates)
        for entry in plan:
            shape, dtype = entry.byte_shape()
            nbytes = int(np.prod(shape)) * dtype.itemsize
            writer.add_tensor_info(entry.gguf_name, shape, dtype, nbytes, raw_dtype=entry.kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        try:
            for data in _tensors(model, plan, arch):
                writer.write_tensor_data(data)
        finally:
            writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic.write_file(path, write)


__all__ = ["GGUF_TYPES", "check_gguf_type", "permute_rope_rows", "tokenizer_metadata", "write_gguf"]
