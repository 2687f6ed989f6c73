"""Small GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them.

Independent of entrenar's reader on purpose: tensor names come from the gguf
package's own HF -> GGUF name map, the q/k permutation and the Llama 3 RoPE
divisors follow the converter's published formulas, and quantization is
``gguf.quants.quantize``. The reader is then tested against what goes in here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "granite": gguf.MODEL_ARCH.GRANITE,
}
# The architectures whose converter class is LlamaModel or a subclass: their q/k rows are permuted.
_PERMUTED = (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.GRANITE)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"  # an added token that is not special (USER_DEFINED in GGUF)

# Text with what tokenizers get wrong first: unicode, runs of spaces, newlines,
# tabs, digits, contractions, special tokens glued to words.
SAMPLE_TEXTS = [
    "Hello world! It's a test, isn't it? We'll see.",
    "  leading spaces,   runs of    spaces and trailing  ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines",
    "digits 1234567890 and 3.14159 and 2024-11-21",
    "ünïcödé: café naïve Straße, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>hmm</think>Hello<|endoftext|>",
    "code: def f(x):\n    return x**2  # square\n",
    "",
    " ",
]

_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "It's what we'll do, they've said, and I'm sure you'd agree.",
    "In 2024 there were 365 days; 12 months and 52 weeks.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Café, naïve, Straße, über, señor, ünïcödé and 日本語 text.",
    "Newlines\n\nand  double  spaces   matter\tto tokenizers.",
    "Numbers like 3.14159, 2.71828 and 1234567890 appear often.",
    "Emoji 🙂 and 🚀 are multi-byte characters in UTF-8.",
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_byte_level_tokenizer(pre: str, vocab_size: int = 400) -> tokenizers.Tokenizer:
    """A small byte-level BPE tokenizer set up as the real model family's tokenizer.json is.

    ``pre`` is llama.cpp's tokenizer.ggml.pre name: "gpt-2", "smollm" (digits
    split one by one, then GPT-2 bytes), "llama-bpe" (Llama 3's split regex,
    ignore_merges) or "qwen2" (NFC, Qwen2's split regex).
    """
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in ("llama-bpe", "qwen2"):
        split = LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        raise ValueError(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS_LINES * 20, trainer=trainer)
    tok.add_tokens([AddedToken(USER_TOKEN, special=False, normalized=False)])
    return tok


def byte_level_vocab(tok: tokenizers.Tokenizer, n_vocab: int) -> dict[str, Any]:
    """GGUF tokenizer metadata for a byte-level BPE tokenizer, as the converter writes it
    (get_vocab_base): ids past the tokenizer's vocabulary become [PADn] UNUSED tokens."""
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges}


