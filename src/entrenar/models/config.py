"""One configuration for the Llama-style decoder family.

Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a handful of
flags (biases, q/k norms, RoPE scaling, tied embeddings), so one dataclass and
one model implementation cover them all, as in litgpt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, overload

import torch

from entrenar.errors import ModelError
from entrenar.models import rope_scaling
from entrenar.models.rope_scaling import ROPE_SCALING_TYPES

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                      "smollm3", "glm4", "gpt_oss")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
ROUTER_SCORINGS = ("softmax", "softmax_topk", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", *ROPE_SCALING_TYPES)


@dataclass
class ModelConfig:
    """Shape and variant flags of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v only
    o_bias: bool = False  # Llama's attention_bias puts one on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qk_norm_full: bool = False  # OLMoE: that RMSNorm is over the whole q (k) projection instead of per head
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    # Mixture of experts (models/moe.py); num_experts == 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # each expert's; None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1 (Mixtral always does)
    router_scoring: str = "softmax"  # softmax | softmax_topk (GPT-OSS) | sigmoid (DeepSeek-V3)
    router_bias: bool = False  # a bias on the router's linear layer (it changes scores and weights)
    n_group: int = 1  # grouped top-k (DeepSeek-V3): experts in n_group groups, top topk_group groups kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' weights multiplied by this (DeepSeek)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(linear(x)) scales the shared expert; DeepSeek: ungated
    first_k_dense: int = 0  # DeepSeek's first_k_dense_replace: the first k layers keep a dense MLP
    decoder_sparse_step: int = 1  # Qwen-MoE: layer i is MoE when (i + 1) % step == 0
    mlp_only_layers: tuple[int, ...] = ()  # Qwen-MoE: layers that keep a dense MLP
    sliding_window: int | None = None
    # Per-layer attention (gpt-oss, SmolLM3): "sliding_attention" layers use sliding_window, "full_attention" ones
    # none; None: every layer uses sliding_window (Mistral).
    layer_types: tuple[str, ...] | None = None
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: 0 where a layer has no RoPE (empty: RoPE everywhere)
    partial_rotary_factor: float = 1.0  # GLM-4: RoPE on the first head_dim x factor dimensions of each head
    rope_interleaved: bool = False  # GLM-4: RoPE turns pairs (2i, 2i + 1), not (i, i + dim / 2)
    post_block_norms: bool = False  # GLM-4: RMSNorm on the attention's and the MLP's outputs before each residual
    fused_gate_up: bool = False  # GLM-4: one mlp.gate_up_proj [2I, H], gate rows first
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    expert_bias: bool = False  # gpt-oss: biases on the experts' gate_up and down products
    expert_activation: str = "silu"  # silu | clamped_swiglu (gpt-oss: clamped gate and up, (up + 1) * glu)
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, |up| <= limit
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"model config: '{name}' must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_FAMILIES:
            raise ModelError(
                f"unknown model family '{self.model_type}' (supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self._check_layer_flags()
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                 f"1..num_experts ({self.num_experts})")
            if self.router_scoring not in ROUTER_SCORINGS:
                raise ModelError(f"model config: router scoring '{self.router_scoring}' is not supported "
                                 f"(supported: {', '.join(ROUTER_SCORINGS)})")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ModelError(f"model config: {self.num_experts} experts cannot form {self.n_group} groups "
                                 f"with topk_group={self.topk_group}")
            if self.n_group > 1 and self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ModelError("model config: num_experts_per_tok exceeds the experts of the kept groups")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"model config: rope scaling '{rope_type}' is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    def _check_layer_flags(self) -> None:
        """The per-layer and RoPE-shape flags (SmolLM3, GLM-4, gpt-oss), checked against the layer count."""
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
        self.no_rope_layers = tuple(self.no_rope_layers)
        for key, values, allowed in (("layer_types", self.layer_types or (), ("sliding_attention", "full_attention")),
                                     ("no_rope_layers", self.no_rope_layers, (0, 1))):
            if values and (len(values) != self.num_layers or any(v not in allowed for v in values)):
                raise ModelError(f"model config: '{key}' must list one of {allowed} per layer "
                                 f"({self.num_layers}), got {list(values)!r}"[:400])
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ModelError(f"model config: partial_rotary_factor {self.partial_rotary_factor} leaves "
                             f"{self.rotary_dim} of head_dim {self.head_dim} rotated (must be even and positive)")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ModelError(f"model config: expert activation {self.expert_activation!r} is not supported "
                             f"(supported: {', '.join(EXPERT_ACTIVATIONS)})")

    @property
    def rotary_dim(self) -> int:
        """How many dimensions of each head RoPE turns (GLM-4 turns half)."""
        assert self.head_dim is not None  # __post_init__ filled it in
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: full causal attention)."""
        if self.layer_types and self.layer_types[layer_idx] == "full_attention":
            return None
        return self.sliding_window

    def layer_has_rope(self, layer_idx: int) -> bool:
        return not self.no_rope_layers or bool(self.no_rope_layers[layer_idx])

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has an MoE block (the others keep the dense MLP)."""
        return (self.num_experts > 0 and layer_idx >= self.first_k_dense and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def _parameter_counts(self) -> tuple[int, int]:
        """(total, active per token): an MoE layer's token uses num_experts_per_tok of its experts."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        assert d is not None  # __post_init__ filled it in
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        norm_dims = (q + kv) if self.qk_norm_full else 2 * d
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + norm_dims * self.qk_norm
        attn += self.num_heads * self.attention_sinks + 2 * h * self.post_block_norms
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        total = active = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for layer in range(self.num_layers):
            total += attn + 2 * h
            active += attn + 2 * h
            if not self.is_moe_layer(layer):
                total += dense
                active += dense
                continue
            expert = 3 * h * self.expert_intermediate_size + (2 * self.expert_intermediate_size + h) * self.expert_bias
            shared = 3 * h * self.shared_expert_intermediate_size + h * self.shared_expert_gate
            router = self.num_experts * (h + self.router_bias)
            total += self.num_experts * expert + shared + router
            active += self.num_experts_per_tok * expert + shared + router
        return total, active

    @property
    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        return self._parameter_counts()[0]

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token computes with: every expert's for a dense model, the routed ones for MoE."""
        return self._parameter_counts()[1]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a transformers config.json dict (v4 or v5 style).

        Every value is checked for its type and range, so a damaged config.json
        is a ModelError naming the file and the key, never a TypeError or an
        allocation of absurd size later.
        """
        if not isinstance(hf, dict):
            raise ModelError(f"{source}: expected a JSON object, got {_json_type(hf)}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            archs = hf.get("architectures")
            raise ModelError(
                f"{source}: unknown model family {model_type!r}"
                + (f" (architectures {archs})" if archs else "")
                + f"; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        read = _Reader(hf, source)
        required: _RequiredSizes = {
            "vocab_size": read.size("vocab_size", required=True),
            "hidden_size": read.size("hidden_size", required=True),
            "intermediate_size": read.size("intermediate_size", required=True),
            "num_layers": read.size("num_hidden_layers", required=True, limit=MAX_LAYERS),
            "num_heads": read.size("num_attention_heads", required=True),
        }
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only silu)")

        # transformers v5 moved rope_theta and rope_scaling into rope_parameters.
        rope = dict(read.mapping("rope_parameters") or {})
        legacy = read.mapping("rope_scaling") or {}
        if "rope_theta" in rope:
            rope_theta = _Reader(rope, source, "rope_parameters.").number("rope_theta", positive=True)
            rope.pop("rope_theta")
        else:
            rope_theta = read.number("rope_theta", default=10000.0, positive=True)
        scaling: dict[str, Any] | None  # None: RoPE unscaled
        scaling = {k: v for k, v in {**legacy, **rope}.items() if k != "rope_theta"}
        # GLM-4: in rope_parameters (transformers 5) or at the top (4.x); 0.5 when neither says.
        partial = {**hf, **scaling}.get("partial_rotary_factor", 0.5 if model_type == "glm4" else 1.0)
        partial = _Reader({"partial_rotary_factor": partial}, source).number("partial_rotary_factor", positive=True)
        scaling.pop("partial_rotary_factor", None)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        else:
            _check_rope_scaling(scaling, source)

        attention_bias = read.flag("attention_bias")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3") and \
                not read.flag("use_sliding_window"):
            sliding = None  # the Qwen families ignore sliding_window (some configs hold 0) unless this flag is set
        else:
            sliding = read.size("sliding_window", nullable=True, limit=None)
        moe = _moe_from_hf(model_type, hf, source)
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
            "use_sliding_window", "initializer_range", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
            "architectures", "hidden_act", *_MOE_KEYS, *(_ROUTING_KEYS if model_type in MOE_FAMILIES else ()),
            *_LAYER_KEYS,
        }
        layers = _layer_flags_from_hf(model_type, hf, required["num_layers"], source)
        if model_type == "qwen2_moe":
            attention_bias = bool(hf.get("qkv_bias", True))
        try:
            return cls(
                **required,
                num_kv_heads=read.size("num_key_value_heads", nullable=True) or required["num_heads"],
                head_dim=read.size("head_dim", nullable=True),
                rms_norm_eps=read.number("rms_norm_eps", default=1e-6, positive=True),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=read.size("max_position_embeddings", default=2048, limit=None),
                tie_word_embeddings=read.flag("tie_word_embeddings"),
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type not in ("qwen2", "qwen2_moe", "glm4") and attention_bias,
                mlp_bias=read.flag("mlp_bias"),
                qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
                qk_norm_full=model_type == "olmoe",
                clip_qkv=read.number("clip_qkv", positive=True) if hf.get("clip_qkv") is not None else None,
                **moe,
                sliding_window=sliding,
                **layers,
                partial_rotary_factor=partial,
                initializer_range=0.02 if hf.get("initializer_range") is None else read.number("initializer_range"),
                model_type=model_type,
                bos_token_id=read.token_ids("bos_token_id"),
                eos_token_id=read.token_ids("eos_token_id"),
                pad_token_id=read.token_ids("pad_token_id", single=True),
                extra={k: v for k, v in hf.items() if k not in known},
            )
        except ModelError as e:
            raise ModelError(f"{source}: {str(e).removeprefix('model config: ')}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers (v4 and v5) loads back."""
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
        extra = dict(self.extra)
        if (extra.get("quantization_config") or {}).get("quant_method") == "mxfp4":
            extra.pop("quantization_config")  # gpt-oss's MXFP4 experts were dequantized on load
        hf: dict[str, Any] = {
            **extra,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        hf.update(self._moe_to_hf())
        hf.update(self._layer_flags_to_hf())
        if self.model_type == "glm4":
            if self.o_bias:
                raise ModelError("glm4 checkpoints have no o_proj bias")
            hf["attention_bias"] = self.qkv_bias
        elif self.model_type == "qwen2_moe":
            if self.o_bias:
                raise ModelError("qwen2_moe checkpoints have no o_proj bias")
            hf["qkv_bias"] = self.qkv_bias
        elif self.model_type == "qwen2":
            if self.o_bias or not self.qkv_bias:
                raise ModelError("qwen2 checkpoints always have q/k/v biases and no o_proj bias")
        else:
            if self.qkv_bias != self.o_bias:
                raise ModelError(f"{self.model_type} has one attention_bias flag for q/k/v/o; "
                                 f"got qkv={self.qkv_bias} o={self.o_bias}")
            hf["attention_bias"] = self.qkv_bias
        if self.model_type in ("llama", "mistral", "smollm3"):
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "mixtral", "gpt_oss") or self.sliding_window:
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"):
            hf["use_sliding_window"] = self.sliding_window is not None
        return hf

    def _moe_to_hf(self) -> dict[str, Any]:
        """The MoE keys of config.json, as each family names them."""
        kind = self.model_type
        if kind not in MOE_FAMILIES:
            if self.num_experts:
                raise ModelError(f"{kind} checkpoints have no mixture-of-experts layers; "
                                 f"use one of {', '.join(MOE_FAMILIES)}")
            return {}
        hf: dict[str, Any] = {"num_experts_per_tok": self.num_experts_per_tok}
        hf["num_local_experts" if kind in ("mixtral", "qwen3_moe", "gpt_oss") else "num_experts"] = self.num_experts
        if kind in ("qwen2_moe", "qwen3_moe"):
            hf.update(moe_intermediate_size=self.expert_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        if kind == "qwen2_moe":
            hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if kind == "olmoe":
            hf.update(norm_topk_prob=self.norm_topk_prob, clip_qkv=self.clip_qkv)
        hf.update(self._routing_to_hf())
        return hf

    def _routing_to_hf(self) -> dict[str, Any]:
        """DeepSeek-V3's routing keys, for what the family's own config.json cannot say (empty otherwise).

        transformers' classes for these families do not read them: a folder with sigmoid routing loads back
        in entrenar as trained, but transformers would route it with the family's softmax."""
        hf: dict[str, Any] = {}
        if self.router_scoring != ("softmax_topk" if self.model_type == "gpt_oss" else "softmax"):
            hf["scoring_func"] = self.router_scoring
        if self.n_group != 1 or self.topk_group != 1:
            hf.update(n_group=self.n_group, topk_group=self.topk_group)
        if self.routed_scaling_factor != 1.0:
            hf["routed_scaling_factor"] = self.routed_scaling_factor
        if self.shared_expert_intermediate_size and self.model_type != "qwen2_moe":
            if self.shared_expert_gate or self.shared_expert_intermediate_size % self.expert_intermediate_size:
                raise ModelError(f"{self.model_type} checkpoints can hold only ungated shared experts as wide as the "
                                 f"routed ones (n_shared_experts); got {self.shared_expert_intermediate_size} wide, "
                                 f"gated={self.shared_expert_gate}")
            hf["n_shared_experts"] = self.shared_expert_intermediate_size // self.expert_intermediate_size
        return hf

    def _layer_flags_to_hf(self) -> dict[str, Any]:
        """The keys of SmolLM3's, GLM-4's and gpt-oss's config.json for their flags (empty for other families);
        a flag the family's config.json cannot say is refused rather than lost."""
        kind = self.model_type
        own = {"smollm3": {"layer_types", "no_rope_layers"}, "glm4": {"glm4"}, "gpt_oss": {"layer_types", "gpt_oss"}}
        used = {"layer_types": bool(self.layer_types), "no_rope_layers": bool(self.no_rope_layers),
                "glm4": self.post_block_norms or self.fused_gate_up or self.rope_interleaved,
                "gpt_oss": self.attention_sinks or self.expert_bias or self.expert_activation != "silu"}
        lost = [flag for flag, on in used.items() if on and flag not in own.get(kind, set())]
        if lost or (kind == "glm4" and not (self.post_block_norms and self.fused_gate_up and self.rope_interleaved)):
            raise ModelError(f"{kind} checkpoints cannot hold these flags as set ({', '.join(lost) or 'glm4'})")
        hf: dict[str, Any] = {}
        if self.layer_types:
            hf["layer_types"] = list(self.layer_types)
        if self.no_rope_layers:
            hf["no_rope_layers"] = list(self.no_rope_layers)
        if kind == "gpt_oss":
            hf.update(swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        return hf

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)



# Bounds far above any released model (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers;
# vocabularies reach 262,144), so a damaged config.json fails here rather than in a huge allocation.
MAX_DIM = 2**22
MAX_LAYERS = 4096


class _RequiredSizes(TypedDict):
    """The sizes every config.json must give, under ModelConfig's names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number")


class _Reader:
    """Typed reads of config.json keys; each bad value is a ModelError naming the file and the key."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def _bad(self, key: str, expected: str) -> ModelError:
        return ModelError(f"{self.source}: '{self.prefix}{key}' must be {expected}, got {self.data.get(key)!r}"[:400])

    @overload
    def size(self, key: str, required: Literal[True], nullable: Literal[False] = False, default: int | None = None,
             limit: int | None = MAX_DIM) -> int: ...

    @overload
    def size(self, key: str, required: bool = False, nullable: Literal[False] = False, *, default: int,
             limit: int | None = MAX_DIM) -> int: ...

    @overload
    def size(self, key: str, required: bool = False, nullable: bool = False, default: int | None = None,
             limit: int | None = MAX_DIM) -> int | None: ...

    def size(self, key: str, required: bool = False, nullable: bool = False, default: int | None = None,
             limit: int | None = MAX_DIM) -> int | None:
        if key not in self.data:
            if required:
                raise ModelError(f"{self.source}: missing key '{self.prefix}{key}'")
            return default
        value = self.data[key]
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self._bad(key, "a positive integer")
        if limit is not None and value > limit:
            raise self._bad(key, f"at most {limit:,} (larger than any model entrenar can load)")
        return value

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float:
        value = self.data.get(key, default)
        expected = "a positive finite number" if positive else "a finite number"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(key, expected)
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise self._bad(key, expected) from None
        if not math.isfinite(number) or (positive and number <= 0):
            raise self._bad(key, expected)
        return number

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, dict):
            raise self._bad(key, "an object or null")
        return value

    @overload
    def token_ids(self, key: str, single: Literal[True]) -> int | None: ...

    @overload
    def token_ids(self, key: str, single: bool = False) -> int | list[int] | None: ...

    def token_ids(self, key: str, single: bool = False) -> int | list[int] | None:
        value = self.data.get(key)

        def is_id(v: Any) -> bool:  # old conversions wrote pad_token_id -1 for "none"; it is passed through
            return isinstance(v, int) and not isinstance(v, bool)

        if value is None or is_id(value):
            return value
        if not single and isinstance(value, list) and all(is_id(v) for v in value):
            return value
        raise self._bad(key, "a token id (an integer)" + ("" if single else ", a list of them,") + " or null")


def _check_rope_scaling(scaling: dict[str, Any], source: str) -> None:
    """The numbers rope_inv_freq reads for a scaled RoPE, checked before they are used."""
    kind = scaling.get("rope_type")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{source}: rope scaling {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            **rope_scaling.REQUIRED_KEYS}[kind]
    read = _Reader(scaling, source, "rope_scaling.")
    for key in keys:
        read.number(key, positive=True)
    if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise ModelError(f"{source}: 'rope_scaling.low_freq_factor' and 'high_freq_factor' must differ "
                         f"(both {scaling['low_freq_factor']})")


_LAYER_KEYS = ("layer_types", "no_rope_layers", "no_rope_layer_interval", "partial_rotary_factor", "swiglu_alpha",
               "swiglu_limit")


def _layer_flags_from_hf(model_type: str, hf: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """SmolLM3's, GLM-4's and gpt-oss's flags from their config.json, with transformers' defaults where a key is
    absent (SmolLM3: no RoPE on every no_rope_layer_interval-th layer; gpt-oss: sliding and full layers alternate)."""
    read = _Reader(hf, source)
    flags: dict[str, Any] = {}
    if model_type in ("smollm3", "gpt_oss"):
        types = hf.get("layer_types")
        if types is None and model_type == "gpt_oss":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        if types is not None and not isinstance(types, list):
            raise read._bad("layer_types", "a list")
        flags["layer_types"] = None if types is None else tuple(types)
    if model_type == "smollm3":
        no_rope = hf.get("no_rope_layers")
        if no_rope is None:
            interval = read.size("no_rope_layer_interval", default=4, limit=None)
            no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if not isinstance(no_rope, list):
            raise read._bad("no_rope_layers", "a list")
        flags["no_rope_layers"] = tuple(no_rope)
    if model_type == "glm4":
        flags.update(post_block_norms=True, fused_gate_up=True, rope_interleaved=True)
    if model_type == "gpt_oss":
        flags.update(attention_sinks=True, expert_bias=True, expert_activation="clamped_swiglu",
                     swiglu_alpha=read.number("swiglu_alpha", default=1.702, positive=True),
                     swiglu_limit=read.number("swiglu_limit", default=7.0, positive=True))
    return flags


_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "clip_qkv", "qkv_bias")
# DeepSeek-V3's routing keys (its config.json names), read for every MoE family so a model from scratch can use
# sigmoid routing with grouped top-k; written back only when they differ from the family's own routing.
_ROUTING_KEYS = ("scoring_func", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts")


def _moe_from_hf(model_type: str, hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """ModelConfig's MoE fields from a config.json of one of MOE_FAMILIES (empty for a dense family).

    Mixtral always renormalises its top-k weights; the Qwen MoE families and OLMoE say so in
    norm_topk_prob. Mixtral's and OLMoE's intermediate_size is each expert's; the Qwen MoE families
    keep intermediate_size for their dense layers and give moe_intermediate_size.
    """
    if model_type not in MOE_FAMILIES:
        return {}
    moe: dict[str, Any] = {
        "num_experts": int(hf.get("num_local_experts") or hf.get("num_experts") or 0),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 2)),
        "norm_topk_prob": True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
    }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        moe["moe_intermediate_size"] = hf.get("moe_intermediate_size")
        moe["decoder_sparse_step"] = int(hf.get("decoder_sparse_step", 1))
        moe["mlp_only_layers"] = tuple(hf.get("mlp_only_layers") or ())
    if model_type == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
        moe["shared_expert_gate"] = True
    if model_type == "gpt_oss":
        moe.update(router_scoring="softmax_topk", router_bias=True)
    if not moe["num_experts"]:
        raise ModelError(f"config.json of a {model_type} model names no experts (num_experts / num_local_experts)")
    moe.update(_routing_from_hf(model_type, hf, moe, source))
    return moe


def _routing_from_hf(model_type: str, hf: dict[str, Any], moe: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3-style routing from its config.json keys: ``scoring_func`` (softmax | sigmoid; entrenar also
    takes softmax_topk), ``n_group``/``topk_group`` (grouped top-k), ``routed_scaling_factor`` and
    ``n_shared_experts`` (ungated shared experts, each ``moe_intermediate_size`` wide)."""
    read = _Reader(hf, source)
    out: dict[str, Any] = {}
    if hf.get("scoring_func") is not None:
        if hf["scoring_func"] not in ROUTER_SCORINGS:
            raise read._bad("scoring_func", f"one of {', '.join(ROUTER_SCORINGS)}")
        out["router_scoring"] = hf["scoring_func"]
    for key in ("n_group", "topk_group"):
        if hf.get(key) is not None:
            out[key] = read.size(key, limit=4096)
    if hf.get("routed_scaling_factor") is not None:
        out["routed_scaling_factor"] = read.number("routed_scaling_factor", positive=True)
    if hf.get("n_shared_experts"):
        if model_type == "qwen2_moe":
            raise ModelError(f"{source}: 'n_shared_experts' is DeepSeek's; qwen2_moe gives its (gated) shared "
                             "expert as shared_expert_intermediate_size")
        count = read.size("n_shared_experts", limit=4096)
        assert count is not None  # the key holds a truthy value, and None is refused
        width = moe.get("moe_intermediate_size") or hf["intermediate_size"]
        out["shared_expert_intermediate_size"] = count * int(width)
        out["shared_expert_gate"] = False
    return out


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies [rotary_dim/2], with linear, llama3, yarn or dynamic scaling applied (dynamic: for a
    sequence of ``seq_len`` positions, the unscaled ones when None)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "yarn":
        inv_freq = rope_scaling.yarn_inv_freq(config.rope_theta, dim, scaling)
    elif kind == "dynamic" and seq_len is not None:
        inv_freq = rope_scaling.dynamic_inv_freq(config.rope_theta, dim, float(scaling["factor"]),
                                                 config.max_position_embeddings, seq_len)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: low frequencies are slowed by `factor`, high ones kept,
        # the band between blended smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq
