"""NF4 on the GPU: the Triton dequantization kernel bit for bit, the fused QLoRA layer against the plain one."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, needs_cuda, needs_kernels, rel_err

from entrenar.adapters.lora import LoraLinear
from entrenar.kernels import FusedLoraLinear
from entrenar.kernels.lora_linear import lora_linear
from entrenar.quant.nf4 import kernel as nf4_kernel
from entrenar.quant.nf4.format import (
    NF4Linear,
    NF4Tensor,
    dequantize_nf4,
    dequantize_nf4_reference,
    quantize_nf4,
)

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Normal weights whose scale changes from row to row, so block absmaxes (and their 8-bit codes) vary."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(shape, generator=g)
    return rows * torch.exp(torch.randn(shape[0], 1, generator=g)) * 0.02


def _to(q: NF4Tensor, device: str) -> NF4Tensor:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return NF4Tensor(move(q.codes), move(q.absmax), move(q.absmax_scale), move(q.absmax_offset), q.shape, q.dtype,
                     q.blocksize)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
    same = got.cpu().view(_BITS[want.dtype]) == want.view(_BITS[want.dtype])
    if not same.all():
        i = int((~same).flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} values differ; first at flat index {i}: "
                             f"{got.flatten()[i].item()!r} != {want.flatten()[i].item()!r}")


CASES = [
    # (shape, blocksize, double_quant)
    ((64, 128), 64, True),  # whole blocks
    ((33, 7), 64, True),  # 231 weights: odd count, partial last block
    ((300, 64), 64, True),  # 300 blocks: two groups of 256 absmax scales, the second partial
    ((3, 1000), 32, True),
    ((5, 999), 128, False),  # fp32 absmax
    ((2, 5000), 4096, True),  # one block wider than a program's usual share
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,blocksize,double_quant", CASES)
def test_kernel_equals_the_specification_bit_for_bit(shape, blocksize, double_quant, dtype):
    w = _weight(shape, seed=hash((shape, blocksize, double_quant)) % 2**31)
    q = quantize_nf4(w, blocksize, double_quant)  # quantized on the CPU by the specification
    want = dequantize_nf4_reference(q, dtype)
    got = nf4_kernel.dequantize_nf4_triton(_to(q, DEVICE), dtype)
    assert_same_bits(got, want, f"{shape} blocksize {blocksize} -> {dtype}")


@needs_cuda
def test_cuda_dequantize_dispatches_to_the_kernel_and_a_large_weight_matches(monkeypatch):
    if not nf4_kernel.use_triton(torch.empty(0, device="cuda")):
        pytest.skip("Triton is not installed")
    torch.manual_seed(5)
    layer = NF4Linear.from_linear(torch.nn.Linear(2050, 2047).to(torch.bfloat16))  # odd numel, partial last block
    want_bf16 = dequantize_nf4_reference(layer.quantized)
    want_fp16 = dequantize_nf4_reference(layer.quantized, torch.float16)
    layer.cuda()

    def refuse(*args, **kwargs):
        raise AssertionError("CUDA tensors went through the PyTorch reference")

    monkeypatch.setattr("entrenar.quant.nf4.format.dequantize_nf4_reference", refuse)
    assert_same_bits(layer.weight, want_bf16, "NF4Linear.weight on CUDA")
    assert_same_bits(dequantize_nf4(layer.quantized, torch.float16), want_fp16, "dequantize_nf4 to fp16 on CUDA")


@needs_cuda
def test_nf4_expert_stacks_are_written_in_place_by_the_kernel_and_run_grouped(monkeypatch):
    """On CUDA, NF4 experts' stacks are written expert by expert into one buffer by the kernel (no tensor of its own
    per weight, no PyTorch reference), bit for bit the specification's; ``moe.experts: auto`` runs them grouped, with
    the loop's output and input gradient within bf16 rounding."""
    if not nf4_kernel.use_triton(torch.empty(0, device="cuda")):
        pytest.skip("Triton is not installed")
    from entrenar.models.moe import Experts
    from entrenar.quant.nf4.experts import NF4Experts

    torch.manual_seed(6)
    full = Experts(4, 96, 160, bias=True, activation="clamped_swiglu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(std=0.2)
    experts = NF4Experts.from_experts(full.to(torch.bfloat16))
    want = {"gate_up_proj": torch.stack([torch.cat([dequantize_nf4_reference(experts.expert(e).gate_proj.quantized),
                                                    dequantize_nf4_reference(experts.expert(e).up_proj.quantized)])
                                         for e in range(4)]),
            "down_proj": torch.stack([dequantize_nf4_reference(experts.expert(e).down_proj.quantized)
                                      for e in range(4)])}
    experts.cuda()
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    indices, weights = torch.randint(0, 4, (64, 2), device="cuda"), torch.rand(64, 2, device="cuda")
    experts.implementation = "loop"
    out = experts(x, indices, weights.bfloat16())
    out.float().square().sum().backward()
    loop = [out.detach().float(), x.grad.float()]
    x.grad = None

    def refuse(*args, **kwargs):
        raise AssertionError("an expert weight was dequantized into a tensor of its own")

    monkeypatch.setattr("entrenar.quant.nf4.format.dequantize_nf4_reference", refuse)
    monkeypatch.setattr(nf4_kernel, "dequantize_nf4_triton", refuse)
    for name, expected in want.items():
        assert_same_bits(experts.stacked(name, torch.bfloat16), expected, name)
    experts.implementation = "auto"
    assert experts.use_grouped(x)
    out = experts(x, indices, weights.bfloat16())
    out.float().square().sum().backward()
    for got, ref in zip((out.detach().float(), x.grad.float()), loop, strict=True):
        assert (got - ref).norm() <= 1e-2 * ref.norm()


def test_cpu_tensors_take_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("CPU tensors went to the Triton kernel")

    monkeypatch.setattr(nf4_kernel, "dequantize_nf4_triton", refuse)
    q = quantize_nf4(_weight((16, 40), seed=3))
    assert_same_bits(dequantize_nf4(q, torch.bfloat16), dequantize_nf4_reference(q, torch.bfloat16), "CPU path")


# ---------------------------------------------------------------- the fused QLoRA layer


def _qlora_layer(bias: bool, dtype: torch.dtype, seed: int = 0) -> LoraLinear:
    torch.manual_seed(seed)
    base = NF4Linear.from_linear(torch.nn.Linear(96, 80, bias=bias).to(dtype))
    layer = LoraLinear(base, r=4, alpha=8.0)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.1)  # B = 0 would hide every adapter gradient but dB
    if bias:
        base.bias.requires_grad_(True)
    return layer


