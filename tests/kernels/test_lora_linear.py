"""LoRA fused with its base projection (hand-written backward) against the plain ``LoraLinear``.

This op is plain PyTorch, so it is checked on CPU too: alone and with several
projections of one input as one node (``project_together``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_checks import assert_as_close, lora_group, needs_cuda, rel_err
from torch import nn

from entrenar.adapters.lora import LoraLinear
from entrenar.kernels.lora_linear import FusedLoraLinear, project_together


def _pair(dtype: torch.dtype, bias: bool = True, dropout: float = 0.0, device: str = "cpu"):
    """A plain LoRA layer with a random (non-zero) B, and a fused copy of it."""
    torch.manual_seed(6)
    base = nn.Linear(48, 40, bias=bias).to(device=device, dtype=dtype)
    plain = LoraLinear(base, r=4, alpha=8.0, dropout=dropout).to(device)
    with torch.no_grad():
        plain.lora_B.weight.normal_(0, 0.5)
    fused = copy.deepcopy(plain)
    fused.__class__ = FusedLoraLinear
    return plain, fused


def _run(layer: nn.Module, x0: torch.Tensor, dy: torch.Tensor, x_dtype: torch.dtype):
    x = x0.detach().to(x_dtype).requires_grad_(True)
    y = layer(x)
    params = [layer.lora_A.weight, layer.lora_B.weight]
    if layer.base_layer.weight.requires_grad:
        params += [layer.base_layer.weight, layer.base_layer.bias]
    return (y, *torch.autograd.grad(y, [x, *params], dy.to(y.dtype)))


NAMES = ("output", "d x", "d A", "d B", "d W", "d bias")


@pytest.mark.parametrize("train_base", [False, True], ids=["frozen-base", "trained-base"])
def test_fp32_matches_plain_lora(train_base):
    plain, fused = _pair(torch.float32)
    for layer in (plain, fused):
        layer.base_layer.requires_grad_(train_base)
    x0, dy = torch.randn(2, 5, 48), torch.randn(2, 5, 40)
    for name, a, b in zip(NAMES, _run(fused, x0, dy, torch.float32), _run(plain, x0, dy, torch.float32)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_base_with_fp32_adapters_is_as_accurate_as_plain_lora():
    plain, fused = _pair(torch.bfloat16)
    exact = copy.deepcopy(plain).double()
    x0, dy = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    results = zip(NAMES, _run(fused, x0, dy, torch.bfloat16), _run(plain, x0, dy, torch.bfloat16),
                  _run(exact, x0, dy, torch.float64))
    for name, a, p, e in results:
        assert_as_close(a, p, e, name)


ON_CUDA_TOO = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])


@ON_CUDA_TOO
def test_bf16_adapter_math_stays_within_bf16_error(device):
    """On CUDA the adapter gradients are written in fp32 by the products themselves."""
    plain, fused = _pair(torch.bfloat16, device=device)
    fused.lora_compute_dtype = torch.bfloat16
    exact = copy.deepcopy(plain).double()
    x0, dy = torch.randn(3, 7, 48, device=device), torch.randn(3, 7, 40, device=device)
    got, want = _run(fused, x0, dy, torch.bfloat16), _run(exact, x0, dy, torch.float64)
    for name, a, e in zip(NAMES, got, want):
        assert a.dtype == (torch.bfloat16 if name in ("output", "d x") else torch.float32), name
        assert rel_err(a, e) < 1e-2, f"{name}: relative error {rel_err(a, e):.3g}"


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward, parameters excluded."""
    params = {p.data_ptr() for p in layer.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved)


def test_backward_keeps_only_the_small_adapter_activation():
    plain, fused = _pair(torch.bfloat16)
    x = torch.randn(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    xa_bytes = 4 * 16 * plain.r * 4  # A x in fp32
    assert _saved_bytes(fused, x) == xa_bytes
    assert _saved_bytes(plain, x) > 2 * x.numel() * x.element_size()  # an fp32 copy of x, at least


def test_merged_or_dropout_falls_back_to_the_plain_forward():
    plain, fused = _pair(torch.float32, dropout=0.3)
    x = torch.randn(2, 48)
    torch.manual_seed(7)
    y_plain = plain(x)
    torch.manual_seed(7)
    torch.testing.assert_close(fused(x), y_plain, rtol=0, atol=0)  # same dropout mask: the plain path ran
    plain.eval(), fused.eval()
    fused.merge(), plain.merge()
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)


