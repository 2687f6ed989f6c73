"""QAT: each backward rule against its published formula, LSQ's init, exact conversion, a small task, LoRA-QAT."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters, merge_lora, unload_lora
from entrenar.errors import QuantError
from entrenar.quant.int import QuantLinear, quantize_model_int
from entrenar.quant.qat import FakeQuantLinear, QATConfig, convert_qat, fake_quant, prepare_qat

BITS, QMIN, QMAX = 3, -4, 3


def _clipping_case(seed: int = 0):
    """Values, a per-group scale that clips some of them, and an upstream gradient."""
    torch.manual_seed(seed)
    x = (torch.randn(4, 3, 8) * 1.5).requires_grad_()
    scale = (torch.rand(4, 3, 1) * 0.3 + 0.2).requires_grad_()
    g = torch.randn(4, 3, 8)
    v = (x / scale).detach()
    inside = (v >= QMIN) & (v <= QMAX)
    assert 0 < (~inside).sum() < inside.sum()  # some values clip, most do not
    return x, scale, g, v, inside


def test_forward_rounds_to_the_clamped_grid():
    x, scale, _, v, _ = _clipping_case()
    out = fake_quant(x, scale.detach(), BITS)
    assert torch.equal(out, torch.round(v).clamp(QMIN, QMAX) * scale.detach())


def test_ste_passes_the_gradient_through_unchanged():
    x, scale, g, _, _ = _clipping_case()
    fake_quant(x, scale.detach(), BITS, "ste").backward(g)
    assert torch.equal(x.grad, g)


def test_clipped_ste_zeroes_the_gradient_outside_the_grid():
    x, scale, g, _, inside = _clipping_case()
    fake_quant(x, scale.detach(), BITS, "clipped_ste").backward(g)
    assert torch.equal(x.grad, g * inside)


def test_ewgs_scales_each_element_by_its_rounding_error():
    x, scale, g, v, inside = _clipping_case()
    delta = 0.5  # large enough to see
    fake_quant(x, scale.detach(), BITS, "ewgs", delta=delta).backward(g)
    # Lee et al. 2021, eq. 4, with the rounding error on the [0, 1]-normalised scale (levels 1 / (Qn + Qp) apart).
    err_normalised = (v - torch.round(v)) / (QMAX - QMIN)
    expected = torch.where(inside, g * (1 + delta * torch.sign(g) * err_normalised), torch.zeros_like(g))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(x.grad, g * inside)


def test_lsq_step_gradient_is_the_published_one():
    x, scale, g, v, inside = _clipping_case()
    grad_scale = 1 / math.sqrt(8 * QMAX)
    fake_quant(x, scale, BITS, "lsq", grad_scale=grad_scale).backward(g)
    assert torch.equal(x.grad, g * inside)
    # Esser et al. 2020, eq. 3: d v_hat / d s = round(v) - v inside, -Qn below, Qp above.
    dq_ds = torch.where(v <= QMIN, float(QMIN), torch.where(v >= QMAX, float(QMAX), torch.round(v) - v))
    expected = (g * dq_ds).sum(-1, keepdim=True) * grad_scale
    torch.testing.assert_close(scale.grad, expected, rtol=1e-5, atol=1e-6)

    # The same gradient by autograd through an STE rounding of clamp(x / s) * s.
    s2 = scale.detach().clone().requires_grad_()
    t = (x.detach() / s2).clamp(QMIN, QMAX)
    ((t + (torch.round(t) - t).detach()) * s2).backward(g)
    torch.testing.assert_close(scale.grad, s2.grad * grad_scale, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("granularity,expected_n", [("tensor", 32 * 48), ("channel", 48), ("group", 16)])
def test_lsq_step_init_and_gradient_scale(granularity, expected_n):
    torch.manual_seed(0)
    linear = nn.Linear(48, 32)
    w = linear.weight.detach().clone()
    layer = FakeQuantLinear.from_linear(
        linear, QATConfig(bits=4, granularity=granularity, group_size=16, backward="lsq")
    )
    qp = 7
    groups = {"tensor": w.reshape(1, 1, -1), "channel": w.reshape(32, 1, 48), "group": w.reshape(32, 3, 16)}[
        granularity
    ]
    torch.testing.assert_close(layer.weight_step.detach(), 2 * groups.abs().mean(-1) / math.sqrt(qp))
    assert layer.weight_grad_scale == pytest.approx(1 / math.sqrt(expected_n * qp))

    x = torch.randn(5, 48)
    g = torch.randn(5, 32)
    layer(x).backward(g)
    # Chain rule by hand: dL/dw_q = g^T x, then LSQ's d w_q / d s per element, summed per step, scaled.
    grad_wq = (g.T @ x).reshape(groups.shape)
    s = layer.weight_step.detach().unsqueeze(-1)
    v = groups / s
    dq_ds = torch.where(v <= -8, -8.0, torch.where(v >= qp, float(qp), torch.round(v) - v))
    expected = (grad_wq * dq_ds).sum(-1) / math.sqrt(expected_n * qp)
    torch.testing.assert_close(layer.weight_step.grad, expected, rtol=1e-4, atol=1e-6)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


@pytest.mark.parametrize("backward", ["ste", "clipped_ste", "lsq", "ewgs"])
@pytest.mark.parametrize("granularity,act_bits", [("tensor", None), ("channel", 8), ("group", None), ("group", 6)])
def test_converted_model_computes_exactly_what_the_fake_quantized_one_did(backward, granularity, act_bits):
    model = _mlp()
    cfg = QATConfig(bits=4, granularity=granularity, group_size=16, backward=backward, act_bits=act_bits)
    assert prepare_qat(model, cfg) == ["0", "2"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(20, 32)
    for _ in range(3):  # move weights and LSQ steps away from their initial values
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        expected = model(x)

    assert convert_qat(model) == ["0", "2"]
    assert all(isinstance(model[i], QuantLinear) for i in (0, 2))
    codes = model[0].quantized
    assert codes.bits == 4 and codes.codes.dtype == torch.uint8  # two 4-bit codes per byte
    assert torch.equal(model(x), expected)


def test_prepare_keeps_the_original_parameters_for_existing_optimizers():
    model = _mlp()
    weight, bias = model[0].weight, model[0].bias
    prepare_qat(model, QATConfig(bits=4))
    assert model[0].weight is weight and model[0].bias is bias


@pytest.fixture
def one_thread():
    """Hundreds of steps on tiny tensors: a second thread only adds start-up and contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_small_task_qat_recovers_most_of_the_ptq_gap(one_thread):
    """A 2-layer MLP fits a random teacher; at 3 bits, QAT (LSQ) closes most of the gap PTQ opens."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    x_train, x_test = torch.randn(2048, 16), torch.randn(1024, 16)
    with torch.no_grad():
        y_train, y_test = teacher(x_train), teacher(x_test)

    def train(model: nn.Module, steps: int, lr: float) -> None:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        batches = torch.randint(0, 2048, (steps, 256), generator=torch.Generator().manual_seed(1))
        for idx in batches:
            opt.zero_grad()
            F.mse_loss(model(x_train[idx]), y_train[idx]).backward()
            opt.step()

    def test_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return F.mse_loss(model(x_test), y_test).item()

    torch.manual_seed(1)
    fp = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    train(fp, 400, 3e-3)
    fp_loss = test_loss(fp)

    ptq = copy.deepcopy(fp)
    quantize_model_int(ptq, patterns=["0", "2"], bits=3)
    ptq_loss = test_loss(ptq)

    qat = copy.deepcopy(fp)
    prepare_qat(qat, QATConfig(bits=3, backward="lsq", target_modules=["0", "2"]))
    train(qat, 400, 2e-3)
    convert_qat(qat)  # measure the real integer model
    qat_loss = test_loss(qat)

    numbers = f"FP {fp_loss:.5f}, PTQ {ptq_loss:.5f}, QAT {qat_loss:.5f}"
    assert ptq_loss > 2 * fp_loss, numbers  # 3 bits must hurt, or the test shows nothing
    assert qat_loss < ptq_loss - 0.5 * (ptq_loss - fp_loss), numbers


def test_lora_qat_trains_adapters_on_a_frozen_fake_quantized_base_and_merge_requantizes():
    model = _mlp()
    cfg = QATConfig(bits=4, granularity="channel", backward="ste")
    prepare_qat(model, cfg)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    base = model[0].base_layer
    assert isinstance(base, FakeQuantLinear) and not base.weight.requires_grad
    frozen = base.weight.detach().clone()

    x = torch.randn(16, 32)
    opt = torch.optim.Adam(lora_parameters(model), lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert torch.equal(base.weight, frozen)
    delta = model[0].delta_weight()
    assert delta.abs().max() > 0
    unmerged = model(x)

    merge_lora(model)
    # The merged base is the quantization of W + BA*scaling, not quant(W) + BA*scaling.
    reference = nn.Linear(32, 64)
    with torch.no_grad():
        reference.weight.copy_(frozen + delta)
        reference.bias.copy_(base.bias)
    expected_first = FakeQuantLinear.from_linear(reference, cfg)(x)
    torch.testing.assert_close(model[0](x), expected_first, rtol=0, atol=0)
    merged = model(x)
    assert not torch.allclose(merged, unmerged, atol=1e-6)

    unload_lora(model)
    convert_qat(model)
    assert isinstance(model[0], QuantLinear)
    assert torch.equal(model(x), merged)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"bits": 1}, r"qat\.bits: integer quantization supports 2 to 8 bits, got 1"),
        ({"act_bits": 9}, r"qat\.act_bits: .* got 9"),
        ({"backward": "dorefa"}, r"qat\.backward must be one of"),
        ({"granularity": "row"}, r"qat\.granularity must be one of"),
        ({"granularity": "group", "group_size": 0}, r"qat\.group_size must be a positive integer"),
        ({"ewgs_delta": -1.0}, r"qat\.ewgs_delta must be a finite number >= 0"),
        ({"backward": "lsq", "percentile": 99.0}, r"lsq learns its step"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(kwargs, message):
    with pytest.raises(QuantError, match=message):
        QATConfig(**kwargs)


def test_prepare_names_the_layer_that_does_not_fit():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 8))
    with pytest.raises(QuantError, match=r"^1\.weight: qat\.group_size 32 does not divide in_features 48"):
        prepare_qat(model, QATConfig(granularity="group", group_size=32))
    assert isinstance(model[0], nn.Linear)  # nothing was swapped
    with pytest.raises(QuantError, match="no fake-quantized layers"):
        convert_qat(model)


def test_prepare_after_lora_says_which_order_works():
    model = _mlp()
    apply_lora(model, LoraConfig(r=2, alpha=4, target_modules="all-linear"))
    with pytest.raises(
        QuantError, match=r"^0: QAT wraps nn\.Linear layers, found LoraLinear .*prepare_qat, then apply_lora"
    ):
        prepare_qat(model, QATConfig())
