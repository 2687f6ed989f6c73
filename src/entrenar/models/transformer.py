"""The decoder-only transformer: one implementation for the whole Llama family.

Module and parameter names equal Hugging Face's, so a checkpoint's state dict
loads as it is and adapter keys follow PEFT's naming. The model knows nothing
of LoRA, quantization or distribution: those replace its modules from outside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.models.attention_dispatch import attention
from entrenar.models.config import ModelConfig, rope_inv_freq
from entrenar.models.fa4 import KERNELS
from entrenar.models.mla import LatentAttention
from entrenar.models.moe import Experts, MoeBlock, Router
from entrenar.models.offload import ActivationOffload
from entrenar.models.padding_free import Documents
from entrenar.models.recompute import checkpointed
from entrenar.models.rope_scaling import longrope_inv_freq, longrope_select, rope_attention_scaling
from entrenar.models.tiled import draws_random, tiled_feed_forward


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: times ``1 + weight``, all in fp32 before the cast back (the weight is stored as
    Gemma's checkpoints hold it, zeros for the identity). A subclass, so the fused RMSNorm kernels leave it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    """The RMSNorm of ``config``'s family."""
    return OffsetRMSNorm if config.norm_unit_offset else RMSNorm


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma's logit soft-capping); ``x`` itself when ``cap`` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k [B, H, T, D] by position; cos/sin are [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class KVCache:
    """Keys and values of past positions, one entry per layer (generation only)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past_k, past_v = self.keys[layer], self.values[layer]
        if past_k is not None:
            assert past_v is not None  # keys and values are set together
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    # How q and k are rotated; a fused kernel replaces this alone (entrenar.kernels.rope).
    rotate = staticmethod(apply_rope)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h, d = config.hidden_size, config.head_dim
        assert d is not None  # ModelConfig.__post_init__ filled it in
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.fused_qkv = config.fused_qkv
        if config.fused_qkv:  # Phi-3's one projection, rows q then k then v
            self.qkv_proj = nn.Linear(h, (config.num_heads + 2 * config.num_kv_heads) * d, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
            self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
            self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            # OLMoE normalises the whole q (k) projection, the Qwen3 families each head.
            full = config.qk_norm_full
            norm = norm_class(config)
            self.q_norm = norm(config.num_heads * d if full else d, config.rms_norm_eps)
            self.k_norm = norm(config.num_kv_heads * d if full else d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.qk_norm_full = config.qk_norm_full
        self.clip_qkv = config.clip_qkv
        self.sliding_window = config.layer_window(layer_idx)
        # Granite's attention_multiplier replaces SDPA's 1/sqrt(head_dim): q is scaled by their ratio.
        multiplier = config.attention_multiplier
        self.q_scale = 1.0 if multiplier is None else multiplier * d ** 0.5
        # Gemma: the scale of q k^T (None: SDPA's 1/sqrt(head_dim)) and the soft cap of the scores.
        scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
        self.scale = None if scale == d ** -0.5 else scale
        self.softcap = config.attn_logit_softcapping
        self.use_rope = config.layer_has_rope(layer_idx)  # SmolLM3 leaves some layers without
        self.rotary_dim, self.rope_interleave = config.rotary_dim, config.rope_interleave
        # gpt-oss: a learned logit per head that every query's softmax counts in its denominator, attending nowhere.
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        """The layers that make q, k and v: three, or Phi-3's one ``qkv_proj``."""
        return (self.qkv_proj,) if self.fused_qkv else (self.q_proj, self.k_proj, self.v_proj)

    def split(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v from the outputs of :attr:`projections`."""
        if not self.fused_qkv:
            q, k, v = outputs
            return q, k, v
        kv = self.num_kv_heads * self.head_dim
        q, k, v = outputs[0].split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        return q, k, v

    def position(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, H, T, D] rotated as this layer's family does: not at all (SmolLM3's NoPE layers), on the first
        ``rotary_dim`` dimensions only (Phi-3's and GLM-4's partial rotary; the rest pass unturned), pairs
        (2i, 2i + 1) (GLM-4); ``rotate`` (a fused kernel's) does the turning itself on (i, i + dim / 2) pairs."""
        if not self.use_rope:
            return q, k
        if self.rope_interleave:
            # Moved to (i, i + dim / 2) pairs, and left there: scores q.k are the same whatever order q and k
            # share, and nothing else reads them (v is untouched).
            r = self.rotary_dim
            order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, q.shape[-1])])
            order = order.to(q.device)
            q, k = q.index_select(-1, order), k.index_select(-1, order)
        if self.rotary_dim == q.shape[-1]:
            return self.rotate(q, k, cos, sin)
        r = self.rotary_dim
        q_rot, k_rot = self.rotate(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of ``x``, before the heads are split; fused kernels run the three as one node."""
        return self.split([layer(x) for layer in self.projections])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        return self.attend(*self.project(x), cos, sin, mask, cache)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attention over the projections [B, T, heads x head_dim], through ``o_proj``."""
        b, t, _ = q.shape
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.position(q, k, cos.to(q.dtype), sin.to(q.dtype))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is not None and not isinstance(mask, Documents):
            k, v = cache.update(self.layer_idx, k, v)
        y = attention(q, k, v, mask, self.sliding_window, scale=self.scale, softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.fused_gate_up = config.fused_gate_up
        if config.fused_gate_up:  # Phi-3's and GLM-4's one projection, gate rows first
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
            self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        """The layers that make gate and up: two, or Phi-3's one ``gate_up_proj``."""
        return (self.gate_up_proj,) if self.fused_gate_up else (self.gate_proj, self.up_proj)

    def split(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """gate and up from the outputs of :attr:`projections`."""
        if not self.fused_gate_up:
            gate, up = outputs
            return gate, up
        gate, up = outputs[0].chunk(2, dim=-1)
        return gate, up

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate and up of ``x``; fused kernels run the two as one node."""
        return self.split([layer(x) for layer in self.projections])

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) * up)``."""
        return self.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(*self.project(x))


class GatedMLP(MLP):
    """``down(act(gate(x)) * up(x))`` with a gate activation other than SiLU (Gemma: GELU, tanh approximation).
    A subclass, so the fused SwiGLU kernels leave it alone."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__(config, intermediate_size)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        norm = norm_class(config)
        self.post_norm = config.post_norm
        if not config.post_norm:
            self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: nn.Module = (LatentAttention(config, layer_idx, RMSNorm) if config.is_mla
                                     else Attention(config, layer_idx))
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        if config.post_norm:  # OLMo 2: post_attention_layernorm norms the attention output, this the MLP's
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        mlp = MLP if config.hidden_act == "silu" else GatedMLP
        self.mlp = MoeBlock(config, mlp) if config.is_moe_layer(layer_idx) else mlp(config)
        self.residual_multiplier = config.residual_multiplier
        self.post_block_norms = config.post_block_norms
        if self.post_block_norms:  # GLM-4: the attention's and the MLP's outputs normed before each residual add
            self.post_self_attn_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, mask, cache))
            return x + self.mlp_half(x)
        if self.post_block_norms:
            x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache))
            return x + self.mlp_half(x)
        m = self.residual_multiplier
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x + (attn if m == 1.0 else attn * m)
        out = self.mlp_half(x)
        return x + (out if m == 1.0 else out * m)

    # Tokens per tile of the MLP half (models/tiled.py; Transformer.set_tiled_mlp); 0: the whole sequence at once.
    mlp_tile: int = 0

    def feed_forward_modules(self) -> tuple[nn.Module, ...]:
        """The modules of the MLP half, in the order they run on the residual stream before its add: the
        post-attention norm and the MLP (pre-norm blocks), the MLP and ``post_feedforward_layernorm`` (OLMo 2's
        post-norm blocks), the post-attention norm, the MLP and ``post_mlp_layernorm`` (GLM-4). Each works token
        by token, so the half runs in tiles of tokens (:meth:`tiled_feed_forward`) whatever the variant."""
        if self.post_norm:
            return self.mlp, self.post_feedforward_layernorm
        if self.post_block_norms:
            return self.post_attention_layernorm, self.mlp, self.post_mlp_layernorm
        return self.post_attention_layernorm, self.mlp

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half of the block before its residual add (and residual multiplier): the
        :meth:`feed_forward_modules` in turn."""
        for module in self.feed_forward_modules():
            x = module(x)
        return x

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`feed_forward` of ``x``, in tiles when :meth:`tiles_mlp` says so."""
        return self.tiled_feed_forward(x) if self.tiles_mlp(x) else self.feed_forward(x)

    def tiles_mlp(self, x: torch.Tensor) -> bool:
        """Whether this call runs :meth:`feed_forward` in tiles: tiling is set and ``x`` has more tokens than one."""
        return bool(self.mlp_tile) and x.shape[:-1].numel() > self.mlp_tile

    def tiled_feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`feed_forward` in tiles of :attr:`mlp_tile` tokens, rerun tile by tile in backward."""
        modules = self.feed_forward_modules()
        params = [p for module in modules for p in module.parameters()]
        return tiled_feed_forward(self.feed_forward, x, self.mlp_tile, params, random=draws_random(modules))


class SandwichBlock(Block):
    """Gemma's block: a norm before and after attention and before and after the MLP (``post_attention_layernorm``
    normalises the attention's output here). A subclass, so the fused block kernels leave it alone."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        norm = norm_class(config)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache))
        return x + self.mlp_half(x)

    def feed_forward_modules(self) -> tuple[nn.Module, ...]:
        """The MLP half between its norms: ``pre_feedforward_layernorm``, the MLP, ``post_feedforward_layernorm``."""
        return self.pre_feedforward_layernorm, self.mlp, self.post_feedforward_layernorm


class Decoder(nn.Module):
    """Embeddings, blocks and the final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        block = SandwichBlock if config.sandwich_norms else Block
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_layers))
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """A Llama-family causal language model returning logits [batch, seq, vocab]."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # Which layers recompute their activations in backward (activation checkpointing), and whether what
        # the layers keep for backward waits in CPU memory (None: on the device).
        self.checkpointed_layers: set[int] = set()
        self.offloaded_layers: set[int] = set()
        self.activation_offload: ActivationOffload | None = None
        self.attention_kernel = "fa2"  # packed rows' variable-length kernel (set_attention_kernel)

    def reset_parameters(self) -> None:
        """Random initialisation as Llama's: normal(0, initializer_range) weights, zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                bias = getattr(module, "bias", None)  # an nn.Embedding has none
                if bias is not None:
                    nn.init.zeros_(bias)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(module.down_proj, mean=0.0, std=std)
                for bias in (module.gate_up_proj_bias, module.down_proj_bias):
                    if bias is not None:
                        nn.init.zeros_(bias)
            elif isinstance(module, OffsetRMSNorm):
                nn.init.zeros_(module.weight)  # 1 + weight: the identity
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, mean=0.0, std=std)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    def set_activation_checkpointing(self, layers: bool | int | Sequence[int], offload: bool | int = False) -> None:
        """Recompute activations in backward for all layers (True), none (False), ``layers`` of them
        spread evenly over the depth (an int), or the listed layer indices; ``offload``: see
        :meth:`set_activation_offload`."""
        self.checkpointed_layers = set(checkpointed_layer_indices(self.config.num_layers, layers))
        self.set_activation_offload(offload)

    def set_tiled_mlp(self, tokens: int) -> list[int]:
        """Run the MLP half of each layer in tiles of ``tokens`` tokens, rerun tile by tile in backward
        (:mod:`entrenar.models.tiled`); 0 puts whole MLPs back. Applies to every block with a dense MLP, whatever
        norms surround it (:meth:`Block.feed_forward_modules`: pre-norm, Gemma's sandwich, OLMo 2's post-norm,
        GLM-4's post-block norms); MoE layers keep theirs whole. Returns the indices of the layers that tile."""
        if tokens < 0:
            raise ValueError(f"tiled MLP needs a positive number of tokens per tile (0: off), got {tokens}")
        tiled = []
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, Block) and isinstance(layer.mlp, MLP):
                layer.mlp_tile = tokens
                tiled.append(i)
        return tiled if tokens else []

    def set_attention_kernel(self, kernel: str) -> None:
        """Which variable-length kernel attends packed and padding-free rows on CUDA: ``"fa2"`` (torch's
        FlashAttention-2) or ``"fa4"`` (FlashAttention-4 on Hopper where it takes the call; :mod:`entrenar.models.fa4`).
        """
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.attention_kernel = kernel

    def set_activation_offload(self, layers: bool | int) -> None:
        """Keep what layers save for backward in pinned CPU memory until backward (:mod:`entrenar.models.offload`):
        every layer's but the last's (True), none (False), or the first ``layers`` layers'. A recomputed layer
        saves only its input. Applies to CUDA tensors; the last layer keeps its own, which backward reads first."""
        self.offloaded_layers = set(offloaded_layer_indices(self.config.num_layers, layers))
        self.activation_offload = ActivationOffload() if self.offloaded_layers else None

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype,
             local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``position_ids``: LongRoPE's long frequencies past the original context, dynamic NTK's
        by each sequence's length, times the attention factor of LongRoPE and YaRN; ``local``: by the sliding
        layers' own base (Gemma 3), unscaled."""
        inv_freq = self._local_inv_freq().float() if local else self.inv_freq.float()
        kind = None if local else (self.config.rope_scaling or {}).get("rope_type")
        if kind == "longrope":
            inv_freq = longrope_select(self.config, position_ids, inv_freq, self._longrope_long(inv_freq.device))
        elif kind == "dynamic":
            inv_freq = self._dynamic_inv_freq(position_ids, inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = 1.0 if local else rope_attention_scaling(self.config)
        if scale != 1.0:
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _dynamic_inv_freq(self, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK's frequencies per token [B, T, dim / 2] (or ``inv_freq`` while no sequence is longer than
        max_position_embeddings): a sequence's base grows with its length, as transformers' dynamic_rope_update
        does for a batch. A sequence is a row, or a document of a packed row (its positions start again at 0), so
        packed documents get the frequencies each gets alone."""
        b, t = position_ids.shape
        flat = position_ids.reshape(-1)
        starts = flat == 0
        starts[::t] = True
        segment = starts.cumsum(0) - 1
        length = torch.zeros(int(segment[-1]) + 1, dtype=flat.dtype, device=flat.device)
        length = length.scatter_reduce(0, segment, flat + 1, reduce="amax")[segment]
        limit = self.config.max_position_embeddings
        if int(length.max()) <= limit:
            return inv_freq
        length = length.clamp(min=limit)
        lengths = torch.unique(length)
        table = torch.stack([rope_inv_freq(self.config, int(n)) for n in lengths.tolist()]).to(inv_freq.device)
        return table[torch.searchsorted(lengths, length)].view(b, t, -1)

    def _longrope_long(self, device: torch.device) -> torch.Tensor:
        """LongRoPE's long-context frequencies in fp32, kept for this config and device (a plain attribute: not
        cast with the weights' dtype)."""
        cached = self.__dict__.get("_longrope_long_inv_freq")
        if cached is None or cached[0] is not self.config or cached[1].device != device:
            cached = (self.config, longrope_inv_freq(self.config, long=True).to(device))
            self.__dict__["_longrope_long_inv_freq"] = cached
        return cached[1]

    def _local_inv_freq(self) -> torch.Tensor:
        """The sliding layers' inverse frequencies (Gemma 3's own base), kept beside ``inv_freq`` on its device.
        Not a buffer: every loader sets ``inv_freq`` alone, and this follows it (and the config) when first used."""
        key = (self.inv_freq.device, self.config.rope_local_theta, self.config.head_dim)
        cached = self.__dict__.get("_local_rope")
        if cached is None or cached[0] != key:
            cached = (key, rope_inv_freq(self.config, local=True).to(self.inv_freq.device))
            self.__dict__["_local_rope"] = cached
        return cached[1]

    def attention_mask(
        self, t: int, document_ids: torch.Tensor | None, device: torch.device, past: int = 0,
        window: int | None | bool = True,
    ) -> torch.Tensor | None:
        """Boolean mask [B or 1, 1, T, past+T], or None for the plain causal case (fast SDPA path);
        ``window``: the layers' sliding window (True: the config's)."""
        window = self.config.sliding_window if window is True else window or None
        if past == 0 and document_ids is None and (window is None or t <= window):
            return None
        q_pos = torch.arange(past, past + t, device=device)[:, None]
        k_pos = torch.arange(past + t, device=device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed = allowed & (q_pos - k_pos < window)
        allowed = allowed[None]
        if document_ids is not None:
            allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])
        return allowed[:, None]

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        kv_index: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, T, hidden] (what the output head reads).

        `cache` (generation only) holds past keys/values and is extended in place.
        `cu_seqlens` (int32 [D + 1]) marks D documents over the rows of `input_ids` read end to end: a
        padding-free row [1, N], or packed rows [B, T] (then it replaces `document_ids`' mask; see
        :mod:`entrenar.models.padding_free`); `max_seqlen` is the longest (computed when not given).
        `kv_index`, `cu_seqlens_k`, `max_seqlen_k` (with `cu_seqlens`): the keys each segment attends when not its
        own tokens (:class:`~entrenar.models.padding_free.Documents`; shared-prompt preference pairs).
        """
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if cache is not None and (document_ids is not None or cu_seqlens is not None):
            raise ValueError("packed or padding-free training batches cannot be combined with a KV cache")
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        if self.config.scale_embeddings:  # sqrt(hidden) rounded to the model dtype first, as Gemma's checkpoints
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        cos, sin = self.rope(position_ids, x.dtype)
        mask: torch.Tensor | Documents | None
        if cu_seqlens is not None:  # a padding-free row, or packed rows read end to end
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            mask = Documents(cu_seqlens.to(device=input_ids.device, dtype=torch.int32), max_seqlen,
                             kernel=self.attention_kernel)
            if kv_index is not None and cu_seqlens_k is not None:  # segments attending shared keys
                mask = Documents(mask.cu_seqlens, max_seqlen, kv_index.to(input_ids.device),
                                 cu_seqlens_k.to(device=input_ids.device, dtype=torch.int32),
                                 max_seqlen_k or int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()),
                                 kernel=self.attention_kernel)
        else:
            mask = self.attention_mask(t, document_ids, input_ids.device, past)
        # Models whose layers differ (Gemma: sliding and global layers, Gemma 3's two RoPE bases) get each
        # layer's mask and rotation; the others share the ones above.
        inputs = self._layer_inputs(position_ids, document_ids, past, (cos, sin, mask), x)
        training = torch.is_grad_enabled()
        offload = None
        if self.activation_offload is not None and training and x.is_cuda:
            shared = {id(y): y for layer_input in inputs for y in layer_input}
            offload = self.activation_offload.forward(self, x.device, shared=tuple(shared.values()))
        for i, layer in enumerate(self.model.layers):
            cos, sin, mask = inputs[i] if len(inputs) > 1 else inputs[0]
            with offload.block(i) if offload is not None and i in self.offloaded_layers else contextlib.nullcontext():
                if i in self.checkpointed_layers and training:
                    x = checkpointed(layer, x, cos, sin, mask)
                else:
                    x = layer(x, cos, sin, mask, cache)
            if offload is not None:
                offload.layer_done(i)
        return self.model.norm(x)

    def _layer_inputs(
        self, position_ids: torch.Tensor, document_ids: torch.Tensor | None, past: int,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | Documents | None], x: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | Documents | None]]:
        """(cos, sin, mask) of each layer, or ``[shared]`` when every layer takes the config's."""
        c = self.config
        if c.layer_types is None and c.rope_local_theta is None:
            return [shared]
        cos, sin, mask = shared
        local = self.rope(position_ids, x.dtype, local=True) if c.rope_local_theta is not None else (cos, sin)
        masks: dict[int | None, torch.Tensor | Documents | None] = {}
        out = []
        for i in range(c.num_layers):
            window = c.layer_window(i)
            if window not in masks:
                masks[window] = mask if isinstance(mask, Documents) else self.attention_mask(
                    x.shape[1], document_ids, x.device, past, window=window or False)
            out.append((*(local if c.layer_uses_local_rope(i) else (cos, sin)), masks[window]))
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        kv_index: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, position_ids, document_ids, cache,
                                    cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, kv_index=kv_index,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        return soft_cap(logits, self.config.final_logit_softcapping)  # Gemma


