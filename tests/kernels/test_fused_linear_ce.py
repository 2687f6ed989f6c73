"""Fused output projection + cross-entropy against ``token_cross_entropy`` on full logits."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, grads, leaf, needs_kernels

from entrenar.kernels.fused_linear_ce import (
    FUSED_LOSS_CHUNK,
    FUSED_LOSS_LOGITS,
    fused_linear_cross_entropy,
    fused_loss_chunk,
)
from entrenar.models.loss import IGNORE_INDEX, chunked_cross_entropy, token_cross_entropy
from entrenar.models.transformer import soft_cap


def _problem(device, b=2, t=37, h=64, v=5003):
    """Hidden states, an output weight and labels with ignored tokens (one row entirely ignored)."""
    hidden = torch.randn(b, t, h, device=device)
    weight = torch.randn(v, h, device=device) * 0.5
    labels = torch.randint(0, v, (b, t), device=device)
    labels[0, 5:9] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return hidden, weight, labels


@needs_kernels
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("train_weight", [True, False], ids=["full", "frozen-head"])
def test_loss_and_gradients_match_full_logits(dtype, train_weight, softcap):
    torch.manual_seed(3)
    hidden0, weight0, labels = _problem(DEVICE)
    scale = 0.37  # the loop divides the sum by the step's token count: backward must carry the factor

    def run(fn, dtype):
        h, w = leaf(hidden0, dtype), weight0.detach().to(dtype).requires_grad_(train_weight)
        loss, n = fn(h, w)
        inputs = (h, w) if train_weight else (h,)
        return loss, n, grads(loss * scale, inputs, None)

    fused = run(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=16, softcap=softcap), dtype)
    plain = run(lambda h, w: token_cross_entropy(soft_cap(h @ w.T, softcap), labels), dtype)
    exact = run(lambda h, w: token_cross_entropy(soft_cap(h @ w.T, softcap), labels), torch.float64)
    assert int(fused[1]) == int(plain[1]) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    # Soft-capped, the fused path caps each chunk's logits as they are stored (bf16 under bf16), so its loss is
    # a bf16 computation: on an H200 its relative error was 1.03e-4 against the plain path's 3.3e-5.
    assert_as_close(fused[0], plain[0], exact[0], "loss sum", computed_in=dtype if softcap else None)
    for name, a, p, e in zip(("d hidden", "d weight"), fused[2], plain[2], exact[2]):
        assert_as_close(a, p, e, name)


@needs_kernels
def test_without_grad_only_the_loss_is_computed():
    torch.manual_seed(4)
    hidden, weight, labels = _problem(DEVICE, v=300)
    with torch.no_grad():
        loss, n = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=7)
    ref, ref_n = token_cross_entropy(hidden.double() @ weight.double().T, labels)
    assert int(n) == int(ref_n)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("train_weight", [True, False], ids=["full", "frozen-head"])
def test_cpu_path_matches_the_chunked_specification(monkeypatch, train_weight, softcap):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch row pass, even where the interpreter is on
    torch.manual_seed(5)
    hidden, weight, labels = _problem("cpu", v=97)
    results = []
    for fn in (fused_linear_cross_entropy, chunked_cross_entropy):
        h, w = leaf(hidden), weight.detach().clone().requires_grad_(train_weight)
        loss, n = fn(h, w, labels, chunk_size=10, softcap=softcap)
        results.append((loss, n, grads(loss * 0.5, (h, w) if train_weight else (h,), None)))
    (loss, n, g), (ref, ref_n, g_ref) = results
    assert torch.equal(n, ref_n)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [32000, 49152, 128256, 151936, 262144, 2_000_000])
def test_chunk_for_a_vocabulary_is_the_longest_within_the_logits_bound(vocab):
    """Gemma's 262k vocabulary at 1024 tokens a chunk held 0.5 GiB of bf16 logits (more than a checkpointed layer)."""
    chunk = fused_loss_chunk(vocab)
    assert chunk % 128 == 0 and 128 <= chunk <= FUSED_LOSS_CHUNK
    assert chunk == 128 or chunk * vocab <= FUSED_LOSS_LOGITS
    assert chunk == FUSED_LOSS_CHUNK or (chunk + 128) * vocab > FUSED_LOSS_LOGITS
    assert fused_loss_chunk(262144) == 512 and fused_loss_chunk(128256) == FUSED_LOSS_CHUNK


def test_arguments_it_cannot_take_are_named_by_the_specification():
    hidden, weight, labels = _problem("cpu", v=31)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        fused_linear_cross_entropy(hidden, weight[:, :5], labels)


@pytest.mark.parametrize("fn", [chunked_cross_entropy, fused_linear_cross_entropy], ids=["specification", "fused"])
def test_soft_capped_logits_match_full_capped_logits_in_fp64(fn):
    """Gemma's final-logit soft-capping inside the chunked loss: loss and gradients of the capped full logits."""
    torch.manual_seed(6)
    hidden, weight, labels = _problem("cpu", v=113)
    h, w = leaf(hidden.double()), weight.double().requires_grad_(True)
    loss, _ = fn(h, w, labels, chunk_size=9, softcap=2.5)
    got = grads(loss, (h, w), None)
    h2, w2 = leaf(hidden.double()), weight.double().requires_grad_(True)
    ref, _ = token_cross_entropy(soft_cap(h2 @ w2.T, 2.5), labels)
    expected = grads(ref, (h2, w2), None)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)  # both losses are summed in fp32
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    uncapped, _ = token_cross_entropy(h2 @ w2.T, labels)
    assert abs(float(uncapped) - float(ref)) > 1.0  # the cap changes the loss: the test can fail


@pytest.mark.parametrize("fn", [chunked_cross_entropy, fused_linear_cross_entropy], ids=["specification", "fused"])
def test_logits_scaling_then_soft_cap_match_full_logits_in_fp64(fn):
    """Granite's logits_scaling and Gemma's soft cap together, in the order the decoder applies them (divided,
    then capped): loss and gradients of those full logits."""
    torch.manual_seed(7)
    hidden, weight, labels = _problem("cpu", v=89)
    h, w = leaf(hidden.double()), weight.double().requires_grad_(True)
    loss, _ = fn(h, w, labels, chunk_size=9, logits_scaling=0.5, softcap=2.5)
    got = grads(loss, (h, w), None)
    h2, w2 = leaf(hidden.double()), weight.double().requires_grad_(True)
    ref, _ = token_cross_entropy(soft_cap(h2 @ w2.T / 0.5, 2.5), labels)
    expected = grads(ref, (h2, w2), None)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    capped_first, _ = token_cross_entropy(soft_cap(h2 @ w2.T, 2.5) / 0.5, labels)
    assert abs(float(capped_first) - float(ref)) > 1.0  # the order matters: the test can fail
