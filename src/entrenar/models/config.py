"""One configuration for the Llama-style decoder family.

Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a handful of
flags (biases, q/k norms, RoPE scaling, tied embeddings), so one dataclass and
one model implementation cover them all, as in litgpt. Gemma 2 and Gemma 3 (text)
are a few flags more (scaled embeddings, (1 + w) norms, sandwich norms, a GELU gate,
soft caps, per-layer sliding windows and RoPE bases).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, overload

import torch

from entrenar.errors import ModelError
from entrenar.models.rope_scaling import check_longrope, longrope_inv_freq

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                      "phi3", "olmo2", "granite", "deepseek_v3", "gemma2", "gemma3_text")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# The gate activations of the MLP (config.json's hidden_act, Gemma's hidden_activation), as transformers' ACT2FN
# names them.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROUTER_SCORINGS = ("softmax", "softmax_topk", "sigmoid")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


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
    # Multi-head latent attention (DeepSeek-V3, models/mla.py); kv_lora_rank 0: ordinary attention. head_dim is
    # then the rotary part of a query/key head (qk_rope_head_dim), as in transformers' config.
    kv_lora_rank: int = 0  # the compressed key/value latent kv_a_proj_with_mqa writes (besides the rope key)
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int = 0  # the part of a query/key head without RoPE
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims rotate in (even, odd) pairs, as DeepSeek's checkpoints hold them
    sliding_window: int | None = None
    # Phi-3 / Phi-4, OLMo 2, Granite
    fused_qkv: bool = False  # Phi-3: q, k, v as one qkv_proj [q + 2 kv, hidden] (the checkpoint's module)
    fused_gate_up: bool = False  # Phi-3: gate and up as one gate_up_proj [2 intermediate, hidden], gate rows first
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * this dims of each head; the rest pass
    post_norm: bool = False  # OLMo 2: no norm before attention/MLP; their outputs are normed before the residual
    embedding_multiplier: float = 1.0  # Granite: embeddings multiplied by this
    residual_multiplier: float = 1.0  # Granite: attention and MLP outputs multiplied by this before the residual
    attention_multiplier: float | None = None  # Granite: the attention-score scale (None: 1/sqrt(head_dim))
    logits_scaling: float = 1.0  # Granite: logits divided by this
    # Gemma 2/3 (models/transformer.py): each flag alone changes what the decoder computes.
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    norm_unit_offset: bool = False  # RMSNorm multiplies by (1 + weight), the weight stored as the checkpoint has it
    sandwich_norms: bool = False  # norms before and after attention and MLP (pre/post_feedforward_layernorm)
    hidden_act: str = "silu"  # the MLP's gate activation, one of HIDDEN_ACTS
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim ** -0.5)
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES; None: every layer uses sliding_window
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: rope_theta
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
        if self.kv_lora_rank:
            _check_mla(self)
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
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ModelError(f"model config: partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] "
                             f"and turn an even number of head_dim's {self.head_dim} dims")
        if self.fused_qkv and (self.qkv_bias or self.qk_norm):
            raise ModelError("model config: a fused qkv_proj (Phi-3) has no q/k/v biases or q/k norms")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"model config: rope scaling '{rope_type}' is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "longrope":
            check_longrope(self.rope_scaling or {}, "model config")
            longrope_inv_freq(self, long=True)  # the factor counts checked against the rotated dims
            longrope_inv_freq(self, long=False)
        self._check_gemma_flags()

    def _check_gemma_flags(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelError(f"model config: hidden activation {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(HIDDEN_ACTS)})")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ModelError(f"model config: '{name}' must be a positive number or null, got {value!r}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ModelError(f"model config: 'layer_types' must list one of {', '.join(LAYER_TYPES)} for each "
                                 f"of the {self.num_layers} layers, got {list(self.layer_types)!r}"[:400])

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: it attends to every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_uses_local_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` rotates by the local RoPE base (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.layer_window(layer_idx) is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (models/mla.py)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A query/key head's size: its part without RoPE and its rotary part (head_dim) under MLA."""
        assert self.head_dim is not None  # __post_init__ filled it in
        return self.qk_nope_head_dim + self.head_dim

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
        if self.is_mla:
            attn = mla_parameters(self)
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        total = active = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        norms = (4 if self.sandwich_norms else 2) * h
        for layer in range(self.num_layers):
            total += attn + norms
            active += attn + norms
            if not self.is_moe_layer(layer):
                total += dense
                active += dense
                continue
            expert = 3 * h * self.expert_intermediate_size
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
        if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
            raise ModelError(f"{source}: Gemma 3 with its vision tower (Gemma3ForConditionalGeneration) is not "
                             "supported; entrenar trains Gemma 3 text models (model_type gemma3_text, "
                             "Gemma3ForCausalLM)")
        if model_type not in SUPPORTED_FAMILIES:
            archs = hf.get("architectures")
            raise ModelError(
                f"{source}: unknown model family {model_type!r}"
                + (f" (architectures {archs})" if archs else "")
                + f"; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        gemma = model_type in GEMMA_FAMILIES
        if gemma:
            hf = _gemma_rope_flattened(hf, source)
        read = _Reader(hf, source)
        required: _RequiredSizes = {
            "vocab_size": read.size("vocab_size", required=True),
            "hidden_size": read.size("hidden_size", required=True),
            "intermediate_size": read.size("intermediate_size", required=True),
            "num_layers": read.size("num_hidden_layers", required=True, limit=MAX_LAYERS),
            "num_heads": read.size("num_attention_heads", required=True),
        }
        hidden_act = "silu" if gemma else hf.get("hidden_act", "silu")  # Gemma reads hidden_activation alone
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
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        partial_rotary = _partial_rotary_factor(hf, scaling, source)
        if model_type == "phi3":
            _phi3_rope(hf, scaling)
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        else:
            _check_rope_scaling(scaling, source)

        attention_bias = read.flag("attention_bias")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not read.flag("use_sliding_window"):
            sliding = None  # the Qwen families ignore sliding_window (some configs hold 0) unless this flag is set
        else:
            sliding = read.size("sliding_window", nullable=True, limit=None)
        if model_type == "deepseek_v3":  # transformers' defaults for the keys a DeepSeek config.json leaves out
            hf = {**DEEPSEEK_V3_DEFAULTS, **hf}
        moe = _moe_from_hf(model_type, hf, source)
        mla = _mla_from_hf(hf, source) if model_type == "deepseek_v3" else {}
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
            "use_sliding_window", "initializer_range", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
            "architectures", "hidden_act", *_MOE_KEYS, *(_ROUTING_KEYS if model_type in MOE_FAMILIES else ()),
            *_FAMILY_KEYS,
            *(_MLA_KEYS if mla else ()),
        }
        if model_type == "qwen2_moe":
            attention_bias = bool(hf.get("qkv_bias", True))
        gemma_flags: dict[str, Any] = {}
        if gemma:
            gemma_flags = _gemma_from_hf(model_type, hf, required["num_layers"], read)
            known |= set(_GEMMA_KEYS)
            sliding = gemma_flags.pop("sliding_window")
        try:
            return cls(
                **required,
                num_kv_heads=mla.pop("num_kv_heads", None) or read.size("num_key_value_heads", nullable=True)
                or required["num_heads"],
                head_dim=mla.pop("head_dim", None) or read.size("head_dim", nullable=True,
                                                                default=256 if gemma else None),
                rms_norm_eps=read.number("rms_norm_eps", default=1e-6, positive=True),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=read.size("max_position_embeddings", default=2048, limit=None),
                tie_word_embeddings=read.flag("tie_word_embeddings", default=gemma),
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
                mlp_bias=read.flag("mlp_bias"),
                qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe", "olmo2", "gemma3_text"),
                qk_norm_full=model_type in ("olmoe", "olmo2"),
                clip_qkv=read.number("clip_qkv", positive=True) if hf.get("clip_qkv") is not None else None,
                **moe,
                **mla,
                sliding_window=sliding,
                partial_rotary_factor=partial_rotary,
                **_family_flags(model_type, read),
                **gemma_flags,
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
        hf: dict[str, Any] = {
            **self.extra,
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
        hf.update(_mla_to_hf(self))
        if self.model_type == "qwen2_moe":
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
        if self.model_type in ("llama", "mistral", "granite"):
            hf["mlp_bias"] = self.mlp_bias
        hf.update(self._family_to_hf(rope_parameters))
        if self.model_type in ("mistral", "mixtral") or self.sliding_window:
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            hf["use_sliding_window"] = self.sliding_window is not None
        hf.update(self._gemma_to_hf(hf))
        return hf

    def _family_to_hf(self, rope_parameters: dict[str, Any]) -> dict[str, Any]:
        """The keys of Phi-3's, OLMo 2's and Granite's config.json beyond Llama's; the flags another family's
        config.json cannot say are refused rather than dropped."""
        kind, hf = self.model_type, {}
        own = {"fused_qkv": kind == "phi3", "fused_gate_up": kind == "phi3", "post_norm": kind == "olmo2"}
        wrong = [name for name, value in own.items() if getattr(self, name) != value]
        if kind != "granite" and (self.embedding_multiplier != 1 or self.residual_multiplier != 1
                                  or self.attention_multiplier is not None or self.logits_scaling != 1):
            wrong.append("Granite's multipliers")
        if kind != "phi3" and self.partial_rotary_factor != 1:
            wrong.append("partial_rotary_factor")
        if wrong:
            raise ModelError(f"{kind} checkpoints cannot hold {', '.join(wrong)} as set")
        if kind == "phi3":
            hf["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
            if "original_max_position_embeddings" in rope_parameters:
                hf["original_max_position_embeddings"] = rope_parameters["original_max_position_embeddings"]
        if kind == "granite":
            assert self.head_dim is not None  # __post_init__ filled it in
            hf.update(embedding_multiplier=self.embedding_multiplier, residual_multiplier=self.residual_multiplier,
                      attention_multiplier=(self.head_dim ** -0.5 if self.attention_multiplier is None
                                            else self.attention_multiplier),
                      logits_scaling=self.logits_scaling)
        return hf
    def _gemma_to_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Gemma 2/3's keys of config.json (empty for other families, which cannot hold these flags)."""
        flags = {"scale_embeddings": self.scale_embeddings, "norm_unit_offset": self.norm_unit_offset,
                 "sandwich_norms": self.sandwich_norms, "hidden_act": self.hidden_act != "silu",
                 "attn_logit_softcapping": self.attn_logit_softcapping is not None,
                 "final_logit_softcapping": self.final_logit_softcapping is not None,
                 "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
                 "layer_types": self.layer_types is not None, "rope_local_theta": self.rope_local_theta is not None}
        if self.model_type not in GEMMA_FAMILIES:
            if any(flags.values()):
                raise ModelError(f"{self.model_type} checkpoints cannot hold the Gemma flags "
                                 f"{[k for k, v in flags.items() if v]}; use model_type gemma2 or gemma3_text")
            return {}
        wanted = ("scale_embeddings", "norm_unit_offset", "sandwich_norms")
        if not all(flags[k] for k in wanted):
            raise ModelError(f"{self.model_type} checkpoints always have {', '.join(wanted)}")
        if self.model_type == "gemma3_text" and self.attn_logit_softcapping is not None:
            raise ModelError("gemma3_text checkpoints have no attention-logit soft-capping")
        if (self.model_type == "gemma3_text") != (self.qk_norm and not self.qk_norm_full) or self.qk_norm_full:
            raise ModelError(f"{self.model_type} checkpoints have per-head q/k norms if and only if gemma3_text")
        out: dict[str, Any] = {
            "hidden_activation": self.hidden_act,
            # transformers' config class takes an integer here (its strict validation refuses 24.0)
            "query_pre_attn_scalar": _whole(self.query_pre_attn_scalar or self.head_dim),
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "layer_types": list(self.layer_types or ["sliding_attention"] * self.num_layers),
            "sliding_window": self.sliding_window,
        }
        hf.pop("hidden_act", None)
        if self.model_type == "gemma3_text":
            full = {k: v for k, v in hf["rope_parameters"].items()}
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
            hf.pop("rope_theta", None)
            hf.pop("rope_scaling", None)
        return out

    def _moe_to_hf(self) -> dict[str, Any]:
        """The MoE keys of config.json, as each family names them."""
        kind = self.model_type
        if kind not in MOE_FAMILIES:
            if self.num_experts:
                raise ModelError(f"{kind} checkpoints have no mixture-of-experts layers; "
                                 f"use one of {', '.join(MOE_FAMILIES)}")
            return {}
        hf: dict[str, Any] = {"num_experts_per_tok": self.num_experts_per_tok}
        if kind == "deepseek_v3":
            return {**hf, **_deepseek_moe_to_hf(self)}
        hf["num_local_experts" if kind in ("mixtral", "qwen3_moe") else "num_experts"] = self.num_experts
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
        if self.router_scoring != "softmax":
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

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.data.get(key, default)
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
    if kind == "longrope":
        check_longrope(scaling, source)
        return
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    read = _Reader(scaling, source, "rope_scaling.")
    for key in keys:
        read.number(key, positive=True)
    if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise ModelError(f"{source}: 'rope_scaling.low_freq_factor' and 'high_freq_factor' must differ "
                         f"(both {scaling['low_freq_factor']})")


# Phi-3 / Phi-4, OLMo 2 and Granite
_FAMILY_KEYS = ("original_max_position_embeddings", "partial_rotary_factor", "embedding_multiplier",
                "residual_multiplier", "attention_multiplier", "logits_scaling")


def _partial_rotary_factor(hf: dict[str, Any], scaling: dict[str, Any], source: str) -> float:
    """The share of each head RoPE turns (Phi-3 keeps it in rope_parameters, older files at the top level);
    taken out of ``scaling`` so a default RoPE stays unscaled."""
    where = scaling if "partial_rotary_factor" in scaling else hf
    prefix = "rope_parameters." if where is scaling else ""
    factor = 1.0
    if where.get("partial_rotary_factor") is not None:
        factor = _Reader(where, source, prefix).number("partial_rotary_factor", positive=True)
    scaling.pop("partial_rotary_factor", None)
    return factor


def _phi3_rope(hf: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Phi-3's RoPE keys as transformers reads them: old names of longrope ("su", "yarn") and the
    pre-training context at the top level of config.json."""
    if scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") == "longrope" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", 4096)


def _family_flags(model_type: str, read: _Reader) -> dict[str, Any]:
    """ModelConfig's flags of Phi-3 / Phi-4 (fused projections), OLMo 2 (post-norm) and Granite (multipliers)."""
    if model_type == "phi3":
        return {"fused_qkv": True, "fused_gate_up": True}
    if model_type == "olmo2":
        return {"post_norm": True}
    if model_type != "granite":
        return {}
    flags: dict[str, Any] = {key: read.number(key, default=1.0, positive=True)
                             for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    if read.data.get("attention_multiplier") is not None:
        flags["attention_multiplier"] = read.number("attention_multiplier", positive=True)
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
        "num_experts": int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0),
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
    if model_type == "deepseek_v3":
        moe.update(_deepseek_moe_from_hf(hf, source))
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


# DeepSeek-V3 (Kimi-K2 and Moonlight share it): transformers' DeepseekV3Config defaults, for keys a config.json
# leaves out.
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "rope_interleave": True,
}
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim",
             "rope_interleave", "n_routed_experts", "first_k_dense_replace", "topk_method")


def _mla_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig's MLA fields (and head_dim, num_kv_heads) from a DeepSeek-V3 config.json."""
    read = _Reader(hf, source)
    rope_dim = read.size("qk_rope_head_dim", required=True)
    if hf.get("head_dim") is not None and hf["head_dim"] != rope_dim:
        raise ModelError(f"{source}: 'head_dim' ({hf['head_dim']}) must equal 'qk_rope_head_dim' ({rope_dim}) in a "
                         "deepseek_v3 config (transformers sets one from the other)")
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ModelError(f"{source}: 'num_key_value_heads' ({hf['num_key_value_heads']}) must equal "
                         f"'num_attention_heads' ({heads}): multi-head latent attention expands a key and a value "
                         "for every query head")
    return {
        "head_dim": rope_dim,
        "num_kv_heads": heads,
        "kv_lora_rank": read.size("kv_lora_rank", required=True),
        "q_lora_rank": read.size("q_lora_rank", nullable=True),
        "qk_nope_head_dim": read.size("qk_nope_head_dim", required=True),
        "v_head_dim": read.size("v_head_dim", required=True),
        "rope_interleave": read.flag("rope_interleave"),
    }


def _deepseek_moe_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3's MoE fields besides the routing keys: it always routes by sigmoid scores with the correction
    bias (transformers' DeepseekV3TopkRouter); its first first_k_dense_replace layers keep a dense MLP."""
    read = _Reader(hf, source)
    if hf.get("scoring_func") not in (None, "sigmoid"):
        raise ModelError(f"{source}: 'scoring_func' {hf['scoring_func']!r}: deepseek_v3 routes by sigmoid scores "
                         "(softmax scoring is DeepSeek-V2's, which entrenar does not load)")
    if hf.get("topk_method") not in (None, "noaux_tc"):
        raise ModelError(f"{source}: 'topk_method' {hf['topk_method']!r}: deepseek_v3 picks experts by noaux_tc "
                         "(grouped top-k with the correction bias)")
    first = hf.get("first_k_dense_replace")
    return {
        "moe_intermediate_size": read.size("moe_intermediate_size", required=True),
        "router_scoring": "sigmoid",
        "first_k_dense": read.size("first_k_dense_replace", limit=MAX_LAYERS) if first not in (None, 0) else 0,
    }


def _deepseek_moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The MoE keys of a DeepSeek-V3 config.json (its own names)."""
    if config.router_scoring != "sigmoid" or config.shared_expert_gate or config.decoder_sparse_step != 1 \
            or config.mlp_only_layers or config.router_bias:
        raise ModelError("deepseek_v3 checkpoints hold sigmoid routing with ungated shared experts, MoE in every "
                         "layer after the first first_k_dense_replace ones, and no router bias")
    width = config.expert_intermediate_size
    if config.shared_expert_intermediate_size % width:
        raise ModelError(f"deepseek_v3 shared experts are as wide as the routed ones ({width}); got "
                         f"{config.shared_expert_intermediate_size}")
    return {"n_routed_experts": config.num_experts, "moe_intermediate_size": width,
            "n_shared_experts": config.shared_expert_intermediate_size // width, "n_group": config.n_group,
            "topk_group": config.topk_group, "routed_scaling_factor": config.routed_scaling_factor,
            "norm_topk_prob": config.norm_topk_prob, "first_k_dense_replace": config.first_k_dense}


def _mla_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The MLA keys of config.json (empty for ordinary attention)."""
    if config.model_type != "deepseek_v3":
        if config.is_mla:
            raise ModelError(f"{config.model_type} checkpoints have no multi-head latent attention; use deepseek_v3")
        return {}
    if not config.is_mla:
        raise ModelError("deepseek_v3 checkpoints hold multi-head latent attention (kv_lora_rank > 0)")
    return {"kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
            "qk_rope_head_dim": config.head_dim, "qk_nope_head_dim": config.qk_nope_head_dim,
            "v_head_dim": config.v_head_dim, "rope_interleave": config.rope_interleave}


def _check_mla(config: ModelConfig) -> None:
    """MLA's sizes: each positive, the same count of key/value heads as query heads."""
    for name in ("qk_nope_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"model config: '{name}' must be a positive integer with kv_lora_rank set, got {value!r}")
    if config.q_lora_rank is not None and (not isinstance(config.q_lora_rank, int) or config.q_lora_rank <= 0):
        raise ModelError(f"model config: 'q_lora_rank' must be a positive integer or null, got {config.q_lora_rank!r}")
    if config.num_kv_heads != config.num_heads:
        raise ModelError(f"model config: multi-head latent attention has as many key/value heads as query heads "
                         f"({config.num_heads}), got num_kv_heads={config.num_kv_heads}")


def mla_parameters(config: ModelConfig) -> int:
    """Parameters of one multi-head latent attention layer (projections, their biases and the latent norms)."""
    h, heads, r_kv = config.hidden_size, config.num_heads, config.kv_lora_rank
    qk, rope = config.qk_head_dim, config.head_dim
    assert rope is not None  # __post_init__ filled it in
    if config.q_lora_rank is None:
        q = h * heads * qk
    else:
        q = h * config.q_lora_rank + config.q_lora_rank * config.qkv_bias + config.q_lora_rank + \
            config.q_lora_rank * heads * qk
    kv = h * (r_kv + rope) + (r_kv + rope) * config.qkv_bias + r_kv + r_kv * heads * (config.qk_nope_head_dim
                                                                                       + config.v_head_dim)
    return q + kv + heads * config.v_head_dim * h + h * config.o_bias


# Gemma's config.json keys beyond Llama's; transformers' class defaults fill in what a config leaves out.
_GEMMA_KEYS = ("hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
               "layer_types", "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq",
               "use_bidirectional_attention")


def _whole(x: float | int | None) -> float | int | None:
    """``x`` as an int where it is a whole number (24.0 -> 24)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _gemma_rope_flattened(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's config.json with its RoPE as Llama's keys give it: the full-attention layers' parameters as
    ``rope_parameters`` and the sliding layers' base as ``rope_local_base_freq``. transformers 5 nests them per
    layer type (``rope_parameters.full_attention`` / ``.sliding_attention``); older configs give ``rope_theta``
    (default 1e6), ``rope_local_base_freq`` (default 1e4) and ``rope_scaling`` (the full layers' only).
    Gemma 2 has one RoPE for every layer, as Llama."""
    if hf.get("model_type") != "gemma3_text":
        return hf
    hf = dict(hf)
    nested = _Reader(hf, source).mapping("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full = _Reader(nested, source, "rope_parameters.").mapping("full_attention") or {}
        local = _Reader(nested, source, "rope_parameters.").mapping("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelError(f"{source}: 'rope_parameters.sliding_attention.rope_type' {local['rope_type']!r} is "
                             "not supported (Gemma 3's sliding layers use the default RoPE)")
        hf["rope_parameters"] = {"rope_theta": 1_000_000.0, **full}
        hf["rope_local_base_freq"] = local.get("rope_theta", 10_000.0)
    else:
        hf.setdefault("rope_theta", 1_000_000.0)
    hf.setdefault("rope_local_base_freq", 10_000.0)
    return hf


def _gemma_from_hf(model_type: str, hf: dict[str, Any], num_layers: int, read: _Reader) -> dict[str, Any]:
    """ModelConfig's Gemma 2/3 flags from a config.json, with transformers 5.24's defaults and its reading of
    ``layer_types``: given, or every ``sliding_window_pattern``-th layer (Gemma 2: 2nd; Gemma 3: 6th) global."""
    gemma2 = model_type == "gemma2"
    if hf.get("use_bidirectional_attention"):
        raise ModelError(f"{read.source}: 'use_bidirectional_attention' (EmbeddingGemma) is not supported: "
                         "entrenar trains causal language models")
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in HIDDEN_ACTS:
        raise read._bad("hidden_activation", f"one of {', '.join(HIDDEN_ACTS)}")

    def cap(key: str, default: float | None) -> float | None:
        return read.number(key, default=default, positive=True) if hf.get(key, default) is not None else None

    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or (2 if gemma2 else 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise read._bad("sliding_window_pattern", "a positive integer")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif not isinstance(layer_types, list):
        raise read._bad("layer_types", f"a list of {' / '.join(LAYER_TYPES)}")
    return {
        "scale_embeddings": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "hidden_act": act,
        # Gemma 3's attention reads no attn_logit_softcapping (transformers passes it to no attention function).
        "attn_logit_softcapping": cap("attn_logit_softcapping", 50.0) if gemma2 else None,
        "final_logit_softcapping": cap("final_logit_softcapping", 30.0 if gemma2 else None),
        "query_pre_attn_scalar": read.number("query_pre_attn_scalar", default=256, positive=True),
        "layer_types": tuple(layer_types),
        "rope_local_theta": None if gemma2 else read.number("rope_local_base_freq", positive=True),
        "sliding_window": read.size("sliding_window", nullable=True, default=4096, limit=None),
    }


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2], with linear or llama3 scaling applied; ``local``: those of the
    sliding layers' own base (Gemma 3's ``rope_local_theta``), unscaled."""
    assert config.head_dim is not None  # ModelConfig.__post_init__ filled it in
    dim = int(config.head_dim * config.partial_rotary_factor)  # the rotated dims (Phi-3's partial rotary)
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":  # the short-context frequencies; Transformer.rope picks the long ones past the context
        inv_freq = longrope_inv_freq(config, long=False)
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
