"""Fused RoPE on q and k against its specification (``apply_rope``), and the attention that uses it."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, grads, leaf, needs_kernels

from entrenar.kernels import apply_kernels
from entrenar.kernels.rope import apply_rope, apply_rope_reference
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import KVCache, Transformer


def _angles(batch: int, seq: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4096, (batch, seq), device=device).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).double() / head_dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cos_batch", ["per-row", "shared"])
def test_forward_and_backward_match_the_specification(dtype, cos_batch):
    torch.manual_seed(2)
    b, t, hq, hk, d = 2, 7, 6, 2, 96  # GQA, head_dim/2 = 48 is not a power of two
    # As in the model: q and k are [B, H, T, D] views of [B, T, H, D] projections.
    q0 = torch.randn(b, t, hq, d, device=DEVICE).transpose(1, 2)
    k0 = torch.randn(b, t, hk, d, device=DEVICE).transpose(1, 2)
    cos, sin = _angles(1 if cos_batch == "shared" else b, t, d, DEVICE)
    dq, dk = torch.randn_like(q0), torch.randn_like(k0)

    q, k, qr, kr = leaf(q0, dtype), leaf(k0, dtype), leaf(q0, dtype), leaf(k0, dtype)
    q64, k64 = leaf(q0, torch.float64), leaf(k0, torch.float64)
    out = apply_rope(q, k, cos.to(dtype), sin.to(dtype))
    plain = apply_rope_reference(qr, kr, cos.to(dtype), sin.to(dtype))
    exact = apply_rope_reference(q64, k64, cos.to(dtype).double(), sin.to(dtype).double())
    for name, a, p, e in zip(("q", "k"), out, plain, exact):
        assert_as_close(a, p, e, name)
        assert a.stride() == p.stride(), f"{name}: layout {a.stride()} differs from the plain path's {p.stride()}"
    ga = grads(out, (q, k), (dq.to(dtype), dk.to(dtype)))
    gp = grads(plain, (qr, kr), (dq.to(dtype), dk.to(dtype)))
    ge = grads(exact, (q64, k64), (dq.double(), dk.double()))
    for name, a, p, e in zip(("d q", "d k"), ga, gp, ge):
        assert_as_close(a, p, e, name)


def _tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        **overrides,
    )
    model = Transformer(config)
    model.reset_parameters()
    with torch.no_grad():  # norms away from 1 so q/k norm mix-ups show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize(
    "overrides", [{}, {"qk_norm": True, "model_type": "qwen3", "head_dim": 16}, {"sliding_window": 3}],
    ids=["llama", "qk-norm", "sliding-window"],
)
def test_fused_attention_equals_attention_on_every_branch(monkeypatch, overrides):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU: both run the specification, so equal exactly
    plain = _tiny(**overrides)
    fused = copy.deepcopy(plain)
    assert len(apply_kernels(fused, ["rope"])) == 2
    ids = torch.randint(0, 64, (2, 6))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 2]])
    torch.testing.assert_close(fused(ids), plain(ids), rtol=0, atol=0)
    torch.testing.assert_close(fused(ids, document_ids=docs), plain(ids, document_ids=docs), rtol=0, atol=0)
    caches = KVCache(2), KVCache(2)
    for step in (ids[:, :4], ids[:, 4:5], ids[:, 5:]):
        torch.testing.assert_close(fused(step, cache=caches[0]), plain(step, cache=caches[1]), rtol=0, atol=0)