def _run_group(layers, x0: torch.Tensor, x_dtype: torch.dtype, together: bool):
    torch.manual_seed(9)
    x = x0.detach().to(x_dtype).requires_grad_(True)
    ys = project_together(x, layers) if together else tuple(layer(x) for layer in layers)
    dys = [torch.randn(y.shape).to(device=y.device, dtype=y.dtype) for y in ys]
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    return (*ys, *torch.autograd.grad(ys, [x, *params], dys))


@pytest.mark.parametrize("train_base", [False, True], ids=["frozen-base", "trained-base"])
def test_projections_together_match_plain_lora(train_base):
    plain, fused = lora_group(torch.float32, train_base=train_base)
    x0 = torch.randn(2, 5, 48)
    got, want = _run_group(fused, x0, torch.float32, True), _run_group(plain, x0, torch.float32, False)
    assert len(got) == len(want) == 3 + 1 + 6 + (4 if train_base else 0)  # outputs, dx, A and B, W and the bias
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"result {i}")


def test_projections_together_on_nf4_bases_match_plain_qlora():
    """QLoRA: the shared node dequantizes each base where the plain NF4 layers do, so the numbers agree."""
    plain, fused = lora_group(torch.float32, nf4=True)
    x0 = torch.randn(2, 5, 48)
    got, want = _run_group(fused, x0, torch.float32, True), _run_group(plain, x0, torch.float32, False)
    assert len(got) == len(want) == 3 + 1 + 6  # outputs, dx, A and B: the NF4 bases and their bias are frozen
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"result {i}")


def test_projections_together_on_bf16_are_as_accurate_as_plain_lora():
    plain, fused = lora_group(torch.bfloat16)
    exact = [copy.deepcopy(layer).double() for layer in plain]
    x0 = torch.randn(3, 7, 48)
    results = zip(_run_group(fused, x0, torch.bfloat16, True), _run_group(plain, x0, torch.bfloat16, False),
                  _run_group(exact, x0, torch.float64, False))
    for i, (a, p, e) in enumerate(results):
        assert_as_close(a, p, e, f"result {i}")


