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
* the tokenizer as ``tokenizer.ggml.*`` lists: byte-level BPE ("gpt2") tokens,
  token types, merges and the name of llama.cpp's pre-tokenizer, special ids,
  BOS/EOS flags and the chat template.

llama.cpp names a pre-tokenizer rather than storing it, so the name is chosen
by behaviour: the one whose normalizer and pre-tokenizer split a set of probe
texts exactly as the model's tokenizer does. The tokenizer that
:mod:`entrenar.models.gguf` rebuilds from the written lists must then encode
the probes to the same ids, or the export is refused rather than shipped with
a tokenizer that silently differs.

Tensors are converted and written one at a time, so peak memory is the model
plus one converted tensor. The file is written beside its target and renamed
into place.
"""

from __future__ import annotations

import json
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
from entrenar.models.gguf import build_tokenizer, gguf_tensor_name
from entrenar.quant.int import check_finite, quantize_q4_0, quantize_q8_0

if TYPE_CHECKING:
    import gguf
    import tokenizers

    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer

# The file types offered, by the names llama.cpp's tools use; each tensor's type follows llama-quantize's rules.
GGUF_TYPES = tuple(FILE_TYPES)
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ROPE_FREQS = "rope_freqs.weight"

# llama.cpp token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
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
    entries = []
    if (config.rope_scaling or {}).get("rope_type") == "llama3":
        entries.append(_Entry(_ROPE_FREQS, None, (config.head_dim // 2,), Q.F32))
    named = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        try:
            gguf_name = gguf_tensor_name(hf_name)
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
    if arch == "llama" and entry.hf_name is not None:
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
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if c.sliding_window is not None and c.sliding_window < c.max_position_embeddings:
        warnings.warn(
            f"{c.model_type} sliding window ({c.sliding_window} tokens) is not written: llama.cpp's {arch} "
            "architecture attends to the whole context, so outputs differ beyond the window",
            stacklevel=3,
        )


def check_gguf_tokenizer(tokenizer: Tokenizer) -> None:
    """Refuse, before any work, a tokenizer the GGUF writer cannot describe (it writes byte-level BPE)."""
    model_json = json.loads(tokenizer.backend.to_str())["model"]
    if model_json.get("type") != "BPE" or model_json.get("byte_fallback"):
        kind = f"{model_json.get('type')}" + (" with byte fallback" if model_json.get("byte_fallback") else "")
        raise ModelError(
            f"GGUF export supports byte-level BPE tokenizers (Llama 3, Qwen, SmolLM); this one is {kind} "
            "(SentencePiece-style tokenizers are not supported yet)"
        )


def tokenizer_metadata(tokenizer: Tokenizer, n_vocab: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a byte-level BPE tokenizer, as the GGUF reader reads it.

    Ids between the tokenizer's vocabulary and the model's ``n_vocab`` (padding
    rows of the embedding) become ``[PADn]`` tokens of type UNUSED, as in
    llama.cpp's converter.
    """
    backend = tokenizer.backend
    if tokenizer.vocab_size > n_vocab:
        raise ModelError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only {n_vocab} rows"
        )
    check_gguf_tokenizer(tokenizer)
    model_json = json.loads(backend.to_str())["model"]
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
        else:
            tokens.append(by_id[i])
            types.append((_CONTROL if added[i].special else _USER_DEFINED) if i in added else _NORMAL)
    merges = []
    for n, merge in enumerate(model_json.get("merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(pair) != 2 or not all(pair):
            raise ModelError(f"tokenizer merge {n} ({merge!r}) is not two tokens without spaces; GGUF cannot store it")
        merges.append(" ".join(pair))

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    specials = {name: backend.token_to_id(token) for name, token in tokenizer.special_tokens.items()}
    eos_ids = tokenizer.eos_ids
    ids = {
        "tokenizer.ggml.bos_token_id": tokenizer.bos_id,
        "tokenizer.ggml.eos_token_id": eos_ids[0] if eos_ids else None,
        # GGUF has two more end-of-generation ids; llama.cpp also stops on well-known end tokens by name.
        "tokenizer.ggml.eot_token_id": eos_ids[1] if len(eos_ids) > 1 else None,
        "tokenizer.ggml.eom_token_id": eos_ids[2] if len(eos_ids) > 2 else None,
        "tokenizer.ggml.padding_token_id": specials.get("pad_token"),
        "tokenizer.ggml.unknown_token_id": specials.get("unk_token"),
    }
    if len(eos_ids) > 3:
        warnings.warn(f"GGUF stores three end-of-sequence ids; {eos_ids[3:]} are left out", stacklevel=2)
    meta.update({k: v for k, v in ids.items() if v is not None})
    added_bos, add_eos = _added_special_tokens(tokenizer)
    if added_bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = added_bos
    meta["tokenizer.ggml.add_bos_token"] = added_bos is not None
    meta["tokenizer.ggml.add_eos_token"] = add_eos
    meta["tokenizer.ggml.pre"] = _pre_tokenizer_name(backend)
    _check_rebuilt_tokenizer(backend, build_tokenizer(meta, "<gguf being written>"))
    if tokenizer.chat_template is not None:
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


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


def _check_rebuilt_tokenizer(original: tokenizers.Tokenizer, rebuilt: tokenizers.Tokenizer) -> None:
    specials = "".join(t.content for t in original.get_added_tokens_decoder().values())
    for text in (*_PROBES, specials + _PROBES[0] + specials):
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
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
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
    finite.check_finite(model.state_dict(), path, ModelError)
    arch = _ARCHITECTURES[model.config.model_type]
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
