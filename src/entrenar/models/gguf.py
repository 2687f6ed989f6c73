"""GGUF files (llama.cpp's format) -> transformers-style config, HF-named weights, tokenizer.

A GGUF file holds metadata (architecture hyper-parameters, the tokenizer's
vocabulary, merges and special ids, the chat template) and tensors under
llama.cpp's names, often block-quantized. ``read_gguf`` turns it into what the
rest of entrenar speaks: a config.json-style dict, tensors named as Hugging
Face names them (dequantized one at a time, so a loader - or QLoRA's NF4
quantizer - never holds the whole model in 16 bits), and a ``Tokenizer``.

Three things llama.cpp's converter (convert_hf_to_gguf.py) changes, and which
are undone here:

* For the ``llama`` architecture it permutes the rows of q_proj and k_proj
  (interleaved rather than half-split RoPE pairs). We invert that exactly.
* Llama 3.1/3.2 RoPE scaling is not written as metadata but baked into a
  ``rope_freqs.weight`` tensor of per-frequency divisors. We recover the
  ``rope_scaling`` dict that produces those divisors, and refuse the file if
  none does.
* The tokenizer is stored as lists (tokens, merges, scores, types) plus the
  name of a pre-tokenizer; we rebuild the ``tokenizers.Tokenizer`` from them.

Dequantization uses ``gguf.quants.dequantize`` (numpy), the reference
implementation published with the format.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError
from entrenar.models import gguf_deepseek
from entrenar.models.config import ModelConfig
from entrenar.models.hf import Sinks, empty_model, load_state_into

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

    from entrenar.models.transformer import Transformer

# GGUF architecture -> transformers model_type. llama.cpp stores Mistral under "llama".
# Mixtral is "llama" with expert_count set; Qwen3-MoE is "qwen3moe".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "olmo2", "granite", "deepseek2", "gemma2",
                           "gemma3")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Gemma's norms as llama.cpp names them (its ffn_norm is the norm before the MLP, as Llama's, but
# post_attention_layernorm is Gemma's norm of the attention output). convert_hf_to_gguf.py stores every Gemma norm
# weight plus one (the 1 + w of Gemma's RMSNorm): read back minus one.
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp (llama-model.cpp) fixes what Gemma's GGUF files do not say: every 2nd (Gemma 2) or 6th (Gemma 3) layer
# global, Gemma 3's sliding layers at RoPE base 10000, and the attention scale 1/sqrt(hidden / heads) for the 27B
# models (46 and 62 layers), 1/sqrt(head_dim) for the others.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# GGUF tensor name -> HF name. "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    # MoE layers: the router, and every expert's projection stacked [experts, out, in] in one tensor each
    # (models/hf.py's load_state_into puts gate and up into the model's fused gate_up_proj).
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# Where an architecture's llama.cpp names mean other modules: Phi-3 keeps its fused projections (``ffn_up`` is
# gate_up_proj, gate rows first), OLMo 2 its norms after attention and MLP, Gemma its four norms.
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
_ARCH_LAYER_NAMES.update({arch: _GEMMA_LAYER_NAMES for arch in _GEMMA_ARCHITECTURES})
_LAYER_NAMES.update(gguf_deepseek.LAYER_NAMES)  # DeepSeek-V3's (llama.cpp's deepseek2) MLA and shared experts
# Read into the config, not part of the state dict.
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope
# Architectures whose q/k rows convert_hf_to_gguf.py permutes (LlamaModel and its subclasses).
_PERMUTED = ("llama", "granite")


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (in architecture ``arch``), or None if it is not one we
    know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch or "", {})}
    if prefix == "blk" and layer.isdigit() and suffix in names:
        return f"model.layers.{int(layer)}.{names[suffix]}"
    return None


def gguf_tensor_name(hf_name: str, arch: str | None = None) -> str:
    """The llama.cpp name of a Hugging Face tensor name in architecture ``arch`` (inverse of ``hf_tensor_name``)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    layer, _, suffix = hf_name.removeprefix("model.layers.").partition(".")
    for gguf_suffix, name in [*_ARCH_LAYER_NAMES.get(arch or "", {}).items(), *_LAYER_NAMES.items()]:
        if name == suffix and layer.isdigit():
            return f"blk.{layer}.{gguf_suffix}"
    raise KeyError(hf_name)


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf.py's q/k permutation for the llama architecture.

    The converter stores ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``
    (each head's two RoPE halves interleaved row by row); this puts the rows
    back in Hugging Face's half-split order. Works on weights and biases.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot undo the q/k row permutation: {rows} rows is not a multiple of 2 x {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- reading the file ----------------------------------------------------------


@dataclass
class GGUFModel:
    """A parsed GGUF file: its config, its tensors under HF names, its tokenizer.

    Tensors are read lazily from the memory-mapped file: ``tensors()`` yields
    them one at a time, dequantized, so peak memory is one tensor.
    """

    path: Path
    hf_config: dict[str, Any]
    chat_template: str | None
    metadata: dict[str, Any] = field(repr=False)
    # HF name -> the reader's tensor (a view of the memory-mapped file), in file order.
    _tensors: dict[str, ReaderTensor] = field(repr=False)

    def tensor_names(self) -> list[str]:
        """HF names of the weights in the file, in file order."""
        return list(dict.fromkeys(gguf_deepseek.joined_name(n) or n for n in self._tensors))

    def quant_types(self) -> dict[str, str]:
        """HF name -> GGML storage type (e.g. ``"Q4_K"``, ``"F32"``)."""
        return {gguf_deepseek.joined_name(name) or name: t.tensor_type.name for name, t in self._tensors.items()}

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One weight by its HF name, dequantized to ``dtype``, q/k rows in HF order."""
        halves = [f"{name.removesuffix('.weight')}.{h}" for h in ("k_b", "v_b")]
        if name not in self._tensors and all(h in self._tensors for h in halves):  # DeepSeek's split kv_b_proj
            return gguf_deepseek.join_kv_b(*(self.tensor(h, dtype) for h in halves))
        if name not in self._tensors:
            raise ModelError(f"{self.path}: no tensor '{name}' (the file has {len(self._tensors)} tensors)")
        t = self._tensors[name]
        w = _dequantize(t, self.path).to(dtype)
        if self.metadata["general.architecture"] in _GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            w = w - 1  # stored as 1 + w (see _GEMMA_LAYER_NAMES)
        if self.metadata["general.architecture"] in _PERMUTED:
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                w = unpermute_rope_rows(w, self.hf_config["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                w = unpermute_rope_rows(w, self.hf_config["num_key_value_heads"])
        return w

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one tensor at a time, layer by layer."""
        for name in self.tensor_names():
            yield name, self.tensor(name, dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """All weights at once. A tied model has no ``lm_head.weight`` (as in HF checkpoints)."""
        return dict(self.tensors(dtype))

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer rebuilt from the GGUF vocabulary (built on first use)."""
        m = self.metadata
        eos = m.get("tokenizer.ggml.eos_token_id")
        extra_eos = [m[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in m]
        unk = m.get("tokenizer.ggml.unknown_token_id")
        return Tokenizer(
            build_tokenizer(m, self.path),
            bos_token=m.get("tokenizer.ggml.bos_token_id"),
            eos_token=eos,
            pad_token=m.get("tokenizer.ggml.padding_token_id"),
            unk_token=unk,
            extra_eos_ids=[i for i in extra_eos if i != eos],
            chat_template=self.chat_template,
        )


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file: parse its metadata into a transformers-style config and
    map its tensors to HF names, checking that every tensor the config implies is
    there with the right shape. Tensors are not read until asked for."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such GGUF file")
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - depends on the environment
        raise ModelError("reading GGUF files needs the 'gguf' package: pip install 'entrenar[gguf]'") from None
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ModelError(f"{path}: not a readable GGUF file ({e})") from None

    metadata = _read_metadata(reader)
    if metadata.get("general.type", "model") != "model":
        raise ModelError(
            f"{path}: general.type is '{metadata['general.type']}', not 'model' (adapter GGUFs are not base models)"
        )
    if metadata.get("split.count", 1) > 1:
        raise ModelError(
            f"{path}: split GGUF files (split.count={metadata['split.count']}) are not supported; "
            "merge them with llama-gguf-split --merge"
        )
    by_gguf_name = {t.name: t for t in reader.tensors}
    hf_config = build_hf_config(metadata, by_gguf_name, path)
    tensors = _map_tensors(by_gguf_name, hf_config, metadata["general.architecture"], path)
    return GGUFModel(
        path=path,
        hf_config=hf_config,
        chat_template=metadata.get("tokenizer.chat_template"),
        metadata=metadata,
        _tensors=tensors,
    )


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", sinks: Sinks | None = None
) -> tuple[Transformer, Tokenizer]:
    """A native ``Transformer`` and its ``Tokenizer`` from a GGUF file, loaded tensor by tensor; ``sinks`` as in
    :func:`entrenar.models.hf.empty_model` (an NF4 base: :func:`entrenar.quant.nf4.sinks.nf4_sinks`)."""
    gguf_model = read_gguf(path)
    config = ModelConfig.from_hf(gguf_model.hf_config, source=str(gguf_model.path))
    if sinks is not None and config.is_moe:
        raise ModelError(f"{gguf_model.path}: an NF4 base of an MoE GGUF file is not supported (its experts are "
                         "stacked); load the Hugging Face folder for QLoRA")
    model = empty_model(config, dtype, device, sinks)
    name = gguf_model.path.name
    load_state_into(model, ((name, n, t) for n, t in gguf_model.tensors(dtype)), str(gguf_model.path.parent))
    return model, gguf_model.tokenizer


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (strings, numbers, lists)."""
    from gguf import GGUFValueType

    metadata: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = f.contents()
        if f.types and f.types[0] == GGUFValueType.FLOAT32:
            value = _float32_to_decimal(value)
        metadata[key] = value
    return metadata


def _float32_to_decimal(x: float) -> float:
    """The shortest decimal that is the same float32: 1e-5 stored in float32 reads
    back as 9.99999974e-06; config.json said 1e-05."""
    return float(str(np.float32(x)))


def _dequantize(t: ReaderTensor, path: Path) -> torch.Tensor:
    """A tensor of the file as a torch tensor in its torch shape (reversed GGML dims)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    kind = t.tensor_type
    # F32/F16/BF16 are converted exactly without numpy's float32 detour.
    if kind == Q.F32:
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(shape)
    if kind == Q.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16)).reshape(shape)
    if kind == Q.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    try:
        values = dequantize(t.data, kind)
    except NotImplementedError:
        raise ModelError(f"{path}: tensor '{t.name}' is stored as {kind.name}, which cannot be dequantized") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


# -- config -------------------------------------------------------------------


def build_hf_config(metadata: dict[str, Any], tensors: dict[str, ReaderTensor], path: Path) -> dict[str, Any]:
    """A transformers config.json dict from GGUF metadata (and tensor presence/shapes)."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelError(f"{path}: metadata key 'general.architecture' is missing")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{path}: GGUF architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if arch == gguf_deepseek.ARCH:
        return gguf_deepseek.hf_config(metadata, tensors, path)

    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full in metadata:
            return metadata[full]
        if default is ...:
            raise ModelError(f"{path}: metadata key '{full}' is missing")
        return default

    experts = get("expert_count", 0)
    if experts and arch not in ("llama", "qwen3moe"):
        raise ModelError(f"{path}: mixture-of-experts {arch} models ({arch}.expert_count={experts}) are not supported")
    if arch == "qwen3moe" and not experts:
        raise ModelError(f"{path}: a qwen3moe file without {arch}.expert_count")
    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path}: tensor 'token_embd.weight' is missing")

    hidden = get("embedding_length")
    n_head = get("attention.head_count")
    n_kv_head = get("attention.head_count_kv", n_head)
    if isinstance(n_head, list) or isinstance(n_kv_head, list):
        raise ModelError(f"{path}: per-layer head counts ({arch}.attention.head_count[_kv] arrays) are not supported")
    head_dim = get("attention.key_length", hidden // n_head)
    if get("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{path}: {arch}.attention.value_length differs from key_length; not a Llama-family model")
    rotary_dims = get("rope.dimension_count", head_dim)
    if arch != "phi3" and rotary_dims != head_dim:
        raise ModelError(
            f"{path}: partial rotary embeddings are not supported "
            f"({arch}.rope.dimension_count={get('rope.dimension_count')}, head_dim={head_dim})"
        )
    embed_rows = int(tensors["token_embd.weight"].shape[-1])  # GGML dims are reversed: [hidden, vocab]
    vocab = get("vocab_size", embed_rows)
    if vocab != embed_rows:
        raise ModelError(f"{path}: {arch}.vocab_size is {vocab} but token_embd.weight has {embed_rows} rows")
    rope_theta = get("rope.freq_base", 10000.0)

    model_type = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(arch, arch)
    name = f"{metadata.get('general.name', '')} {metadata.get('general.basename', '')}".lower()
    if arch == "llama" and experts:
        model_type = "mixtral"
    elif arch == "llama" and "mistral" in name:
        model_type = "mistral"

    eos = metadata.get("tokenizer.ggml.eos_token_id")
    extra_eos = [metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata]
    eos_ids = list(dict.fromkeys(([eos] if eos is not None else []) + extra_eos))

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_HF_ARCHITECTURES[model_type]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch, tensors, rope_theta, head_dim, path),
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if model_type == "mistral":
        config["sliding_window"] = None  # llama.cpp keeps no sliding window for Mistral
    config.update(_family_config(metadata, arch, tensors, rotary_dims, head_dim, path))
    if arch in _GEMMA_ARCHITECTURES:
        config.update(_gemma_config(arch, config, get))
    if experts:
        # llama.cpp renormalises the chosen experts' weights for both (Mixtral always does; Qwen3-MoE's
        # released models set norm_topk_prob), unless expert_weights_norm says otherwise.
        config.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                      norm_topk_prob=bool(get("expert_weights_norm", True)))
        if model_type == "mixtral":
            config["intermediate_size"] = get("expert_feed_forward_length", config["intermediate_size"])
        else:
            config["moe_intermediate_size"] = get("expert_feed_forward_length")
    return config


