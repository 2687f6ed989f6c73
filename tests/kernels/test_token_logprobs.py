"""Chunked token log-probabilities against their specification (log_softmax + gather over full logits)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from entrenar.kernels.token_logprobs import token_logprobs
from entrenar.models.loss import IGNORE_INDEX, token_logprobs_reference


def _problem(n=53, h=32, v=1009, dtype=torch.float64):
    torch.manual_seed(0)
    hidden = torch.randn(n, h, dtype=dtype)
    weight = torch.randn(v, h, dtype=dtype) * 0.3
    labels = torch.randint(0, v, (n,))
    labels[3:7] = IGNORE_INDEX
    labels[-1] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 8, 53, 1000])
def test_values_and_gradients_match_the_specification(chunk):
    hidden, weight, labels = _problem()
    g = torch.randn(hidden.shape[0], dtype=torch.float64)  # an arbitrary upstream gradient, per token

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w)
        (out.double() * g).sum().backward()
        return out, h.grad, w.grad

    ours = run(lambda h, w: token_logprobs(h, w, labels, chunk))
    spec = run(lambda h, w: token_logprobs_reference(h, w, labels))
    assert ours[0].dtype == torch.float32
    assert (ours[0][labels == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(ours[0], spec[0], rtol=1e-6, atol=1e-6)
    # Both upcast the logits to fp32; in float64 inputs the gradient products run in float64 ours, fp32 theirs.
    torch.testing.assert_close(ours[1], spec[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[2], spec[2], rtol=1e-5, atol=1e-6)


def test_gradients_match_autograd_in_fp32():
    hidden, weight, labels = _problem(dtype=torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    token_logprobs(h, w, labels, 16).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    token_logprobs_reference(h2, w2, labels).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)


class _Shapes(TorchDispatchMode):
    """Every tensor any aten op returns, by element count."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_vocabulary_logits_in_forward_or_backward():
    n, v, chunk = 64, 1009, 8
    hidden, weight, labels = _problem(n=n, v=v, dtype=torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _Shapes() as seen:
        token_logprobs(h, w, labels, chunk).sum().backward()
    assert seen.largest <= max(chunk * v, w.numel())  # a chunk of logits, or the weight's gradient
    with _Shapes() as spec:  # the check sees the full logits where they exist
        token_logprobs_reference(hidden, weight, labels)
    assert spec.largest >= n * v


def test_bf16_under_autocast_stays_close():
    hidden, weight, labels = _problem(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = token_logprobs(hidden, weight, labels, 16)
    spec = token_logprobs_reference(hidden.bfloat16(), weight.bfloat16(), labels)
    torch.testing.assert_close(ours, spec, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    hidden, weight, labels = _problem()
    with pytest.raises(ValueError, match="hidden \\[N, H\\]"):
        token_logprobs(hidden[None], weight, labels)
