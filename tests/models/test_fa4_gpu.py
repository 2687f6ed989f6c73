"""FlashAttention-4 against FlashAttention-2 on packed rows, on a Hopper GPU with the extra installed
(``pip install 'entrenar[fa4]'``): the same outputs and q/k/v gradients within bf16 noise."""

from __future__ import annotations

import pytest
import torch

from entrenar.models import fa4
from entrenar.models import padding_free as pf
from entrenar.models.padding_free import Documents, documents_attention

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or fa4.device_capability(CUDA) != fa4.HOPPER or fa4.fa4_module() is None,
    reason="FlashAttention-4 runs here on a Hopper GPU with flash_attn.cute installed (entrenar[fa4])")


def _grads(kernel, q, k, v, docs, window, scale, grad):
    out = documents_attention(q, k, v, Documents(docs.cu_seqlens, docs.max_len, docs.kv_index, docs.cu_seqlens_k,
                                                 docs.max_len_k, kernel=kernel), window, scale=scale)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize(("head_dim", "window", "scale", "shared"), [
    (128, None, None, False), (64, 64, None, False), (128, None, 0.1, False), (64, None, None, True),
    (128, 48, None, True)])
def test_fa4_equals_fa2_forward_and_backward(monkeypatch, head_dim, window, scale, shared):
    torch.manual_seed(0)
    calls = []
    varlen = fa4.fa4_varlen
    monkeypatch.setattr(pf, "fa4_varlen", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    lengths = [300, 17, 1, 512, 90, 104]
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    docs = Documents(cu, max(lengths))
    if shared:  # each odd segment reads the keys of the segment before it again, in front of its own
        index, key_lengths, bounds = [], [], cu.tolist()
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            before = list(range(bounds[i - 1], start)) if i % 2 else []
            index += before + list(range(start, end))
            key_lengths.append(len(before) + end - start)
        cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
        docs = Documents(cu, max(lengths), torch.tensor(index, device=CUDA), cu_k, max(key_lengths))
    q, k, v = (torch.randn(1, h, n, head_dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
               for h in (16, 4, 4))
    grad = torch.randn(1, n, 16, head_dim, device=CUDA, dtype=torch.bfloat16)
    got = _grads("fa4", q, k, v, docs, window, scale, grad)
    assert calls  # FA4 ran, not a fallback
    want = _grads("fa2", q, k, v, docs, window, scale, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)


def test_fa4_replays_from_a_cuda_graph_after_an_eager_call():
    """What the loop's graphs do: eager warm-up calls (FA4 compiles on its first), then capture and replay."""
    torch.manual_seed(0)
    lengths = [1000, 24, 1024]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    docs = Documents(cu, max(lengths), kernel="fa4")
    q, k, v = (torch.randn(1, h, sum(lengths), 128, device=CUDA, dtype=torch.bfloat16) for h in (16, 8, 8))
    eager = documents_attention(q, k, v, docs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        documents_attention(q, k, v, docs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = documents_attention(q, k, v, docs)
    q.normal_()
    graph.replay()
    torch.testing.assert_close(captured, documents_attention(q, k, v, docs), atol=0, rtol=0)
    assert not torch.equal(captured, eager)


def test_fa4_backward_repeats_bit_for_bit_under_deterministic_algorithms():
    """training.deterministic runs under torch's deterministic algorithms, which fa4_varlen hands FA4 as its
    ``deterministic`` flag (a fixed order of the gradient sums, as FA2's varlen backward has there)."""
    torch.manual_seed(0)
    lengths = [700, 3, 1345]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    docs = Documents(cu, max(lengths), kernel="fa4")
    q, k, v = (torch.randn(1, h, sum(lengths), 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
               for h in (32, 8, 8))
    grad = torch.randn(1, sum(lengths), 32, 128, device=CUDA, dtype=torch.bfloat16)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (torch.autograd.grad(documents_attention(q, k, v, docs), (q, k, v), grad) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