def sentencepiece_vocab(sp_model_file: str | Path) -> dict[str, Any]:
    """GGUF tokenizer metadata for a SentencePiece model (the converter's _create_vocab_sentencepiece)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied to q_proj/k_proj for llama."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(config: Any) -> np.ndarray:
    """The rope_freqs.weight tensor the converter writes for rope_type "llama3"."""
    rope = config.rope_parameters if hasattr(config, "rope_parameters") else config.rope_scaling
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = rope.get("rope_theta", getattr(config, "rope_theta", None))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def store(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """A float tensor in a GGUF storage type: 1-D tensors stay F32, as the converter keeps them."""
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(
    path: str | Path,
    model: torch.nn.Module,
    *,
    qtype: Q = Q.F32,
    vocab: dict[str, Any] | None = None,
    pre: str = "smollm",
    special_ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
    name: str = "Tiny",
    skip: tuple[str, ...] = (),
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    drop_keys: tuple[str, ...] = (),
    extra_kv: dict[str, tuple[str, Any]] | None = None,
) -> Path:
    """Write a transformers causal LM as a GGUF file.

    ``vocab`` is tokenizer metadata from byte_level_vocab/sentencepiece_vocab;
    ``skip`` leaves out GGUF tensors and ``drop_keys`` metadata keys (for error
    tests); ``raw`` stores given bytes instead of a tensor (for K-quants, which
    gguf cannot quantize to).
    """
    path = Path(path)
    c = model.config
    arch = _ARCH[c.model_type]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch_name)
    kv = {
        f"{arch_name}.block_count": ("uint32", c.num_hidden_layers),
        f"{arch_name}.context_length": ("uint32", c.max_position_embeddings),
        f"{arch_name}.embedding_length": ("uint32", c.hidden_size),
        f"{arch_name}.feed_forward_length": ("uint32", c.intermediate_size),
        f"{arch_name}.attention.head_count": ("uint32", c.num_attention_heads),
        f"{arch_name}.attention.head_count_kv": ("uint32", c.num_key_value_heads),
        f"{arch_name}.attention.key_length": ("uint32", head_dim),
        f"{arch_name}.attention.value_length": ("uint32", head_dim),
        f"{arch_name}.rope.dimension_count": ("uint32", head_dim),
        f"{arch_name}.rope.freq_base": ("float32", _rope_theta(c)),
        f"{arch_name}.attention.layer_norm_rms_epsilon": ("float32", c.rms_norm_eps),
        f"{arch_name}.vocab_size": ("uint32", c.vocab_size),
        "general.name": ("string", name),
        "general.file_type": ("uint32", int(qtype)),
        **{f"{arch_name}.{k}": v for k, v in (extra_kv or {}).items()},
    }
    rope = _rope_scaling(c)
    if rope and rope.get("rope_type") == "linear":
        kv[f"{arch_name}.rope.scaling.type"] = ("string", "linear")
        kv[f"{arch_name}.rope.scaling.factor"] = ("float32", rope["factor"])
    for key, (kind, value) in kv.items():
        if key not in drop_keys:
            getattr(w, f"add_{kind}")(key, value)

    if vocab is not None:
        w.add_tokenizer_model(vocab["model"])
        w.add_tokenizer_pre(pre if vocab["model"] == "gpt2" else "default")
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        if "merges" in vocab:
            w.add_token_merges(vocab["merges"])
        if "scores" in vocab:
            w.add_token_scores(vocab["scores"])
        for key, value in (special_ids or {}).items():
            getattr(w, f"add_{key}_token_id")(value)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tensors: list[tuple[str, np.ndarray, Q]] = []
    if rope and rope.get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama3_rope_divisors(c), Q.F32))
    tied = getattr(c, "tie_word_embeddings", False)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        data = t.detach().float().numpy()
        if arch in _PERMUTED and ".self_attn.q_proj." in hf_name:
            data = permute(data, c.num_attention_heads)
        elif arch in _PERMUTED and ".self_attn.k_proj." in hf_name:
            data = permute(data, c.num_key_value_heads)
        tensors.append((gguf_name, *store(data, qtype)))
    raw = dict(raw or {})
    for gguf_name, data, kind in tensors:
        if gguf_name not in skip:
            data, kind = raw.pop(gguf_name, (data, kind))
            w.add_tensor(gguf_name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
    for gguf_name, (data, kind) in raw.items():  # names the model does not have
        w.add_tensor(gguf_name, data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rope_theta(c: Any) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _rope_scaling(c: Any) -> dict[str, Any] | None:
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    if params.get("rope_type", "default") == "default":
        return None
    return params


def random_kquant_bytes(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but finite blocks of a K-quant type (gguf can dequantize these, not quantize to them).

    The half-precision super-block scales are overwritten with small values so no
    block decodes to inf/nan.
    """
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks[:, :4] = scales  # d, dmin lead the block
    elif qtype == Q.Q2_K:
        blocks[:, -4:] = scales  # d, dmin end the block
    elif qtype in (Q.Q3_K, Q.Q6_K):
        blocks[:, -2:] = scales[:, :2]  # d ends the block
    else:
        raise ValueError(f"not a K-quant: {qtype.name}")
    return blocks.reshape(rows, cols // block * size)


def write_moe_gguf(path: str | Path, model: torch.nn.Module, qtype: Q = Q.F32, **kwargs: Any) -> Path:
    """An MoE transformers model as llama.cpp writes it: the router as ffn_gate_inp and each projection of
    every expert stacked into one tensor, ffn_{gate,up,down}_exps [experts, out, in]."""
    c = model.config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    state = model.state_dict()
    raw: dict[str, tuple[np.ndarray, Q]] = {}
    plain = {}
    for name, t in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.gate.weight"):
            raw[f"blk.{layer}.ffn_gate_inp.weight"] = store(t.float().numpy(), qtype)
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.float().chunk(2, dim=1)
            raw[f"blk.{layer}.ffn_gate_exps.weight"] = store(gate.contiguous().numpy(), qtype)
            raw[f"blk.{layer}.ffn_up_exps.weight"] = store(up.contiguous().numpy(), qtype)
        elif name.endswith("mlp.experts.down_proj"):
            raw[f"blk.{layer}.ffn_down_exps.weight"] = store(t.float().numpy(), qtype)
        else:
            plain[name] = t

    class Dense:  # what write_gguf maps by name: everything but the router and experts
        config = c

        @staticmethod
        def state_dict() -> dict[str, torch.Tensor]:
            return plain

    moe_intermediate = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    kv = {"expert_count": ("uint32", experts), "expert_used_count": ("uint32", c.num_experts_per_tok),
          "expert_feed_forward_length": ("uint32", moe_intermediate)}
    raw = {name: value for name, value in raw.items() if name not in kwargs.get("skip", ())}
    return write_gguf(path, Dense(), qtype=qtype, raw=raw, extra_kv=kv, **kwargs)


def train_sentencepiece_tokenizer(folder: Path, dummy_prefix: bool = True) -> tuple[tokenizers.Tokenizer, Any]:
    """A SentencePiece BPE model with byte fallback, and its tokenizer.json as Llama 2 and Mistral ship it.

    sentencepiece trains ``folder/tokenizer.model`` (control tokens [INST] and
    [/INST], a user-defined <think>); transformers converts it (vocabulary,
    merges, added tokens); the normalizer is then the one Llama 2's and
    Mistral's tokenizer.json have (Gemma's, without the "\u2581" prefix, when
    ``dummy_prefix`` is off), and BOS is prepended. Returns the tokenizers
    backend and the ``SentencePieceProcessor``, the reference it must match.
    """
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS_LINES * 20),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        allow_whitespace_only_pieces=True,
        character_coverage=0.995,
        control_symbols=["[INST]", "[/INST]"],
        user_defined_symbols=["<think>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        minloglevel=2,
    )
    backend = LlamaTokenizer.from_pretrained(folder, legacy=True).backend_tokenizer
    prefix = [normalizers.Prepend("\u2581")] if dummy_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return backend, spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
