"""RMSNorm inside the LoRA node of the projections it feeds, against the norm and the plain LoRA layers in turn.

The node is PyTorch around the norm kernel, so it is checked on CPU (the
norm's reference path) and, where Triton runs, with the kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import DEVICE, assert_as_close, lora_group, needs_kernels, rel_err
from torch import nn

from entrenar.kernels.norm_projections import FusedBlock, fits, norm_then_project
from entrenar.kernels.rmsnorm import (
    rms_norm_and_rstd,
    rms_norm_backward,
    rms_norm_backward_reference,
)
from entrenar.models.transformer import RMSNorm


def _norm_and_group(dtype: torch.dtype, device: str = "cpu", train_norm: bool = False, nf4: bool = False):
    """An RMSNorm (random weight) and three LoRA layers reading its output (as q, k, v), plain and fused."""
    plain, fused = lora_group(dtype, device, nf4=nf4)
    torch.manual_seed(10)
    norm = RMSNorm(48, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    norm.weight.requires_grad_(train_norm)
    return norm, plain, fused


def _node(h, norm, layers):
    """The shared node, which must fit: the fallback is not what these tests are about."""

    def fallback(_):
        raise AssertionError("the node did not fit")

    return norm_then_project(h, norm, layers, fallback)


def _run(norm, layers, h0: torch.Tensor, dtype: torch.dtype, together: bool):
    torch.manual_seed(11)
    h = h0.detach().to(dtype).requires_grad_(True)
    ys = _node(h, norm, layers) if together else tuple(layer(norm(h)) for layer in layers)
    dys = [torch.randn(y.shape, device=y.device).to(y.dtype) for y in ys]
    params = [p for m in (norm, *layers) for p in m.parameters() if p.requires_grad]
    return (*ys, *torch.autograd.grad(ys, [h, *params], dys))


@pytest.mark.parametrize("nf4", [False, True], ids=["fp32-bases", "nf4-bases"])
@pytest.mark.parametrize("train_norm", [False, True], ids=["frozen-norm", "trained-norm"])
def test_fp32_matches_the_norm_then_plain_lora(train_norm, nf4):
    norm, plain, fused = _norm_and_group(torch.float32, train_norm=train_norm, nf4=nf4)
    h0 = torch.randn(2, 5, 48) * 3
    assert fits(h0, norm, fused)
    got, want = _run(norm, fused, h0, torch.float32, True), _run(norm, plain, h0, torch.float32, False)
    assert len(got) == len(want) == 3 + 1 + (1 if train_norm else 0) + 6  # outputs, dh, d norm, A and B
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"result {i}")


def test_bf16_is_as_accurate_as_the_norm_then_plain_lora():
    norm, plain, fused = _norm_and_group(torch.bfloat16, train_norm=True)
    exact_norm, exact = copy.deepcopy(norm).double(), [copy.deepcopy(layer).double() for layer in plain]
    h0 = torch.randn(3, 7, 48)
    results = zip(_run(norm, fused, h0, torch.bfloat16, True), _run(norm, plain, h0, torch.bfloat16, False),
                  _run(exact_norm, exact, h0, torch.float64, False))
    for i, (a, p, e) in enumerate(results):
        assert_as_close(a, p, e, f"result {i}")


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-bases", "nf4-bases"])
def test_backward_keeps_the_block_input_not_the_normed_one(nf4):
    norm, _, fused = _norm_and_group(torch.bfloat16, nf4=nf4)
    h = torch.randn(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    params = {p.data_ptr() for m in (norm, *fused) for p in (*m.parameters(), *m.buffers())}  # NF4 codes too
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(("h" if t.data_ptr() == h.data_ptr() else "", tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _node(h, norm, fused)
    # h itself, 1/rms per row, A x of the three adapters (ranks 4 + 2 + 6) and their stacked A: no normed copy,
    # no dequantized copy of an NF4 base
    assert sorted(saved) == sorted([("h", (4, 16, 48)), ("", (64,)), ("", (64, 12)), ("", (12, 48))])


def test_autocast_or_a_norm_of_another_dtype_than_the_input_does_not_fit():
    norm, _, fused = _norm_and_group(torch.float32)
    h = torch.randn(2, 48)
    assert fits(h, norm, fused)
    assert not fits(h.bfloat16(), norm, fused)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fits(h, norm, fused)
    fused[0].merge()
    assert not fits(h, norm, fused)


def test_block_runs_the_plain_way_where_the_node_does_not_fit():
    """A merged adapter: the fused block must give what the plain block gives."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import apply_kernels
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer

    torch.manual_seed(12)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                         num_kv_heads=2)
    plain = Transformer(config)
    plain.reset_parameters()
    apply_lora(plain, LoraConfig(r=2, alpha=4.0))
    fused = copy.deepcopy(plain)
    apply_kernels(fused, ["lora"])
    assert type(fused.model.layers[0]) is FusedBlock
    ids = torch.randint(0, 64, (2, 6))
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)
    fused.model.layers[0].self_attn.k_proj.merge()
    plain.model.layers[0].self_attn.k_proj.merge()
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_qlora_model_runs_every_block_through_the_nodes_and_matches_the_plain_model(monkeypatch):
    """NF4 bases (QLoRA) share the norm-and-projections nodes as 16-bit ones do: same loss, same adapter grads."""
    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
    from entrenar.kernels import apply_kernels, norm_projections
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer
    from entrenar.quant.nf4.format import quantize_model_nf4

    torch.manual_seed(13)
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    plain = Transformer(config)
    plain.reset_parameters()
    quantize_model_nf4(plain)
    apply_lora(plain, LoraConfig(r=4, alpha=8.0))
    for p in lora_parameters(plain):
        nn.init.normal_(p, std=0.05)  # B = 0 would hide every gradient but dB
    fused = copy.deepcopy(plain)
    apply_kernels(fused, ["lora"])
    calls = []
    node = norm_projections.norm_lora_projections
    monkeypatch.setattr(norm_projections, "norm_lora_projections", lambda *a: calls.append(1) or node(*a))
    ids = torch.randint(0, 64, (2, 9))
    losses = [m(ids).logsumexp(-1).mean() for m in (fused, plain)]
    assert len(calls) == 2 * config.num_layers  # q/k/v and gate/up of every block
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(losses[0], lora_parameters(fused)),
                    torch.autograd.grad(losses[1], lora_parameters(plain))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_norm_backward_reference_is_the_gradient_of_the_norm():
    torch.manual_seed(13)
    x = torch.randn(5, 3, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)
    y, rstd = rms_norm_and_rstd(x, w, 1e-6)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, w], dy)
    got = rms_norm_backward_reference(dy, x.detach(), w.detach(), rstd.detach())
    for a, b in zip(got, want):  # the norm computes in fp32 whatever its input, as Llama's does
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_kernel_path_is_as_accurate_as_the_norm_then_plain_lora():
    norm, plain, fused = _norm_and_group(torch.bfloat16, DEVICE, train_norm=True)
    exact_norm, exact = copy.deepcopy(norm).double(), [copy.deepcopy(layer).double() for layer in plain]
    h0 = torch.randn(3, 64, 48, device=DEVICE)
    results = zip(_run(norm, fused, h0, torch.bfloat16, True), _run(norm, plain, h0, torch.bfloat16, False),
                  _run(exact_norm, exact, h0, torch.float64, False))
    for i, (a, p, e) in enumerate(results):
        assert_as_close(a, p, e, f"result {i}")
    # the kernel's backward and the reference's agree on the same rstd
    x, w = h0.bfloat16(), norm.weight.detach()
    _, rstd = rms_norm_and_rstd(x, w, norm.eps)
    dy = torch.randn_like(x)
    for a, b in zip(rms_norm_backward(dy, x, w, rstd), rms_norm_backward_reference(dy, x, w, rstd)):
        assert rel_err(a, b) < 1e-2


def test_under_autocast_of_the_weights_dtype_the_node_runs_and_matches():
    norm, plain, fused = _norm_and_group(torch.bfloat16)
    h = torch.randn(2, 5, 48, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fits(h, norm, fused)
        got = _node(h, norm, fused)
        want = [layer(norm(h)) for layer in plain]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel_err(a, b) < 1e-2