def _family_config(metadata: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], rotary_dims: int,
                   head_dim: int, path: Path) -> dict[str, Any]:
    """config.json keys of Phi-3 (partial rotary, longrope from its factor tensors, sliding window) and Granite
    (its multipliers, written as ``*_scale`` keys by convert_hf_to_gguf.py); OLMo 2 needs none."""
    out: dict[str, Any] = {}
    if arch == "granite":
        for key, hf_key in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                            ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling")):
            if f"{arch}.{key}" in metadata:
                out[hf_key] = metadata[f"{arch}.{key}"]
    if arch != "phi3":
        return out
    if rotary_dims <= 0 or rotary_dims > head_dim or rotary_dims % 2:
        raise ModelError(f"{path}: phi3.rope.dimension_count is {rotary_dims}; head_dim is {head_dim}")
    out["partial_rotary_factor"] = rotary_dims / head_dim
    out["sliding_window"] = metadata.get("phi3.attention.sliding_window") or None  # 0: none (Phi-4)
    present = [name for name in _LONGROPE_FACTORS if name in tensors]
    if present and len(present) < 2:
        raise ModelError(f"{path}: '{present[0]}' without its pair; longrope needs both rope_factors tensors")
    if present:
        long, short = (_dequantize(tensors[name], path).double().tolist() for name in _LONGROPE_FACTORS)
        original = metadata.get("phi3.rope.scaling.original_context_length")
        if original is None:
            raise ModelError(f"{path}: longrope factors without 'phi3.rope.scaling.original_context_length'")
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings": original}
        if "phi3.rope.scaling.attn_factor" in metadata:
            out["rope_scaling"]["attention_factor"] = metadata["phi3.rope.scaling.attn_factor"]
        out["original_max_position_embeddings"] = original
    return out


