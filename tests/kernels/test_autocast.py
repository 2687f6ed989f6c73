"""The hand-written autograd paths under autocast: what autocast would give the plain path, gradients included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy
from entrenar.kernels.lora_linear import lora_linear
from entrenar.models.loss import token_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def leaves(*shapes, device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(device).requires_grad_() for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
def test_lora_linear_under_autocast_matches_the_plain_path(device):
    x, w, a, b = leaves((2, 7, 32), (24, 32), (4, 32), (24, 4), device=device)
    results = []
    for fused in (True, False):
        for t in (x, w, a, b):
            t.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            out = lora_linear(x, w, None, a, b, 2.0) if fused else F.linear(x, w) + 2.0 * F.linear(F.linear(x, a), b)
        out.float().square().mean().backward()
        results.append([out.float(), *(t.grad.clone() for t in (x, w, a, b) if t.grad is not None)])
    assert results[0][0].dtype == torch.float32 and len(results[0]) == len(results[1])
    for fused, plain in zip(*results):  # bf16 products in a different order: compare by relative norm
        assert (fused - plain).norm() <= 0.02 * plain.norm(), ((fused - plain).norm(), plain.norm())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_under_autocast_matches_the_plain_path(device):
    hidden, weight = leaves((2, 9, 32), (50, 32), device=device)
    labels = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        fused, n = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=5)
        plain, m = token_cross_entropy(hidden @ weight.T, labels)
    assert int(n) == int(m)
    torch.testing.assert_close(fused.float(), plain.float(), atol=0.05 * int(n), rtol=0.02)
    (g_fused,) = torch.autograd.grad(fused, hidden)
    (g_plain,) = torch.autograd.grad(plain, hidden)
    torch.testing.assert_close(g_fused.float(), g_plain.float(), atol=0.02, rtol=0.05)
