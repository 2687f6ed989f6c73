"""One configuration for the Llama-style decoder family.

Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM differ only in a handful of
flags (biases, q/k norms, RoPE scaling, tied embeddings), so one dataclass and
one model implementation cover them all, as in litgpt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from entrenar.errors import ModelError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    sliding_window: int | None = None
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
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
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"model config: rope scaling '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    @property
    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * d * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a transformers config.json dict (v4 or v5 style)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            archs = hf.get("architectures")
            raise ModelError(
                f"{source}: unknown model family '{model_type}'"
                + (f" (architectures {archs})" if archs else "")
                + f"; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        try:
            required = {
                "vocab_size": hf["vocab_size"],
                "hidden_size": hf["hidden_size"],
                "intermediate_size": hf["intermediate_size"],
                "num_layers": hf["num_hidden_layers"],
                "num_heads": hf["num_attention_heads"],
            }
        except KeyError as e:
            raise ModelError(f"{source}: missing key {e.args[0]!r}") from None
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelError(f"{source}: hidden_act '{hf['hidden_act']}' is not supported (only silu)")

        # transformers v5 moved rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in {**legacy, **rope}.items() if k != "rope_theta"}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None

        attention_bias = bool(hf.get("attention_bias", False))
        sliding = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            sliding = None
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
            "use_sliding_window", "initializer_range", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
            "architectures", "hidden_act",
        }
        return cls(
            **required,
            num_kv_heads=hf.get("num_key_value_heads") or required["num_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

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
        if self.model_type == "qwen2":
            if self.o_bias or not self.qkv_bias:
                raise ModelError("qwen2 checkpoints always have q/k/v biases and no o_proj bias")
        else:
            if self.qkv_bias != self.o_bias:
                raise ModelError(f"{self.model_type} has one attention_bias flag for q/k/v/o; got qkv={self.qkv_bias} o={self.o_bias}")
            hf["attention_bias"] = self.qkv_bias
        if self.model_type in ("llama", "mistral"):
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral" or self.sliding_window:
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = self.sliding_window is not None
        return hf

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def rope_inv_freq(config: ModelConfig) -> "torch.Tensor":  # noqa: F821
    """Inverse RoPE frequencies [head_dim/2], with linear or llama3 scaling applied."""
    import torch

    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
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
