"""Explicit bf16 attention for a CPU: SDPA's causal attention (grouped heads too), within bf16 noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import entrenar.models.padding_free as padding_free
from entrenar.models.cpu_attention import EXPLICIT_MAX_LEN, explicit_causal_attention, explicit_fits
from entrenar.models.padding_free import SDPA_HAS_GQA, Documents, documents_attention

pytestmark = pytest.mark.skipif(not SDPA_HAS_GQA, reason="the references use SDPA's enable_gqa (torch >= 2.5)")


def _qkv(n: int, hq: int, hk: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(h, n, 32, generator=g) * 2).to(dtype).requires_grad_() for h in (hq, hk, hk)]


def _forward_backward(attention, q, k, v, weight):
    out = attention(q, k, v)
    (out.float() * weight).sum().backward()
    grads = [x.grad.double() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    return [out.detach().double(), *grads]


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2)])
def test_explicit_attention_is_sdpas_within_bf16_noise(hq, hk):
    """Outputs and q/k/v gradients against SDPA in fp64 on the same bf16 inputs: relative errors at bf16's
    level and within 2.5 times what SDPA's own bf16 kernel makes (scores rounded to bf16, as transformers' eager
    attention does, would make 3.7x its error on outputs here)."""
    q, k, v = _qkv(77, hq, hk, torch.bfloat16)
    weight = torch.randn(hq, 77, 32, generator=torch.Generator().manual_seed(1))

    def sdpa(dtype):
        return lambda q, k, v: F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                                                              enable_gqa=hq != hk)

    exact = _forward_backward(sdpa(torch.float64), q, k, v, weight)
    flash = _forward_backward(sdpa(torch.bfloat16), q, k, v, weight)
    explicit = _forward_backward(explicit_causal_attention, q, k, v, weight)
    for name, ours, theirs, ref in zip(("out", "dq", "dk", "dv"), explicit, flash, exact):
        err, err_sdpa = ((x - ref).norm() / ref.norm() for x in (ours, theirs))
        assert err < 1e-2 and err < 2.5 * err_sdpa + 5e-4, (name, err, err_sdpa)


def test_explicit_attention_in_fp32_is_exact_causal_attention():
    """The same code in fp32 (no rounding to bf16 between the products) gives SDPA to fp32 precision: the
    formulas of the backward, not only their noise, are right."""
    q, k, v = _qkv(40, 6, 3, torch.float32, seed=2)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    weight = torch.randn(6, 40, 32, generator=torch.Generator().manual_seed(3))
    ours = _forward_backward(explicit_causal_attention, q, k, v, weight)
    ref = _forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                            q64, k64, v64, weight.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_only_short_16bit_documents_on_a_cpu_run_explicitly():
    q = torch.zeros(3, EXPLICIT_MAX_LEN + 1, 16, dtype=torch.bfloat16)
    assert explicit_fits(q, q, q, 100, None) and explicit_fits(q, q, q, EXPLICIT_MAX_LEN, None)
    assert not explicit_fits(q, q, q, EXPLICIT_MAX_LEN + 1, None)  # probabilities kept for backward: bounded
    assert not explicit_fits(q, q, q, 100, window=64)  # a window that cuts the document: SDPA with its mask
    assert not explicit_fits(q.float(), q.float(), q.float(), 100, None)  # fp32: the flash kernel is as fast
    assert not explicit_fits(q, q.float(), q, 100, None)  # mixed dtypes (q/k norms in fp32): SDPA


def test_a_layer_keeps_at_most_its_budget_of_probabilities(monkeypatch):
    """Documents go explicitly until the layer's kept probabilities would pass the budget; the rest go
    through SDPA, and every document still gets its own causal attention."""
    monkeypatch.setattr(padding_free, "EXPLICIT_LAYER_BUDGET", 4 * (30 * 30 + 20 * 20))  # 4 heads: two documents
    explicit = []
    real = padding_free.explicit_causal_attention
    monkeypatch.setattr(padding_free, "explicit_causal_attention",
                        lambda q, k, v: explicit.append(q.shape[1]) or real(q, k, v))
    lengths = [30, 20, 25, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 80, 16, generator=g).bfloat16() for _ in range(3))
    out = documents_attention(q, k, v, Documents(cu, 30)).reshape(80, 4, 16)
    assert explicit == [30, 20]  # 25 would pass the budget; 5 still fits in what is left
    flat = [x.transpose(1, 2).reshape(80, 4, 16) for x in (q, k, v)]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1).double() for x in flat), is_causal=True)
        torch.testing.assert_close(out[start:end].transpose(0, 1).double(), ref, atol=2e-2, rtol=2e-2)


def test_backward_under_autocast_gives_the_same_gradients():
    """A caller may run backward inside ``torch.autocast``: the fp32 score gradient must stay fp32."""
    q, k, v = _qkv(33, 4, 2, torch.bfloat16, seed=7)
    weight = torch.randn(4, 33, 32, generator=torch.Generator().manual_seed(8))
    plain = _forward_backward(explicit_causal_attention, q, k, v, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = explicit_causal_attention(q, k, v)
        (out.float() * weight).sum().backward()
    for name, a, b in zip(("dq", "dk", "dv"), (x.grad.double() for x in (q, k, v)), plain[1:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_documents_attention_gives_each_documents_own_attention_in_bf16_on_a_cpu():
    """Packed rows read end to end (two rows, documents crossing no row boundary), grouped heads: every
    document's output is its own causal attention, whichever way the segment went."""
    lengths = [5, 40, 19, 64]  # rows of 64: [5, 40, 19] and [64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 64, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 64, 16, generator=g).bfloat16() for _ in range(2))
    out = documents_attention(q, k, v, Documents(cu, max(lengths)))  # [B, T, H, D]
    flat_q, flat_k, flat_v = (x.transpose(1, 2).reshape(128, x.shape[1], 16) for x in (q, k, v))
    flat_out = out.reshape(128, 6, 16)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1).double() for x in (flat_q, flat_k, flat_v)),
                                             is_causal=True, enable_gqa=True)
        torch.testing.assert_close(flat_out[start:end].transpose(0, 1).double(), ref, atol=2e-2, rtol=2e-2)