def gemma_layout(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What llama.cpp assumes of a gemma2/gemma3 file of this shape, under ModelConfig's names (see
    _GEMMA_GLOBAL_EVERY); GGUF export refuses a model that differs."""
    every = _GEMMA_GLOBAL_EVERY[arch]
    return {
        "layer_types": tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)),
        "query_pre_attn_scalar": float(hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim),
        "rope_local_theta": 10_000.0 if arch == "gemma3" else None,
        "tie_word_embeddings": True,  # Gemma 2's llama.cpp graph has no output tensor; Gemma 3's may
    }


def _gemma_config(arch: str, config: dict[str, Any], get: Any) -> dict[str, Any]:
    """config.json's Gemma keys from a llama.cpp gemma2/gemma3 file, filled in as llama.cpp does (see
    _GEMMA_GLOBAL_EVERY)."""
    layout = gemma_layout(arch, config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
                          config["head_dim"])
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": layout["query_pre_attn_scalar"],
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "attn_logit_softcapping": get("attn_logit_softcapping", None) if arch == "gemma2" else None,
        "sliding_window": get("attention.sliding_window", 4096 if arch == "gemma2" else ...),
        "layer_types": list(layout["layer_types"]),
    }
    if arch == "gemma3":
        out["rope_local_base_freq"] = layout["rope_local_theta"]
    return out


def _rope_scaling(
    metadata: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], theta: float, head_dim: int, path: Path
) -> dict[str, Any] | None:
    """transformers' rope_scaling dict, from ``{arch}.rope.scaling.*`` keys or a ``rope_freqs.weight`` tensor."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor is None:
        raise ModelError(f"{path}: {arch}.rope.scaling.type is '{kind}' but '{arch}.rope.scaling.factor' is missing")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling
    if kind != "none":
        raise ModelError(f"{path}: rope scaling type '{kind}' ({arch}.rope.scaling.type) is not supported")
    if _ROPE_FREQS in tensors:
        divisors = _dequantize(tensors[_ROPE_FREQS], path).double().numpy()
        return llama3_rope_scaling_from_divisors(divisors, theta, head_dim, path)
    return None


