"""The Triton NF4 dequantization kernel against its specification, bit for bit."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, needs_cuda, needs_kernels

from entrenar.kernels import nf4 as nf4_kernel
from entrenar.quant.nf4 import NF4Linear, NF4Tensor, dequantize_nf4, dequantize_nf4_reference, quantize_nf4

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

    monkeypatch.setattr("entrenar.quant.nf4.dequantize_nf4_reference", refuse)
    assert_same_bits(layer.weight, want_bf16, "NF4Linear.weight on CUDA")
    assert_same_bits(dequantize_nf4(layer.quantized, torch.float16), want_fp16, "dequantize_nf4 to fp16 on CUDA")


def test_cpu_tensors_take_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("CPU tensors went to the Triton kernel")

    monkeypatch.setattr(nf4_kernel, "dequantize_nf4_triton", refuse)
    q = quantize_nf4(_weight((16, 40), seed=3))
    assert_same_bits(dequantize_nf4(q, torch.bfloat16), dequantize_nf4_reference(q, torch.bfloat16), "CPU path")
