"""Multi-head latent attention (MLA), DeepSeek-V3's attention (Kimi-K2 and Moonlight share it).

Keys and values come from one small latent per token: ``kv_a_proj_with_mqa`` writes the latent
(``kv_lora_rank`` wide, normed by ``kv_a_layernorm``) and one rotary key shared by every head
(``qk_rope_head_dim`` wide); ``kv_b_proj`` expands the latent to each head's key part without RoPE
(``qk_nope_head_dim``) and its value (``v_head_dim``). Queries come from ``q_proj``, or through a low-rank
``q_a_proj -> q_a_layernorm -> q_b_proj`` when ``q_lora_rank`` is set, split the same way. RoPE turns only the
rotary parts ("decoupled RoPE"); a head's key is ``[k_nope, k_rope]``. Module names are transformers'
(``DeepseekV3Attention``), so checkpoints and PEFT adapters load as they are.

The KV cache holds the normed latent and the rotated shared key (as transformers' does), not the expanded keys.
The softmax scale is ``1/sqrt(qk_head_dim)``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` when RoPE is
scaled: queries are multiplied by what differs from SDPA's default scale, so every attention path (SDPA, the
padding-free documents, the CPU's explicit products) computes it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from entrenar.models.attention_dispatch import attention
from entrenar.models.config import ModelConfig
from entrenar.models.padding_free import Documents
from entrenar.models.rope_scaling import yarn_mscale

if TYPE_CHECKING:
    from entrenar.models.transformer import KVCache


def softmax_temperature(config: ModelConfig) -> float:
    """What MLA's softmax scale multiplies ``qk_head_dim ** -0.5`` by: ``yarn_mscale(factor, mscale_all_dim) ** 2``
    when RoPE is scaled and the config gives ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``), else 1."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        return m * m
    return 1.0


def softmax_scale(config: ModelConfig) -> float:
    """MLA's softmax scale: ``qk_head_dim ** -0.5`` times :func:`softmax_temperature`."""
    return config.qk_head_dim ** -0.5 * softmax_temperature(config)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims held in (even, odd) pairs, laid out as halves ``[x0, x2, ...; x1, x3, ...]``: then RoPE's
    rotate-half turns each pair by one frequency, what DeepSeek's interleaved RoPE does (transformers'
    ``apply_rotary_pos_emb_interleave`` gives the same layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention with the forward of :class:`entrenar.models.transformer.Attention`:
    ``(x, cos, sin, mask, cache) -> [B, T, hidden]``, where cos/sin are over the rotary part (``head_dim``)."""

    def __init__(self, config: ModelConfig, layer_idx: int, norm: type[nn.Module]) -> None:
        super().__init__()
        assert config.head_dim is not None  # ModelConfig.__post_init__ filled it in
        self.layer_idx = layer_idx
        h, heads = config.hidden_size, config.num_heads
        self.num_heads, self.kv_lora_rank = heads, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.head_dim, config.v_head_dim
        qk = self.nope_dim + self.rope_dim
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = norm(config.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + self.rope_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = norm(config.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=config.o_bias)
        self.interleave = config.rope_interleave
        # What SDPA's default scale (1/sqrt(qk)) is multiplied by: 1 unless YaRN's mscale applies.
        self.query_scale = softmax_temperature(config)
        self.sliding_window = config.sliding_window

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Queries [B, T, heads x qk_head_dim] of ``x``."""
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        heads = self.num_heads
        q = self.queries(x).view(b, t, heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, t, self.kv_lora_rank)
        k_rope = k_rope.reshape(b, 1, t, self.rope_dim)
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1)
        q_rope = q_rope * cos + _rotate_half(q_rope) * sin
        k_rope = k_rope * cos + _rotate_half(k_rope) * sin
        if cache is not None and not isinstance(mask, Documents):
            latent, k_rope = cache.update(self.layer_idx, latent, k_rope)
        s = latent.shape[2]
        kv = self.kv_b_proj(latent).view(b, s, heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, heads, s, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if not isinstance(mask, Documents):  # documents_attention lays the values out itself
            v = v.contiguous()
        return self.o_proj(attention(q, k, v, mask, self.sliding_window))