def _grads(layer: LoraLinear, out: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    inputs = [x, layer.lora_A.weight, layer.lora_B.weight]
    if layer.base_layer.bias is not None:
        inputs.append(layer.base_layer.bias)
    return list(torch.autograd.grad(out, inputs, dy))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qlora_layer_equals_the_plain_one_in_fp32(bias):
    layer = _qlora_layer(bias, torch.float32)
    x = torch.randn(2, 5, 96, requires_grad=True)
    dy = torch.randn(2, 5, 80)
    plain = layer(x)
    fused = lora_linear(x, layer.base_layer.quantized, layer.base_layer.bias, layer.lora_A.weight,
                            layer.lora_B.weight, layer.scaling)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("dx", "dA", "dB", "dbias"), _grads(layer, fused, x, dy), _grads(layer, plain, x, dy),
                          strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_qlora_layer_in_bf16_is_as_close_to_float64_as_the_plain_layer_under_autocast():
    layer = _qlora_layer(False, torch.bfloat16, seed=1)
    x0, dy0 = torch.randn(4, 96), torch.randn(4, 80)
    q = layer.base_layer.quantized
    w = dequantize_nf4_reference(q, torch.float64)
    a64, b64 = layer.lora_A.weight.double(), layer.lora_B.weight.double()
    exact = x0.double() @ w.T + layer.scaling * (x0.double() @ a64.T) @ b64.T
    x = x0.to(torch.bfloat16).requires_grad_(True)
    fused = lora_linear(x, q, None, layer.lora_A.weight, layer.lora_B.weight, layer.scaling, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = layer(x)
    assert fused.dtype == plain.dtype == torch.bfloat16
    assert rel_err(fused, exact) <= 1.5 * rel_err(plain, exact) + 1e-3
    dx, da, db = torch.autograd.grad(fused, (x, layer.lora_A.weight, layer.lora_B.weight), dy0.to(torch.bfloat16))
    assert (dx.dtype, da.dtype, db.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    dy = dy0.double()
    assert rel_err(dx, dy @ w + layer.scaling * (dy @ b64) @ a64) < 1e-2
    assert rel_err(da, layer.scaling * (dy @ b64).T @ x0.double()) < 1e-2
    assert rel_err(db, layer.scaling * dy.T @ (x0.double() @ a64.T)) < 1e-2


def test_fused_qlora_layer_saves_no_weight_sized_tensor_and_runs_under_autocast():
    layer = _qlora_layer(False, torch.bfloat16)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    x = torch.randn(3, 96, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_linear(x, layer.base_layer.quantized, None, layer.lora_A.weight, layer.lora_B.weight,
                            layer.scaling)
    assert max(saved) < 80 * 96, saved
    y.sum().backward()
    assert layer.lora_A.weight.grad is not None and layer.lora_A.weight.grad.dtype == torch.float32


def test_fused_module_is_a_class_swap_with_the_same_state_and_output():
    layer = _qlora_layer(True, torch.float32)
    x = torch.randn(2, 96)
    plain = layer(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.__class__ = FusedLoraLinear
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-6)
    assert layer.state_dict().keys() == state.keys()
    layer.merge()  # merged: the plain forward, on the dequantized-and-merged base
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