def to_empty_tied(model: Transformer, device: str | torch.device) -> Transformer:
    """``model.to_empty(device=device)`` with an output head tied to the embeddings allocated once: ``to_empty``
    makes a new parameter for each module holding one, so the tied table would exist twice until re-tied (for
    Gemma-3-4B 1.25 GiB more at load, which was the peak of a memory-matched run)."""
    tied = model.config.tie_word_embeddings
    if tied:
        model.lm_head.register_parameter("weight", None)
    model = model.to_empty(device=device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def compute_device(model: nn.Module) -> torch.device:
    """The device a model computes on: its parameters' device, not counting a frozen input-embedding table
    kept in CPU memory for a GPU model (``training.offload_embeddings``)."""
    devices = [p.device for p in model.parameters()]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))


def offloaded_layer_indices(num_layers: int, layers: bool | int) -> list[int]:
    """The layers whose saved activations wait in CPU memory: every one but the last (True), none (False), or
    the first ``layers`` (the last one never: backward reads it first)."""
    if layers is True or layers is False:
        return list(range(num_layers - 1)) if layers else []
    if not 0 <= layers <= num_layers:
        raise ValueError(f"cannot offload {layers} layers of a {num_layers}-layer model")
    return list(range(min(layers, num_layers - 1)))


def checkpointed_layer_indices(num_layers: int, layers: bool | int | Sequence[int]) -> list[int]:
    """The layers to recompute: all (True), none (False), ``layers`` of them spread evenly (an int),
    or the listed indices (each checked to exist)."""
    if layers is True or layers is False:
        return list(range(num_layers)) if layers else []
    if isinstance(layers, int):
        if not 0 <= layers <= num_layers:
            raise ValueError(f"cannot checkpoint {layers} layers of a {num_layers}-layer model")
        return sorted({i * num_layers // layers for i in range(layers)}) if layers else []
    indices = list(layers)
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer indices {bad} are not layers of a {num_layers}-layer model (0..{num_layers - 1})")
    return sorted(set(indices))
