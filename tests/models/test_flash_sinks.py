"""Attention with sinks through a FlashAttention kernel (``flash_sink_attention``) against the products that
define it (``sink_attention``, transformers' eager gpt-oss attention): outputs and the gradients of q, k, v and
the sinks.

On the CPU the kernel is PyTorch's own flash attention for CPUs (forward with its log-sum-exp, backward handed any
output), whose backward forms ``rowsum(grad * out)`` as the CUDA kernels do; on a GPU, the variable-length kernel
over packed documents with a sliding window and fewer key heads than query heads, as gpt-oss attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from entrenar.models import padding_free
from entrenar.models.attention_sinks import flash_sink_attention, sink_attention
from entrenar.models.padding_free import Documents, documents_attention


@dataclass(frozen=True)
class CpuFlash:
    """PyTorch's CPU flash attention under a fixed boolean mask (q, k, v [B, H, T, D]; log-sum-exp [B, H, T])."""

    mask: torch.Tensor

    def forward(self, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                              attn_mask=self._bias(q))
        return out, lse, torch.empty(0)

    def rows(self, lse):
        return lse.unsqueeze(-1)

    def backward(self, grad, q, k, v, out, lse, aux):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, attn_mask=self._bias(q))

    def _bias(self, q):
        return torch.zeros(self.mask.shape, dtype=q.dtype).masked_fill(~self.mask, float("-inf"))


def _inputs(seed: int, b: int = 2, h: int = 4, t: int = 24, d: int = 16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    sinks = (torch.randn(h, generator=g) * 2).to(device, dtype).requires_grad_()
    return q, k, v, sinks


def _grads(out: torch.Tensor, grad: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, leaves, grad))


@pytest.mark.parametrize("window", [None, 5])
def test_flash_sinks_match_the_products_on_the_cpu_kernel(window: int | None) -> None:
    q, k, v, sinks = _inputs(0)
    t = q.shape[2]
    position = torch.arange(t)
    mask = position[None, :] <= position[:, None]
    if window is not None:
        mask = mask & (position[:, None] - position[None, :] < window)
    mask = mask[None, None].expand(q.shape[0], 1, t, t)

    expected = sink_attention(q, k, v, sinks, mask)
    got = flash_sink_attention(q, k, v, sinks, CpuFlash(mask))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(expected)
    for name, a, b in zip(["q", "k", "v", "sinks"], _grads(got, grad, q, k, v, sinks),
                          _grads(expected, grad, q, k, v, sinks)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_a_sink_far_below_the_scores_leaves_plain_attention() -> None:
    """The sink's share vanishes as its logit falls: the kernel's own attention, its own gradients."""
    q, k, v, _ = _inputs(1)
    sinks = torch.full((q.shape[1],), -1e4)
    t = q.shape[2]
    mask = (torch.arange(t)[None, :] <= torch.arange(t)[:, None])[None, None].expand(q.shape[0], 1, t, t)
    got = flash_sink_attention(q, k, v, sinks, CpuFlash(mask))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(got)
    for a, b in zip(_grads(got, grad, q, k, v), _grads(plain, grad, q, k, v)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's variable-length kernel runs on CUDA")
@pytest.mark.parametrize("window", [None, 8])
def test_packed_documents_with_sinks_run_the_varlen_kernel_on_cuda(window: int | None) -> None:
    """gpt-oss's packed rows (GQA, sliding window, documents of uneven length): the variable-length kernel's path
    against each document through the products, both in bf16; the kernel path reads nothing back to the host."""
    assert padding_free._VARLEN_OPS is not None, "this torch's varlen_attn has no forward/backward ops to call"
    torch.manual_seed(0)
    rows, length, hq, hk, d = 2, 40, 8, 2, 64
    lengths = [7, 20, 13, 25, 1, 14]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    documents = Documents(cu, max(lengths))
    q = torch.randn(rows, hq, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(rows, hk, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(hq, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    got = documents_attention(q, k, v, documents, window, sinks=sinks)
    n = rows * length
    flat = [x.transpose(1, 2).reshape(n, x.shape[1], d) for x in (q, k, v)]
    expected = padding_free._per_document_sinks(*flat, documents, window, sinks).view(got.shape)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(got)
    for name, a, b in zip(["q", "k", "v", "sinks"], _grads(got, grad, q, k, v, sinks),
                          _grads(expected, grad, q, k, v, sinks)):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 3e-2 * scale, f"d{name} differs"
