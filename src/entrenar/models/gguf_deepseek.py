"""DeepSeek-V3 GGUF files (llama.cpp's ``deepseek2`` architecture, which DeepSeek-V2/V3, Kimi-K2 and Moonlight
share) -> a transformers ``deepseek_v3`` config and HF-named weights.

What llama.cpp's converter (convert_hf_to_gguf.py, ``DeepseekV2Model``) writes, and how it is read back:

* Multi-head latent attention as MQA: ``attention.head_count_kv`` 1, ``attention.key_length``
  ``kv_lora_rank + qk_rope_head_dim`` and ``value_length`` ``kv_lora_rank``; the per-head sizes are
  ``attention.key_length_mla`` (``qk_nope_head_dim + qk_rope_head_dim``) and ``value_length_mla`` (``v_head_dim``),
  with ``attention.q_lora_rank`` (absent: a plain ``attn_q``) and ``attention.kv_lora_rank``.
* ``kv_b_proj`` split in two for the absorbed attention: ``attn_k_b`` ``[heads, kv_lora_rank, qk_nope_head_dim]``
  (each head's key part, transposed) and ``attn_v_b`` ``[heads, v_head_dim, kv_lora_rank]``; joined back here.
  Older files keep one ``attn_kv_b``, which is read as it is.
* Routing: ``expert_gating_func`` 2 (sigmoid; absent means DeepSeek-V2's softmax, refused), ``exp_probs_b`` (the
  correction bias), ``expert_group_count``/``expert_group_used_count``, ``expert_weights_scale``/``_norm``,
  ``expert_shared_count`` shared experts as ``ffn_*_shexp``, ``leading_dense_block_count`` dense first layers.
* RoPE: the converter keeps DeepSeek's interleaved rotary pairs (llama.cpp rotates adjacent pairs for this
  architecture), so the model reads them with ``rope_interleave``. YaRN's ``mscale_all_dim`` is written as
  ``rope.scaling.yarn_log_multiplier`` (0.1 x it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from entrenar.errors import ModelError

if TYPE_CHECKING:
    from gguf import ReaderTensor

ARCH = "deepseek2"
# GGUF layer tensor suffix -> HF suffix (besides the Llama names gguf.py knows: attn_q, attn_output, the norms,
# the dense MLP, the router and the stacked experts).
LAYER_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a.bias": "self_attn.q_a_proj.bias",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    # the two halves of kv_b_proj (not parameters: joined into it when read)
    "attn_k_b.weight": "self_attn.kv_b_proj.k_b",
    "attn_v_b.weight": "self_attn.kv_b_proj.v_b",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID


def hf_config(metadata: dict[str, Any], tensors: dict[str, ReaderTensor], path: Path) -> dict[str, Any]:
    """A transformers ``deepseek_v3`` config.json dict from a ``deepseek2`` file's metadata."""

    def get(key: str, default: Any = ...) -> Any:
        full = f"{ARCH}.{key}"
        if full in metadata:
            return metadata[full]
        if default is ...:
            raise ModelError(f"{path}: metadata key '{full}' is missing")
        return default

    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path}: tensor 'token_embd.weight' is missing")
    n_head = get("attention.head_count")
    if isinstance(n_head, list):
        raise ModelError(f"{path}: per-layer head counts ({ARCH}.attention.head_count arrays) are not supported")
    kv_rank, rope_dim = get("attention.kv_lora_rank"), get("rope.dimension_count")
    if get("attention.key_length", kv_rank + rope_dim) != kv_rank + rope_dim:
        raise ModelError(f"{path}: {ARCH}.attention.key_length must be kv_lora_rank + rope.dimension_count "
                         f"({kv_rank} + {rope_dim}) in llama.cpp's MLA layout")
    key_mla = get("attention.key_length_mla")
    if key_mla <= rope_dim:
        raise ModelError(f"{path}: {ARCH}.attention.key_length_mla ({key_mla}) must exceed rope.dimension_count "
                         f"({rope_dim})")
    experts = get("expert_count", 0)
    if not experts:
        raise ModelError(f"{path}: a {ARCH} file without experts ({ARCH}.expert_count) is not a DeepSeek-V3 model")
    gating = get("expert_gating_func", None)
    if gating != _SIGMOID:
        raise ModelError(f"{path}: {ARCH}.expert_gating_func is {gating!r}: only DeepSeek-V3's sigmoid routing (2) "
                         "is supported (absent or 1 is DeepSeek-V2's softmax routing)")
    embed_rows = int(tensors["token_embd.weight"].shape[-1])
    vocab = get("vocab_size", embed_rows)
    if vocab != embed_rows:
        raise ModelError(f"{path}: {ARCH}.vocab_size is {vocab} but token_embd.weight has {embed_rows} rows")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    extra_eos = [metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata]
    eos_ids = list(dict.fromkeys(([eos] if eos is not None else []) + extra_eos))
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(metadata, path),
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
        "q_lora_rank": get("attention.q_lora_rank", None) or None,
        "kv_lora_rank": kv_rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_mla - rope_dim,
        "v_head_dim": get("attention.value_length_mla"),
        "rope_interleave": True,
        "n_routed_experts": experts,
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "n_shared_experts": get("expert_shared_count", 0),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "routed_scaling_factor": get("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": get("expert_group_count", 1),
        "topk_group": get("expert_group_used_count", 1),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(metadata: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """YaRN as the converter writes it for DeepSeek (``mscale_all_dim`` from the log multiplier; DeepSeek-V3's
    ``mscale`` equals it), or None."""
    kind = metadata.get(f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ModelError(f"{path}: rope scaling type '{kind}' ({ARCH}.rope.scaling.type) is not supported")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": metadata[f"{ARCH}.rope.scaling.factor"]}
    original = metadata.get(f"{ARCH}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    log_mul = metadata.get(f"{ARCH}.rope.scaling.yarn_log_multiplier")
    if log_mul:
        scaling["mscale_all_dim"] = scaling["mscale"] = round(log_mul / 0.1, 6)
    return scaling


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape of every tensor a ``deepseek2`` file of this config holds (``kv_b_proj`` both as
    itself and as its two halves: a file has one layout or the other)."""
    h, i, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    rank, rope, nope, v = (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"],
                           config["v_head_dim"])
    q_rank, bias = config["q_lora_rank"], config["attention_bias"]
    e, ie = config["n_routed_experts"], config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["vocab_size"], h),
    }
    for n in range(config["num_hidden_layers"]):
        layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h),
            "self_attn.kv_a_layernorm.weight": (rank,),
            "self_attn.kv_b_proj.k_b": (heads, rank, nope),
            "self_attn.kv_b_proj.v_b": (heads, v, rank),
            "self_attn.kv_b_proj.weight": (heads * (nope + v), rank),
            "self_attn.o_proj.weight": (h, heads * v),
        }
        if q_rank is None:
            layer["self_attn.q_proj.weight"] = (heads * (nope + rope), h)
        else:
            layer.update({"self_attn.q_a_proj.weight": (q_rank, h), "self_attn.q_a_layernorm.weight": (q_rank,),
                          "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank)})
        if bias:
            layer["self_attn.kv_a_proj_with_mqa.bias"] = (rank + rope,)
            layer["self_attn.o_proj.bias"] = (h,)
            if q_rank is not None:
                layer["self_attn.q_a_proj.bias"] = (q_rank,)
        if n < config["first_k_dense_replace"]:
            layer.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
        else:
            layer.update({"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
                          "mlp.experts.gate_proj": (e, ie, h), "mlp.experts.up_proj": (e, ie, h),
                          "mlp.experts.down_proj": (e, h, ie)})
            if config["n_shared_experts"]:
                s = ie * config["n_shared_experts"]
                layer.update({"mlp.shared_experts.gate_proj.weight": (s, h),
                              "mlp.shared_experts.up_proj.weight": (s, h),
                              "mlp.shared_experts.down_proj.weight": (h, s)})
        shapes.update({f"model.layers.{n}.{k}": shape for k, shape in layer.items()})
    return shapes


def other_layout_present(hf_name: str, mapped: dict[str, Any]) -> bool:
    """Whether a missing ``kv_b_proj`` tensor is given in the other layout: the joined weight for its two halves,
    both halves for the joined weight."""
    base = hf_name.rsplit(".", 1)[0]
    if hf_name.endswith("kv_b_proj.weight"):
        return f"{base}.k_b" in mapped and f"{base}.v_b" in mapped
    if hf_name.endswith(("kv_b_proj.k_b", "kv_b_proj.v_b")):
        return f"{base}.weight" in mapped
    return False


def joined_name(hf_name: str) -> str | None:
    """``...kv_b_proj.weight`` for a half of it (``...kv_b_proj.k_b``/``.v_b``), else None."""
    if hf_name.endswith(("kv_b_proj.k_b", "kv_b_proj.v_b")):
        return hf_name.rsplit(".", 1)[0] + ".weight"
    return None


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``kv_b_proj.weight`` ``[heads x (qk_nope + v), kv_lora_rank]`` from llama.cpp's halves: ``k_b``
    ``[heads, kv_lora_rank, qk_nope]`` (transposed per head) and ``v_b`` ``[heads, v, kv_lora_rank]``."""
    joined = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
    return joined.reshape(-1, joined.shape[-1]).contiguous()
