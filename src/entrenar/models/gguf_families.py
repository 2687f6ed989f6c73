"""What each family's GGUF files name and lay out otherwise than Llama's, as llama.cpp's convert_hf_to_gguf.py
writes them: the one place :mod:`entrenar.models.gguf` (reading) and :mod:`entrenar.export.gguf_write` (writing)
take these tables from.

* ``ARCH_LAYER_NAMES``: where an architecture's llama.cpp layer names mean other modules than Llama's. Phi-3
  keeps its fused projections (``attn_qkv``; ``ffn_up`` is gate_up_proj, gate rows first), OLMo 2 its norms after
  attention and MLP, Gemma its four norms (``ffn_norm`` the norm before the MLP, ``post_attention_norm`` the norm
  of the attention output), GLM-4 its fused ``ffn_up`` and its norms after attention and MLP, gpt-oss its sinks,
  router and expert biases.
* ``PERMUTED_QK``: the architectures whose q/k rows the converter permutes (LlamaModel and its subclasses:
  Granite, SmolLM3).
* ``smollm3``: Llama's tensors; the layers without RoPE are not in the file (llama.cpp fixes them at every fourth
  layer, as SmolLM3's ``no_rope_layer_interval`` default).
* ``glm4``: ``rope.dimension_count`` is the rotated part of a head (partial rotary); q/k rows are stored as
  Hugging Face has them (GLM-4 turns interleaved pairs, llama.cpp's "normal" RoPE).
* ``gpt-oss``: ``attn_sinks``; the router (``ffn_gate_inp``, with a bias); the experts de-interleaved and split
  into ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I], each with a bias, MXFP4 or
  float; ``post_attention_norm`` is the norm before the MLP; YaRN RoPE; sliding and full layers alternate.
  Its tensors are handed on in the Hugging Face checkpoint's own layout (:mod:`entrenar.models.gpt_oss_layout`
  takes them from there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from entrenar.errors import ModelError

# GGUF architecture -> model_type, and model_type -> the architectures entry of config.json
FAMILY_ARCHITECTURES = {"smollm3": "smollm3", "glm4": "glm4", "gpt-oss": "gpt_oss"}
FAMILY_HF_ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM", "glm4": "Glm4ForCausalLM",
                           "gpt_oss": "GptOssForCausalLM"}
# convert_hf_to_gguf.py permutes q/k rows for LlamaModel and its subclasses; the others keep HF's order.
PERMUTED_QK = ("llama", "granite", "smollm3")

# Gemma's norms as llama.cpp names them. convert_hf_to_gguf.py stores every Gemma norm weight plus one (the 1 + w
# of Gemma's RMSNorm): models/gguf.py reads them back minus one, the writer adds it.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp layer tensor names that mean other modules in these architectures (the others: Llama's, in
# models/gguf.py's _LAYER_NAMES)
ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    **{arch: _GEMMA_LAYER_NAMES for arch in GEMMA_ARCHITECTURES},
    "glm4": {"ffn_up.weight": "mlp.gate_up_proj.weight",
             "post_attention_norm.weight": "post_self_attn_layernorm.weight",
             "post_ffw_norm.weight": "post_mlp_layernorm.weight"},
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "attn_sinks.weight": "self_attn.sinks",
                "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias", "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
                "ffn_down_exps.weight": "mlp.experts.down_proj_gguf",
                "ffn_down_exps.bias": "mlp.experts.down_proj_bias"},
}


def family_config(metadata: dict[str, Any], arch: str, head_dim: int, path: Path) -> dict[str, Any]:
    """The config.json keys these architectures add (empty for others)."""
    if arch == "glm4":
        rotary = metadata.get("glm4.rope.dimension_count", head_dim // 2)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise ModelError(f"{path}: glm4.rope.dimension_count is {rotary}; head_dim is {head_dim}")
        return {"partial_rotary_factor": rotary / head_dim}
    if arch != "gpt-oss":
        return {}
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window"):
        if f"gpt-oss.{key}" not in metadata:
            raise ModelError(f"{path}: metadata key 'gpt-oss.{key}' is missing")
    config: dict[str, Any] = {
        "num_local_experts": metadata["gpt-oss.expert_count"],
        "num_experts_per_tok": metadata["gpt-oss.expert_used_count"],
        "intermediate_size": metadata["gpt-oss.expert_feed_forward_length"],
        "sliding_window": metadata["gpt-oss.attention.sliding_window"],
    }
    return config


def family_rope(metadata: dict[str, Any], arch: str, scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """gpt-oss's YaRN as its config.json has it: the converter's beta keys, and no truncation of the ramp."""
    if arch != "gpt-oss" or not scaling or scaling.get("rope_type") != "yarn":
        return scaling
    scaling = {**scaling, "truncate": False}
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
        if f"gpt-oss.rope.scaling.{key}" in metadata:
            scaling[hf_key] = metadata[f"gpt-oss.rope.scaling.{key}"]
    return scaling


def family_shapes(layer: dict[str, tuple[int, ...]], config: dict[str, Any], arch: str) -> None:
    """Adjust one layer's expected HF-named shapes (:func:`entrenar.models.gguf._expected_shapes`) in place."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    if arch == "glm4":
        del layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]
        layer.pop("self_attn.o_proj.bias", None)
        layer.update({"mlp.gate_up_proj.weight": (2 * i, h), "post_self_attn_layernorm.weight": (h,),
                      "post_mlp_layernorm.weight": (h,)})
    if arch == "gpt-oss":
        e = config["num_local_experts"]
        for name in [n for n in layer if n.startswith("mlp.")]:
            del layer[name]
        layer.update({"self_attn.sinks": (config["num_attention_heads"],), "mlp.router.weight": (e, h),
                      "mlp.router.bias": (e,), "mlp.experts.gate_proj": (e, i, h), "mlp.experts.up_proj": (e, i, h),
                      "mlp.experts.gate_proj_bias": (e, i), "mlp.experts.up_proj_bias": (e, i),
                      "mlp.experts.down_proj_gguf": (e, h, i), "mlp.experts.down_proj_bias": (e, h)})
    del d  # the attention shapes are Llama's


def gpt_oss_checkpoint_tensors(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss GGUF's (HF-named) tensors in its Hugging Face checkpoint's layout: gate and up (weights, biases)
    interleaved again into ``gate_up_proj`` [E, H, 2I] / ``gate_up_proj_bias``, ``down_proj`` as [E, I, H]."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        prefix, _, rest = name.rpartition(".mlp.experts.")
        if not prefix:
            yield name, tensor
            continue
        base = f"{prefix}.mlp.experts."
        if rest == "down_proj_gguf":
            yield base + "down_proj", tensor.transpose(1, 2)
            continue
        if rest == "down_proj_bias":
            yield name, tensor
            continue
        kind = "gate_up_proj_bias" if rest.endswith("_bias") else "gate_up_proj"
        other = base + ("up" if rest.startswith("gate") else "gate") + rest.removeprefix("gate").removeprefix("up")
        if other not in pending:
            pending[name] = tensor
            continue
        gate, up = (tensor, pending.pop(other)) if rest.startswith("gate") else (pending.pop(other), tensor)
        fused = torch.stack([gate, up], dim=2).flatten(1, 2)  # rows (or columns) gate, up, gate, up...
        yield base + kind, fused if kind.endswith("_bias") else fused.transpose(1, 2)
    if pending:
        raise ModelError(f"gpt-oss expert tensor '{next(iter(pending))}' has no gate/up partner")
