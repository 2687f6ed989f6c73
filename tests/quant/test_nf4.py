"""NF4 against bitsandbytes (byte for byte), NF4Linear's autograd and memory, and input errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from entrenar.errors import QuantError
from entrenar.quant.nf4.format import (
    NF4_CODE,
    NF4Linear,
    dequantize_nf4,
    dynamic_map,
    quantize_blockwise_8bit,
    quantize_model_nf4,
    quantize_nf4,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (64, 128): whole blocks; (17, 33): odd numel and a partial last block;
# (300, 257): more than 256 absmax values, so several double-quant blocks and a partial one.
SHAPES = [(64, 128), (17, 33), (300, 257)]


@pytest.fixture(scope="module")
def bnb_functional():
    functional = pytest.importorskip("bitsandbytes.functional")
    # bitsandbytes wraps some CPU fallbacks in torch.compile; compiling costs seconds and
    # changes no result, so run them eagerly.
    with torch._dynamo.config.patch(disable=True):
        yield functional


def test_code_tables_equal_bitsandbytes(bnb_functional):
    assert torch.equal(NF4_CODE, bnb_functional.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), bnb_functional.create_dynamic_map(signed=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "fp32-absmax"])
def test_quantize_and_dequantize_match_bitsandbytes(bnb_functional, dtype, shape, double_quant):
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * 0.02).to(dtype)
    w[0, :5] = torch.tensor([0.3, -0.3, 0.0, 1e-6, -0.3])  # an outlier block and exact zeros

    ref_codes, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    q = quantize_nf4(w, blocksize=64, double_quant=double_quant)

    assert torch.equal(q.codes, ref_codes.reshape(-1))
    assert torch.equal(q.absmax, state.absmax)
    if double_quant:
        assert torch.equal(q.absmax_offset, state.offset)
        assert torch.equal(q.absmax_scale, state.state2.absmax)
    ref = bnb_functional.dequantize_4bit(ref_codes, state)
    ours = dequantize_nf4(q)
    assert ours.dtype == dtype and ours.shape == w.shape
    assert torch.equal(ours, ref.reshape(shape))


def test_8bit_statistics_quantizer_matches_bitsandbytes_near_midpoints(bnb_functional):
    # Values on and around the midpoints between dynamic-map codes, tiny values, and an all-zero block:
    # the cases where an approximate nearest-code search can disagree with an exact one.
    code = dynamic_map()
    mids = (code[:-1] + code[1:]) / 2
    near_mids = torch.cat([mids, mids + 1e-6, mids - 1e-6, mids + 2e-5, mids - 2e-5])
    tiny = torch.logspace(-9, -3, 200) * torch.tensor([1.0, -1.0]).repeat(100)
    x = torch.cat([torch.ones(1), near_mids, tiny, torch.zeros(256), torch.randn(37)])
    ref_codes, state = bnb_functional.quantize_blockwise(x, blocksize=256)
    codes, absmax = quantize_blockwise_8bit(x, blocksize=256)
    assert torch.equal(absmax, state.absmax)
    assert torch.equal(codes, ref_codes)


def test_first_element_goes_in_the_high_nibble():
    w = torch.zeros(64)
    w[0], w[1], w[2] = 1.0, -1.0, 0.0  # codes 15 (max), 0 (min), 7 (zero)
    q = quantize_nf4(w, double_quant=False)
    assert q.codes[0].item() == 0xF0
    assert q.codes[1].item() >> 4 == 7
    assert q.absmax.tolist() == [1.0]


def test_dequantize_error_is_bounded_by_half_the_widest_code_gap():
    torch.manual_seed(0)
    w = torch.randn(128, 64)
    deq = dequantize_nf4(quantize_nf4(w, double_quant=False))
    block_absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    widest_gap = (NF4_CODE[1:] - NF4_CODE[:-1]).max()
    err = (deq - w).reshape(-1, 64).abs() / block_absmax
    assert err.max() <= widest_gap / 2 + 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_an_error_naming_the_tensor(bad):
    w = torch.randn(8, 64)
    w[3, 5] = bad
    with pytest.raises(QuantError, match=r"layers\.0\.q_proj\.weight.*1 NaN/inf"):
        quantize_nf4(w, name="layers.0.q_proj.weight")


def test_bad_blocksize_and_dtype_are_errors():
    with pytest.raises(QuantError, match="blocksize must be one of"):
        quantize_nf4(torch.randn(4, 64), blocksize=48, name="w")
    with pytest.raises(QuantError, match="w: NF4 quantizes float32/bfloat16/float16 weights, got torch.float64"):
        quantize_nf4(torch.randn(4, 64, dtype=torch.float64), name="w")


def _nf4_layer(bias: bool = True, seed: int = 0) -> tuple[nn.Linear, NF4Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(96, 40, bias=bias)
    return linear, NF4Linear.from_linear(linear)


def test_nf4_linear_forward_and_backward_use_the_dequantized_weight():
    linear, layer = _nf4_layer()
    w = dequantize_nf4(quantize_nf4(linear.weight))
    assert torch.equal(layer.weight, w)
    assert (layer.in_features, layer.out_features) == (96, 40)
    assert not any(p.requires_grad for p in layer.parameters())

    x = torch.randn(3, 5, 96, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, F.linear(x, w, linear.bias))
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    torch.testing.assert_close(x.grad, grad_out @ w, rtol=0, atol=1e-6)
    # NF4 keeps the layer close to the original.
    rel = (y - linear(x)).norm() / linear(x).norm()
    assert rel < 0.15


def test_to_linear_gives_an_editable_layer_that_computes_the_same():
    _, layer = _nf4_layer()
    linear = layer.to_linear()
    assert isinstance(linear, nn.Linear) and linear.weight.dtype == torch.float32
    x = torch.randn(4, 96)
    assert torch.equal(linear(x), layer(x))
    with torch.no_grad():
        linear.weight.zero_()  # its own storage: the NF4 layer is untouched
    assert layer.weight.abs().max() > 0


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "fp32-absmax"])
def test_casting_the_module_keeps_the_scales_in_fp32(double_quant):
    linear = nn.Linear(64, 32)
    layer = NF4Linear.from_linear(linear, double_quant=double_quant)
    weight = layer.weight
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert all(t.dtype in (torch.uint8, torch.float32) for k, t in layer.state_dict().items() if k != "bias")
    assert torch.equal(layer.weight, weight)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight.to(torch.bfloat16), layer.bias))


def test_nf4_linear_saves_no_weight_sized_tensor_for_backward():
    linear, layer = _nf4_layer()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(4, 96, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x).square().sum()
    assert not [t for t in saved if t.numel() >= linear.weight.numel()], [tuple(t.shape) for t in saved]
    y.backward()
    assert x.grad is not None


def test_qlora_adapter_on_an_nf4_base_gets_the_gradients_of_the_dequantized_model():
    from entrenar.adapters.lora import LoraLinear

    _, layer = _nf4_layer()
    lora = LoraLinear(layer, r=4, alpha=8)
    nn.init.normal_(lora.lora_B.weight)
    reference = LoraLinear(layer.to_linear(), r=4, alpha=8)
    reference.load_state_dict(lora.state_dict(), strict=False)

    x = torch.randn(6, 96)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    lora(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(lora.lora_A.weight.grad, reference.lora_A.weight.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]


def test_bias_gradient_when_bias_is_unfrozen():
    _, layer = _nf4_layer()
    layer.bias.requires_grad_(True)
    x = torch.randn(2, 3, 96)
    grad_out = torch.randn(2, 3, 40)
    layer(x).backward(grad_out)
    torch.testing.assert_close(layer.bias.grad, grad_out.sum((0, 1)))


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "fp32-absmax"])
def test_state_dict_round_trips_through_safetensors(tmp_path, double_quant):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    layer = NF4Linear.from_linear(linear, double_quant=double_quant)
    expected_keys = {"weight_codes", "weight_absmax", "bias"} | (
        {"weight_absmax_scale", "weight_absmax_offset"} if double_quant else set()
    )
    assert set(layer.state_dict()) == expected_keys

    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    fresh = NF4Linear(64, 48, bias=True, dtype=torch.bfloat16, double_quant=double_quant)
    fresh.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), layer(x))
    assert torch.equal(fresh.weight, layer.weight)


class _TinyLM(nn.Module):
    """Enough structure for 'all-linear' (which skips lm_head)."""

    def __init__(self, hidden: int = 128, inter: int = 256, vocab: int = 200):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q_proj": nn.Linear(hidden, hidden, bias=False),
                    "up_proj": nn.Linear(hidden, inter),
                    "down_proj": nn.Linear(inter, hidden),
                }
            )
            for _ in range(2)
        )
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["q_proj"](h)
            h = h + layer["down_proj"](F.gelu(layer["up_proj"](h)))
        return self.lm_head(h)


def test_quantize_model_replaces_linears_and_stores_half_a_byte_per_weight():
    torch.manual_seed(0)
    model = _TinyLM()
    ids = torch.randint(0, 200, (2, 7))
    ref = model(ids)
    shapes = {name: m.weight.shape for name, m in model.named_modules() if isinstance(m, nn.Linear)}

    names = quantize_model_nf4(model)

    assert names == [f"layers.{i}.{p}" for i in range(2) for p in ("q_proj", "up_proj", "down_proj")]
    assert isinstance(model.lm_head, nn.Linear)
    assert all(isinstance(model.get_submodule(n), NF4Linear) for n in names)
    # No full-precision copy of a quantized weight is left anywhere in the model.
    for name in names:
        assert not [k for k, t in model.state_dict().items() if t.shape == shapes[name] and t.is_floating_point()]

    params = sum(shapes[n].numel() for n in names)
    resident = sum(
        t.numel() * t.element_size()
        for n in names
        for k, t in model.get_submodule(n).state_dict().items()
        if k != "bias"
    )
    # 4 bits per weight, plus one 8-bit absmax per 64 weights, one fp32 per 256 absmax and one fp32 offset per layer.
    scales = sum(-(-shapes[n].numel() // 64) + 4 * -(-shapes[n].numel() // (64 * 256)) + 4 for n in names)
    assert abs(resident - (params * 0.5 + scales)) <= 0.05 * (params * 0.5 + scales), (resident, params, scales)

    out = model(ids)
    assert (out - ref).norm() / ref.norm() < 0.1


def test_quantize_model_names_the_layer_with_a_bad_weight():
    model = _TinyLM()
    with torch.no_grad():
        model.layers[1]["up_proj"].weight[0, 0] = float("nan")
    with pytest.raises(QuantError, match=r"layers\.1\.up_proj\.weight"):
        quantize_model_nf4(model)
    assert not any(isinstance(m, NF4Linear) for m in model.modules())  # nothing was swapped


# ---------------------------------------------------------------- the CPU path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", [32, 64, 256])
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "fp32-absmax"])
def test_dequantize_by_bytes_is_bitsandbytes_bit_for_bit(bnb_functional, dtype, blocksize, double_quant):
    """The CPU's dequantization (one gather per code byte) gives bitsandbytes' values, every byte value seen."""
    from entrenar.quant.nf4.format import dequantize_nf4_by_bytes, dequantize_nf4_reference

    torch.manual_seed(blocksize)
    w = (torch.randn(96, 8 * blocksize) * 0.02).to(dtype)  # whole blocks, more than 256 of them at 32
    q = quantize_nf4(w, blocksize=blocksize, double_quant=double_quant)
    assert set(q.codes.tolist()) == set(range(256))
    ref_codes, state = bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4",
                                                    compress_statistics=double_quant)
    ref = bnb_functional.dequantize_4bit(ref_codes, state).reshape(w.shape)
    ours = dequantize_nf4_by_bytes(q)
    assert ours.dtype == dtype and ours.shape == w.shape and torch.equal(ours, ref)
    assert torch.equal(dequantize_nf4(q), ref)  # dispatched to it off CUDA
    for out in (torch.float32, torch.bfloat16, torch.float16):  # bitsandbytes gives the input's dtype only
        assert torch.equal(dequantize_nf4_by_bytes(q, out), dequantize_nf4_reference(q, out))


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


@pytest.fixture
def cpu_without_bf16_products(monkeypatch):
    """This CPU as one without AVX-512 BF16 or AMX (an AVX2 CPU), whatever CPU runs the tests."""
    import entrenar.device

    monkeypatch.setattr(entrenar.device, "_cpu_has_native", lambda bf16: False)


def test_nf4_linear_in_bf16_on_a_cpu_without_bf16_products_multiplies_in_fp32(bnb_functional,
                                                                              cpu_without_bf16_products):
    """PyTorch emulates a bf16 product on such a CPU at about 1/7 of the fp32 rate, so the layer multiplies the
    exact fp32 values of its bf16 operands (the weight as bitsandbytes dequantizes it, in bf16) and rounds the
    result once: within half a bf16 unit in the last place (2**-8 relative) of the float64 product."""
    linear = nn.Linear(192, 40).to(torch.bfloat16)
    layer = NF4Linear.from_linear(linear)
    codes, state = bnb_functional.quantize_4bit(linear.weight.detach(), blocksize=64, quant_type="nf4",
                                                compress_statistics=True)
    w = bnb_functional.dequantize_4bit(codes, state).double()  # bf16 values
    x = torch.randn(3, 5, 192, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    products = _Products()
    with products:
        y = layer(x)
        y.backward(grad_out)
    assert products.dtypes == {torch.float32}
    assert y.dtype == x.grad.dtype == torch.bfloat16
    want_y = F.linear(x.detach().double(), w, linear.bias.detach().double())
    torch.testing.assert_close(y.double(), want_y, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), grad_out.double() @ w, rtol=2**-8, atol=1e-5)