def llama3_rope_scaling_from_divisors(
    divisors: np.ndarray, theta: float, head_dim: int, path: Path | str = "<gguf>"
) -> dict[str, Any] | None:
    """Recover Llama 3.1's ``rope_scaling`` from llama.cpp's per-frequency divisors.

    The converter writes, per frequency with wavelength w:
    1 if w < L/high, ``factor`` if w > L/low, else ``1 / ((1 - s)/factor + s)``
    with ``s = (L/w - low) / (high - low)``. Every released Llama 3 model uses
    low=1, high=4, so ``factor`` is the largest divisor and L (the original
    context length) follows from any divisor in the blended band. The result is
    checked by recomputing all divisors; a file they do not match is refused
    rather than run with the wrong positions.
    """
    if divisors.shape != (head_dim // 2,):
        raise ModelError(f"{path}: {_ROPE_FREQS} has shape {divisors.shape}, expected ({head_dim // 2},)")
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    low, high = 1.0, 4.0
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq

    def divisors_for(context: float) -> np.ndarray:
        smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
        return 1.0 / ((1 - smooth) / factor + smooth)

    blended = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if blended.any():
        smooth = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
        candidates = [float(round(np.median(wavelen[blended] * (low + smooth * (high - low)))))]
    else:  # only the band edges are seen: any L between them fits; prefer Llama 3's 8192
        candidates = [8192.0] + [2.0**k for k in range(8, 21)]
    for context in candidates:
        if np.allclose(divisors_for(context), divisors, rtol=1e-4, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(context),
            }
    raise ModelError(
        f"{path}: {_ROPE_FREQS} does not match Llama 3 rope scaling (low_freq_factor=1, high_freq_factor=4); "
        "cannot reproduce its positions"
    )


def _map_tensors(
    tensors: dict[str, ReaderTensor], config: dict[str, Any], arch: str, path: Path
) -> dict[str, ReaderTensor]:
    """HF name -> tensor, after checking the file has exactly the tensors (and shapes) the config implies."""
    expected = _expected_shapes(config, arch)
    mapped: dict[str, ReaderTensor] = {}
    for gguf_name, t in tensors.items():
        if gguf_name == _ROPE_FREQS or (arch == "phi3" and gguf_name in _LONGROPE_FACTORS):
            continue
        hf_name = hf_tensor_name(gguf_name, arch)
        if hf_name is None or hf_name not in expected:
            raise ModelError(f"{path}: unexpected tensor '{gguf_name}' for a {arch} model of this configuration")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[hf_name]:
            raise ModelError(
                f"{path}: tensor '{gguf_name}' has shape {shape}, expected {expected[hf_name]} from the metadata"
            )
        mapped[hf_name] = t
    for hf_name in expected:
        if hf_name not in mapped and not (hf_name == "lm_head.weight" and config["tie_word_embeddings"]) \
                and not gguf_deepseek.other_layout_present(hf_name, mapped):
            raise ModelError(f"{path}: tensor '{gguf_tensor_name(hf_name, arch)}' ({hf_name}) is missing")
    return mapped


def _expected_shapes(config: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape of every weight a model of this config has."""
    if arch == gguf_deepseek.ARCH:
        return gguf_deepseek.expected_shapes(config)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["vocab_size"], h),
    }
    qkv_bias = arch == "qwen2" or config["attention_bias"]
    o_bias = arch != "qwen2" and config["attention_bias"]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        if qkv_bias:
            layer.update(
                {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
            )
        if o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if config["mlp_bias"]:
            layer.update({"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)})
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        if arch == "phi3":  # fused projections under their own names
            for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "mlp.gate_proj.weight", "mlp.up_proj.weight"):
                del layer[name]
            layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * i, h)})
        if arch == "olmo2":  # norms after attention and MLP; q/k norms over the whole projection
            del layer["input_layernorm.weight"]
            layer.update({"post_feedforward_layernorm.weight": (h,), "self_attn.q_norm.weight": (q,),
                          "self_attn.k_norm.weight": (kv,)})
        if arch in _GEMMA_ARCHITECTURES:
            layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        if config.get("num_experts"):  # every layer of these files is an MoE layer
            e, ie = config["num_experts"], config.get("moe_intermediate_size") or i
            for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                del layer[name]
            layer.update({"mlp.gate.weight": (e, h), "mlp.experts.gate_proj": (e, ie, h),
                          "mlp.experts.up_proj": (e, ie, h), "mlp.experts.down_proj": (e, h, ie)})
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


# -- tokenizer ----------------------------------------------------------------

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> family of pre-tokenizer (as llama.cpp's llama-vocab.cpp groups them).
_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "smollm": "starcoder",
    "starcoder": "starcoder",
    "refact": "starcoder",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
    "dbrx": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
}


def build_tokenizer(metadata: dict[str, Any], path: Path | str = "<gguf>") -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to the one the GGUF vocabulary was converted from.

    ``tokenizer.ggml.model`` "gpt2" is byte-level BPE (merges given; the
    pre-tokenizer named by ``tokenizer.ggml.pre``); "llama" is SentencePiece
    BPE with byte fallback, its merges recovered from the token scores (the
    order llama.cpp merges in). Control tokens become special added tokens,
    user-defined ones plain added tokens, so both are matched whole in text.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelError(
            f"{path}: no tokenizer in the file (metadata keys 'tokenizer.ggml.model'/'tokenizer.ggml.tokens' missing)"
        )
    types = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, types, path)
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, types, path)
    else:
        raise ModelError(f"{path}: tokenizer.ggml.model '{kind}' is not supported (supported: gpt2, llama)")
    _add_special_tokens(backend, tokens, types)
    _set_post_processor(backend, metadata, kind, tokens, path)
    return backend


def _byte_level_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], path: Path | str
) -> tokenizers.Tokenizer:

    pre = metadata.get("tokenizer.ggml.pre", "default")
    family = _PRE_TOKENIZERS.get(pre)
    if family is None:
        raise ModelError(
            f"{path}: tokenizer.ggml.pre '{pre}' is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelError(f"{path}: byte-level BPE tokenizer without 'tokenizer.ggml.merges'")
    # [PADn] placeholders the converter writes for ids past the tokenizer's vocabulary are not tokens.
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind != _UNUSED}
    pairs = []
    for n, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ModelError(f"{path}: tokenizer.ggml.merges[{n}] = {merge!r} is not two tokens separated by one space")
        pairs.append((left, right))
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=pairs, ignore_merges=family == "llama3", fuse_unk=False))

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "starcoder":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], path: Path | str
) -> tokenizers.Tokenizer:

    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelError(f"{path}: SentencePiece tokenizer needs 'tokenizer.ggml.scores' with one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, scores, types)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    # Like llama.cpp (and HF's "legacy" Llama tokenizer), the space prefix goes before
    # every piece of text, including text right after a special token.
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a normal token into
    two tokens, best-scoring result first (SentencePiece merges the pair whose union scores highest)."""
    ids = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (_NORMAL, _USER_DEFINED)}
    found = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ]
    # Every one is already in the model's vocabulary, so these keep their GGUF ids.
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _set_post_processor(
    backend: tokenizers.Tokenizer, metadata: dict[str, Any], kind: str, tokens: list[str], path: Path | str
) -> None:
    """BOS/EOS insertion as the file's add_bos_token/add_eos_token flags say.

    Without a flag, llama.cpp adds BOS for SentencePiece vocabularies; for
    byte-level ones we follow transformers' GPT-2 convention (no BOS)."""

    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    specials = []
    for flag, what, key in (
        (add_bos, "BOS", "tokenizer.ggml.bos_token_id"),
        (add_eos, "EOS", "tokenizer.ggml.eos_token_id"),
    ):
        if flag:
            if key not in metadata:
                raise ModelError(f"{path}: the tokenizer adds {what} but '{key}' is missing")
            specials.append((tokens[metadata[key]], metadata[key]))
    if not specials:
        return

    def segment(sequence: str, type_id: int) -> list[str]:
        bos = [f"{specials[0][0]}:{type_id}"] if add_bos else []
        eos = [f"{specials[-1][0]}:{type_id}"] if add_eos else []
        return bos + [f"${sequence}:{type_id}"] + eos

    single = " ".join(segment("A", 0))
    pair = " ".join(segment("A", 0) + segment("B", 1))
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=list(dict.fromkeys(specials)),  # BOS may equal EOS
    )
