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
        required = {
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
        scaling = {k: v for k, v in {**legacy, **rope}.items() if k != "rope_theta"}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        else:
            _check_rope_scaling(scaling, source)

        attention_bias = read.flag("attention_bias")
        sliding = read.size("sliding_window", nullable=True, limit=None)
        if model_type in ("qwen2", "qwen3") and not read.flag("use_sliding_window"):
            sliding = None
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
            "use_sliding_window", "initializer_range", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
            "architectures", "hidden_act",
        }
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
                o_bias=model_type != "qwen2" and attention_bias,
                mlp_bias=read.flag("mlp_bias"),
                qk_norm=model_type == "qwen3",
                sliding_window=sliding,
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



# Bounds far above any released model (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers;
# vocabularies reach 262,144), so a damaged config.json fails here rather than in a huge allocation.
MAX_DIM = 2**22
MAX_LAYERS = 4096


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number")


class _Reader:
    """Typed reads of config.json keys; each bad value is a ModelError naming the file and the key."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def _bad(self, key: str, expected: str) -> ModelError:
        return ModelError(f"{self.source}: '{self.prefix}{key}' must be {expected}, got {self.data.get(key)!r}"[:400])

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
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    read = _Reader(scaling, source, "rope_scaling.")
    for key in keys:
        read.number(key, positive=True)
    if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise ModelError(f"{source}: 'rope_scaling.low_freq_factor' and 'high_freq_factor' must differ "
                         f"(both {scaling['low_freq_factor']})")


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