@ON_CUDA_TOO
def test_projections_together_with_bf16_adapter_math_stay_within_bf16_error(device):
    plain, fused = lora_group(torch.bfloat16, device=device)
    for layer in fused:
        layer.lora_compute_dtype = torch.bfloat16
    exact = [copy.deepcopy(layer).double() for layer in plain]
    x0 = torch.randn(3, 7, 48, device=device)
    for i, (a, e) in enumerate(zip(_run_group(fused, x0, torch.bfloat16, True),
                                   _run_group(exact, x0, torch.float64, False))):
        assert rel_err(a, e) < 1e-2, f"result {i}: relative error {rel_err(a, e):.3g}"


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-bases", "nf4-bases"])
def test_projections_together_keep_one_adapter_activation_for_all(nf4):
    _, fused = lora_group(torch.bfloat16, nf4=nf4)
    x = torch.randn(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
    params = {p.data_ptr() for layer in fused for p in (*layer.parameters(), *layer.buffers())}  # NF4 codes too
    saved = []

    def pack(t):
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        project_together(x, fused)
    # A x of the three adapters (ranks 4 + 2 + 6) and their A matrices stacked, nothing else: one input read,
    # and no dequantized copy of an NF4 base
    assert sorted(saved) == [(12, 48), (64, 12)]


def test_layers_that_cannot_share_a_node_run_one_by_one():
    plain, fused = lora_group(torch.float32)
    fused[1].lora_compute_dtype = torch.bfloat16  # another adapter precision than its neighbours
    x = torch.randn(2, 48)
    for a, b in zip(project_together(x, fused), (layer(x) for layer in fused)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fused[1].lora_compute_dtype = None
    fused[0].merge()
    for a, b in zip(project_together(x, fused), (layer(x) for layer in plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_under_autocast_the_adapter_products_run_in_its_dtype_as_the_plain_layers_do(monkeypatch):
    """fp32 adapters on a bf16 base under bf16 autocast: the plain layers' adapter products run in bf16 (autocast
    casts them), so the shared node's must too; in fp32 they cast every activation and run off the tensor cores.
    (Where bf16 products are native: on a CPU without them the node multiplies in fp32, tested below.)"""
    import entrenar.device

    monkeypatch.setattr(entrenar.device, "_cpu_has_native", lambda bf16: True)
    plain, fused = lora_group(torch.bfloat16)
    x = torch.randn(4, 16, 48, dtype=torch.bfloat16)
    params = {p.data_ptr() for layer in fused for p in layer.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(t.dtype)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = project_together(x.requires_grad_(True), fused)
        want = [layer(x) for layer in plain]
    assert saved and set(saved) == {torch.bfloat16}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel_err(a, b) < 1e-2
    # The adapters enter the node as they are: their fp32 gradients come straight from it, no cast node between.
    adapters = {p for layer in fused for p in (layer.lora_A.weight, layer.lora_B.weight)}
    leaves = {fn.variable for fn, _ in got[0].grad_fn.next_functions if fn is not None and hasattr(fn, "variable")}
    assert adapters <= leaves
    grads = torch.autograd.grad(sum(y.float().sum() for y in got), sorted(adapters, key=id))
    assert {g.dtype for g in grads} == {torch.float32}


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """The operand dtypes of every matrix product run while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                   torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("native", [True, False], ids=["bf16-products", "emulated-bf16"])
def test_qlora_node_under_bf16_autocast_on_a_cpu_matches_the_bitsandbytes_nf4_reference(monkeypatch, native):
    """QLoRA as the SmolLM2 recipe runs it on a CPU: fp32 weights, NF4 bases, bf16 autocast, q/k/v in one node.

    On a CPU without AVX-512 BF16 or AMX (``native=False``: an AVX2 CPU, whatever runs the tests) PyTorch
    emulates bf16 products at about 1/7 of the fp32 rate, so the node multiplies in fp32: the outputs and ``dx``
    are then the float64 result rounded once to bf16 (within 2**-8 relative), with the bases as bitsandbytes
    dequantizes them to bf16, and the adapter gradients are fp32 products (1e-5). With bf16 products
    (``native=True``) the adapter path runs in bf16 as under autocast: within bf16 error (1e-2).
    """
    from entrenar.quant.nf4.format import NF4Linear

    bnb = pytest.importorskip("bitsandbytes.functional")
    import entrenar.device

    monkeypatch.setattr(entrenar.device, "_cpu_has_native", lambda bf16: native)
    torch.manual_seed(8)
    fused, exact = [], []
    # Rows of 64 inputs: a block of 64 codes never spans two rows, which bitsandbytes 0.50.2's AVX-512 CPU
    # dequantize reads wrongly (40% error on 48-wide rows on an AVX-512 CPU, 2026-11-27; its quantize is right).
    for out_features, r, bias in ((40, 4, True), (24, 2, False), (24, 6, False)):
        linear = nn.Linear(64, out_features, bias=bias)
        layer = FusedLoraLinear(NF4Linear.from_linear(linear), r=r, alpha=8.0)
        layer.base_layer.requires_grad_(False)
        with torch.no_grad():
            layer.lora_B.weight.normal_(0, 0.5)
            codes, state = bnb.quantize_4bit(linear.weight, blocksize=64, quant_type="nf4",
                                             compress_statistics=True)
            linear.weight.copy_(bnb.dequantize_4bit(codes, state).to(torch.bfloat16))  # the base bf16 multiplies
            if bias:
                linear.bias.copy_(linear.bias.to(torch.bfloat16))
        ref = copy.deepcopy(layer)
        ref.__class__ = LoraLinear
        ref.base_layer = linear.requires_grad_(False)
        fused.append(layer)
        exact.append(ref.double())
    x0 = torch.randn(3, 7, 64).to(torch.bfloat16)  # autocast's cast of the activations, done here once
    products = _Products()
    with products, torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run_bf16_grads(fused, x0, torch.float32, True)
    want = _run_bf16_grads(exact, x0, torch.float64, False)
    assert len(got) == len(want) == 3 + 1 + 6
    assert (products.dtypes == {torch.float32}) != native
    for i, (a, e) in enumerate(zip(got, want)):
        if native:
            assert rel_err(a, e) < 1e-2, f"result {i}: relative error {rel_err(a, e):.3g}"
        elif i < 4:  # the three outputs and dx: rounded once to bf16
            torch.testing.assert_close(a.double(), e, rtol=2**-8, atol=1e-5, msg=f"result {i}")
        else:  # dA and dB of each adapter
            assert a.dtype == torch.float32 and rel_err(a, e) < 1e-5, f"result {i}: {rel_err(a, e):.3g}"


def _run_bf16_grads(layers, x0: torch.Tensor, x_dtype: torch.dtype, together: bool):
    """:func:`_run_group` with output gradients that are bf16 values in every dtype, as a bf16 model's are."""
    torch.manual_seed(9)
    x = x0.detach().to(x_dtype).requires_grad_(True)
    ys = project_together(x, layers) if together else tuple(layer(x) for layer in layers)
    dys = [torch.randn(y.shape).to(torch.bfloat16).to(y.dtype) for y in ys]
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    return (*ys, *torch.autograd.grad(ys, [x, *params], dys))
