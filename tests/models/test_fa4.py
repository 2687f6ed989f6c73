"""FlashAttention-4 for packed rows (models/fa4.py), on a CPU: a stand-in ``flash_attn.cute`` takes the call.

The stand-in computes attention as FA4 4.0.0b36's ``flash_attn_varlen_func`` documents it (causal, or local with
``window_size=(left, right)``, both aligned bottom-right: ``mask.py``), in fp32 from its own loops, so these tests
check what entrenar hands FA4 and that FA4's semantics then give what FA2's path gives. The kernel itself runs in
tests/models/test_fa4_gpu.py (Hopper only).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from entrenar.models import fa4
from entrenar.models import padding_free as pf
from entrenar.models.hf import load_hf
from entrenar.models.padding_free import Documents, documents_attention


class FakeFA4:
    """``flash_attn.cute`` with ``flash_attn_varlen_func``: records each call and computes its output."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.module = types.ModuleType("flash_attn.cute")
        self.module.flash_attn_varlen_func = self.varlen  # type: ignore[attr-defined]

    def varlen(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               softmax_scale=None, causal=False, window_size=(None, None), deterministic=False, **rest):
        assert not rest, rest
        self.calls.append({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                           "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "softmax_scale": softmax_scale,
                           "causal": causal, "window_size": window_size, "deterministic": deterministic})
        left, right = window_size
        if causal:
            right = 0
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            for i in range(nq):
                for h in range(q.shape[1]):
                    scores = []
                    for j in range(nk):  # bottom-right: query i sits at key position i + nk - nq
                        d = i + nk - nq - j
                        seen = (right is None or d >= -right) and (left is None or d <= left)
                        dot = float(q[cq[b] + i, h].float() @ k[ck[b] + j, h // groups].float())
                        scores.append(dot * scale if seen else -math.inf)
                    p = torch.tensor(scores).softmax(0)
                    out[cq[b] + i, h] = p @ v[ck[b]:ck[b + 1], h // groups].float()
        return out.to(q.dtype), torch.zeros(q.shape[1], q.shape[0])  # (out, lse) as 4.0.0b36 returns


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in flash_attn.cute on a make-believe Hopper device (any tensor's device reads as 9.0), with the
    variable-length path taken on a CPU (what ``_varlen_fits`` allows only on CUDA)."""
    fake = FakeFA4()
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake.module)
    monkeypatch.setattr(fa4, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(pf, "_varlen_fits", lambda *args, **kwargs: True)
    return fake


@pytest.fixture
def fake_fa2(monkeypatch):
    """torch's varlen_attn replaced by a recorder returning zeros (what a fallback would call)."""
    calls = []

    def varlen_attn(q, k, v, *args, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(pf, "_varlen_attn", varlen_attn)
    return calls


def _qkv(lengths, hq=4, hk=2, d=16, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)

    def draw(h, dim):
        return torch.randn(1, h, n, dim, generator=g).to(torch.bfloat16)

    return draw(hq, d), draw(hk, d), draw(hk, dv or d)


def _documents(lengths, kernel="fa4"):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return Documents(cu, max(lengths), kernel=kernel)


@pytest.mark.parametrize(("window", "scale"), [(None, None), (4, 0.3), (100, None)])
def test_fa4_gets_the_segments_causal_window_scale_and_gqa_heads_as_they_are(fake_fa4, window, scale):
    """The call bench/varlen_backends.py verified on an H100, with FA2's semantics: the window as (window - 1, 0)
    where it cuts a segment (a window no segment reaches is plain causal), the scale, 2 key heads for 4 query
    heads as they are; the output is what FA2's path computes (per-document SDPA here)."""
    lengths = [7, 1, 12, 5]
    q, k, v = _qkv(lengths)
    docs = _documents(lengths)
    got = documents_attention(q, k, v, docs, window, scale=scale)
    assert len(fake_fa4.calls) == 1
    call = fake_fa4.calls[0]
    assert call["cu_seqlens_q"] is docs.cu_seqlens and call["cu_seqlens_k"] is docs.cu_seqlens
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (12, 12)
    assert call["causal"] is True and call["softmax_scale"] == scale and call["deterministic"] is False
    assert call["window_size"] == ((window - 1, 0) if window is not None and window < 12 else (None, None))
    assert call["q"].shape == (sum(lengths), 4, 16) and call["k"].shape == call["v"].shape == (sum(lengths), 2, 16)
    want = pf._per_document(*(x[0].transpose(0, 1) for x in (q, k, v)), docs, window, scale)
    torch.testing.assert_close(got.float(), want.view(got.shape).float(), atol=2e-2, rtol=2e-2)


def test_fa4_takes_segments_with_fewer_queries_than_keys_aligned_bottom_right(fake_fa4):
    """Shared-prompt pairs: each segment attends gathered keys (kv_index), its last query seeing its last key, as
    FA2's kernel aligns them and FA4's mask.py does (offset seqlen_k - seqlen_q)."""
    lengths = [6, 4, 3]  # prompt+chosen, rejected (reads the prompt's 3 keys again), a third
    q, k, v = _qkv(lengths, seed=1)
    cu = torch.tensor([0, 6, 10, 13], dtype=torch.int32)
    kv_index = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11, 12])
    cu_k = torch.tensor([0, 6, 13, 16], dtype=torch.int32)
    docs = Documents(cu, 6, kv_index, cu_k, 7, kernel="fa4")
    got = documents_attention(q, k, v, docs, window=3)
    call = fake_fa4.calls[0]
    assert call["cu_seqlens_k"] is cu_k and (call["max_seqlen_q"], call["max_seqlen_k"]) == (6, 7)
    assert call["k"].shape[0] == 16 and call["window_size"] == (2, 0)
    k3, v3 = (x[0].transpose(0, 1).index_select(0, kv_index) for x in (k, v))
    want = pf._per_document(q[0].transpose(0, 1), k3, v3, docs, 3)
    torch.testing.assert_close(got.float(), want.view(got.shape).float(), atol=2e-2, rtol=2e-2)


def test_narrower_values_reach_fa4_padded_to_the_query_head_size(fake_fa4):
    """MLA's values (narrower than its queries) are padded with zero columns, as for FA2, and cut off again."""
    lengths = [5, 9]
    q, k, v = _qkv(lengths, d=16, dv=8)
    got = documents_attention(q, k, v, _documents(lengths))
    assert fake_fa4.calls[0]["v"].shape[-1] == 16 and got.shape[-1] == 8
    want = pf._per_document(*(x[0].transpose(0, 1) for x in (q, k, v)), _documents(lengths), None)
    torch.testing.assert_close(got.float(), want.view(got.shape).float(), atol=2e-2, rtol=2e-2)


def test_deterministic_algorithms_ask_fa4_for_its_fixed_order_backward(fake_fa4):
    lengths = [4, 3]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        documents_attention(*_qkv(lengths), _documents(lengths))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert fake_fa4.calls[0]["deterministic"] is True


@pytest.mark.parametrize("case", ["fa2 kernel", "not hopper", "not installed", "compiling", "fp32", "head 264"])
def test_fa4_falls_back_to_fa2_where_it_cannot_take_the_call(fake_fa4, fake_fa2, monkeypatch, case):
    lengths = [5, 3]
    q, k, v = _qkv(lengths, d=264 if case == "head 264" else 16)
    docs = _documents(lengths, kernel="fa2" if case == "fa2 kernel" else "fa4")
    if case == "not hopper":
        monkeypatch.setattr(fa4, "device_capability", lambda device: (8, 0))
    elif case == "not installed":
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    elif case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    documents_attention(q, k, v, docs)
    assert fake_fa4.calls == [] and len(fake_fa2) == 1


def test_sinks_and_soft_capped_scores_never_reach_fa4(fake_fa4):
    lengths = [5, 3]
    q, k, v = _qkv(lengths)
    documents_attention(q, k, v, _documents(lengths), softcap=5.0)
    assert fake_fa4.calls == []


def test_the_model_hands_its_attention_kernel_to_every_layer(fake_fa4, hf_folder, monkeypatch):
    """``set_attention_kernel("fa4")`` (what prepare does from the plan) sends every layer's packed rows to FA4,
    which gives the logits of the default path (per-document attention on a CPU)."""
    folder, hf = hf_folder("llama")
    model = load_hf(folder).to(torch.bfloat16)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    ids = torch.randint(0, hf.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in (5, 7, 8)])[None]
    with torch.no_grad():
        model.set_attention_kernel("fa4")
        got = model(ids, positions, cu_seqlens=cu, max_seqlen=8)
        assert len(fake_fa4.calls) == hf.config.num_hidden_layers
        model.set_attention_kernel("fa2")
        monkeypatch.setattr(pf, "_varlen_fits", lambda *args, **kwargs: False)  # a CPU's path: SDPA by document
        want = model(ids, positions, cu_seqlens=cu, max_seqlen=8)
    assert len(fake_fa4.calls) == hf.config.num_hidden_layers
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="attention kernel must be one of fa2, fa4, got 'fa3'"):
        model.set_attention_kernel("fa3")


def test_fa4_availability_names_the_extra_and_the_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    assert "pip install 'entrenar[fa4]'" in fa4.fa4_unavailable(torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", FakeFA4().module)
    assert "this run trains on cpu" in fa4.fa4_unavailable(torch.device("cpu"))
    monkeypatch.setattr(fa4, "device_capability", lambda device: (10, 0))
    assert "compute capability 10.0" in fa4.fa4_unavailable(torch.device("cuda"))
    monkeypatch.setattr(fa4, "device_capability", lambda device: (9, 0))
    assert fa4.fa4_unavailable(torch.device("cuda")) is None
