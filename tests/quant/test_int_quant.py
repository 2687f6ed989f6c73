"""Post-training int8/int4 against torch's affine fake quantization and min-max formulas; GGUF blocks against gguf."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from entrenar.errors import QuantError
from entrenar.quant.int import (
    QuantLinear,
    dequantize_int,
    dequantize_q4_0,
    dequantize_q8_0,
    quantize_int,
    quantize_model_int,
    quantize_q4_0,
    quantize_q8_0,
    weight_error,
)

CONFIGS = [  # bits, group_size, symmetric
    (8, None, True),
    (8, None, False),
    (4, 32, True),
    (4, 64, False),
    (4, 128, True),
    (4, 128, False),
    (3, 32, True),
]


def _weight(seed: int = 0, shape=(48, 256)) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(shape) * 0.05


def _minmax_reference(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool):
    """Scale and zero point straight from the min-max formulas, one group at a time."""
    groups = w.reshape(w.shape[0], -1, group_size or w.shape[1])
    if symmetric:
        return groups.abs().amax(-1) / (2 ** (bits - 1) - 1), None
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    return scale, torch.round(-lo / scale)


@pytest.mark.parametrize("bits,group_size,symmetric", CONFIGS)
def test_minmax_quantization_matches_torch_affine_fake_quant(bits, group_size, symmetric):
    w = _weight()
    q = quantize_int(w, bits, group_size, symmetric)

    scale, zero = _minmax_reference(w, bits, group_size, symmetric)
    torch.testing.assert_close(q.scale, scale, rtol=0, atol=0)
    if symmetric:
        assert q.zero is None
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        zero = torch.zeros_like(scale)
    else:
        assert torch.equal(q.zero.float(), zero)
        qmin, qmax = 0, 2**bits - 1
    # torch's per-channel affine fake quantization, one "channel" per group.
    flat = w.reshape(-1, group_size or w.shape[1])
    ref = torch.fake_quantize_per_channel_affine(flat, scale.reshape(-1), zero.reshape(-1).int(), 0, qmin, qmax)
    deq = dequantize_int(q)
    assert torch.equal(deq, ref.reshape(w.shape))
    # Min-max never clips, so every value is within half a step of the original.
    step = scale.repeat_interleave(group_size or w.shape[1], dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()


def test_storage_is_packed_for_four_bits_and_below():
    w = _weight()
    assert quantize_int(w, 8).codes.dtype == torch.int8
    assert quantize_int(w, 8, symmetric=False).codes.dtype == torch.uint8
    q4 = quantize_int(w, 4, 32)
    assert q4.codes.shape == (48, 128) and q4.codes.dtype == torch.uint8
    assert q4.nbytes == 48 * 128 + 48 * 8 * 4


def test_per_tensor_uses_one_scale():
    w = _weight()
    q = quantize_int(w, 8, per_tensor=True)
    assert q.scale.shape == (1, 1)
    assert q.scale.item() == w.abs().max().item() / 127


def test_percentile_clips_outliers_and_lowers_error_elsewhere():
    w = _weight(1)
    w[:, 7] = 2.0  # one outlier column
    minmax = quantize_int(w, 4, 64, calibration="minmax")
    clipped = quantize_int(w, 4, 64, calibration="percentile", percentile=95.0)
    expected = torch.quantile(w.abs().reshape(48, 4, 64), 0.95, dim=-1) / 7
    torch.testing.assert_close(clipped.scale, expected)
    rest = torch.ones_like(w, dtype=torch.bool)
    rest[:, 7] = False
    err_minmax = (dequantize_int(minmax) - w)[rest].norm()
    err_clipped = (dequantize_int(clipped) - w)[rest].norm()
    assert err_clipped < 0.5 * err_minmax
    assert torch.allclose(dequantize_int(clipped)[:, 7], 7 * clipped.scale[:, 0])  # the outlier saturates


def test_asymmetric_handles_one_signed_weights_better():
    w = _weight(2).abs()  # all positive: symmetric wastes the negative half of the grid
    sym = weight_error(w, dequantize_int(quantize_int(w, 4, 64, symmetric=True)))
    asym = weight_error(w, dequantize_int(quantize_int(w, 4, 64, symmetric=False)))
    assert asym.rel_frobenius < 0.7 * sym.rel_frobenius


def test_all_zero_group_quantizes_to_zero():
    w = _weight()
    w[3, :64] = 0
    for symmetric in (True, False):
        deq = dequantize_int(quantize_int(w, 4, 64, symmetric))
        assert torch.equal(deq[3, :64], torch.zeros(64))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"bits": 1}, r"layers\.2\.mlp\.up_proj\.weight: integer quantization supports 2 to 8 bits, got 1"),
        ({"bits": 16}, r"supports 2 to 8 bits, got 16"),
        ({"bits": 4, "group_size": 48}, r"group_size 48 does not divide in_features 256"),
        ({"calibration": "mse"}, r"calibration must be 'minmax' or 'percentile'"),
        ({"calibration": "percentile", "percentile": 0}, r"percentile must be in \(0, 100\]"),
    ],
)
def test_bad_settings_are_errors_naming_the_tensor(kwargs, message):
    with pytest.raises(QuantError, match=message):
        quantize_int(_weight(), name="layers.2.mlp.up_proj.weight", **kwargs)


def test_non_finite_weight_is_an_error_naming_the_tensor():
    w = _weight()
    w[0, 0] = float("nan")
    w[1, 1] = float("inf")
    with pytest.raises(QuantError, match=r"down_proj\.weight: .* has 2 NaN/inf"):
        quantize_int(w, 8, name="down_proj.weight")


def test_quant_linear_forward_state_dict_and_weight(tmp_path):
    torch.manual_seed(0)
    linear = nn.Linear(128, 32)
    layer = QuantLinear.from_linear(linear, bits=4, group_size=32, symmetric=False)
    assert (layer.in_features, layer.out_features) == (128, 32)
    x = torch.randn(5, 128)
    assert torch.equal(layer(x), F.linear(x, layer.weight, linear.bias))
    assert (layer(x) - linear(x)).norm() / linear(x).norm() < 0.2

    assert torch.equal(layer.to_linear()(x), layer(x))

    half = copy.deepcopy(layer).to(torch.bfloat16)
    assert half.weight_scale.dtype == torch.float32 and half.bias.dtype == torch.bfloat16
    assert torch.equal(half.weight, layer.weight)

    save_file(layer.state_dict(), tmp_path / "q.safetensors")
    assert set(load_file(tmp_path / "q.safetensors")) == {"weight_codes", "weight_scale", "weight_zero", "bias"}
    fresh = QuantLinear.from_linear(nn.Linear(128, 32), bits=4, group_size=32, symmetric=False)
    fresh.load_state_dict(load_file(tmp_path / "q.safetensors"))
    assert torch.equal(fresh(x), layer(x))


def test_quantize_model_reports_per_layer_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    originals = {name: m.weight.detach().clone() for name, m in model.named_children() if isinstance(m, nn.Linear)}
    report8 = quantize_model_int(model, bits=8)
    assert [r.name for r in report8] == ["0", "2"]
    for r in report8:
        w, w_hat = originals[r.name], model.get_submodule(r.name).weight
        assert r.rel_frobenius == pytest.approx(((w_hat - w).norm() / w.norm()).item())
        assert r.max_abs == pytest.approx((w_hat - w).abs().max().item())
        assert "relative Frobenius error" in str(r)

    model4 = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    model4.load_state_dict({f"{k}.weight": v for k, v in originals.items()}, strict=False)
    report4 = quantize_model_int(model4, bits=4, group_size=32)
    assert all(r4.rel_frobenius > 5 * r8.rel_frobenius for r4, r8 in zip(report4, report8))


def test_quantize_model_names_the_layer_whose_group_size_does_not_fit():
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 8))
    with pytest.raises(QuantError, match=r"^1\.weight: group_size 64 does not divide in_features 96"):
        quantize_model_int(model, bits=4, group_size=64)
    assert isinstance(model[0], nn.Linear)  # nothing was swapped


# ---------------------------------------------------------------- GGUF


def _gguf_weight() -> torch.Tensor:
    """Random rows plus the blocks where rounding rules show: zeros, ties for the max, halves."""
    torch.manual_seed(3)
    w = torch.randn(6, 128)
    w[0, :32] = 0.0
    w[1, :32] = torch.linspace(-1, 1, 32)  # +1 and -1 tie for the largest magnitude
    w[2, :32] = torch.arange(32) / 31 * 0.5
    w[3, 32:64] = torch.tensor([0.5, -0.5] * 16) + torch.arange(32) * 1e-3
    w[4, 64:96] = (torch.arange(-16, 16) + 0.5) / 127
    w[4, 95] = 1.0  # so d = 1/127 and the other values sit at half steps
    return w


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_gguf_blocks_match_gguf_quantize_and_dequantize(kind):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    quantize, dequantize = {"Q8_0": (quantize_q8_0, dequantize_q8_0), "Q4_0": (quantize_q4_0, dequantize_q4_0)}[kind]
    for w in (_gguf_weight(), torch.randn(2, 3, 64)):
        data = quantize(w)
        assert data.dtype == np.uint8
        np.testing.assert_array_equal(data, gguf_quants.quantize(w.numpy(), qtype))
        values = dequantize(data)
        assert torch.equal(values, torch.from_numpy(gguf_quants.dequantize(data, qtype)))
        assert values.shape == w.shape


def test_gguf_reconstruction_error_is_half_a_step_plus_the_fp16_scale_rounding():
    w = _gguf_weight()
    blocks = w.reshape(6, -1, 32)
    fp16_rel = 2.0**-11  # relative rounding of the stored fp16 scale
    amax = blocks.abs().amax(-1, keepdim=True)

    d8 = amax / 127
    err8 = (dequantize_q8_0(quantize_q8_0(w)).reshape(blocks.shape) - blocks).abs()
    assert (err8 <= d8 * (0.5 + 127 * fp16_rel) + 1e-7).all()

    # Q4_0's grid is [-8, 7] * d with the block's extreme at -8, so values of the
    # opposite sign beyond 7.5 steps (row 1's +1 tying with -1, for one) saturate at 7.
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    steps = blocks / (extreme / -8)
    d4 = amax / 8
    err4 = (dequantize_q4_0(quantize_q4_0(w)).reshape(blocks.shape) - blocks).abs()
    bound = torch.where(steps > 7.5, 1.0, 0.5 + 8 * fp16_rel) * d4
    assert (err4 <= bound + 1e-7).all()
    assert steps[1, 0, 31] == 8


def test_gguf_errors_name_the_tensor():
    with pytest.raises(
        QuantError, match=r"blk\.0\.attn_q\.weight: Q8_0 needs a last dimension divisible by 32, got shape \(4, 40\)"
    ):
        quantize_q8_0(torch.randn(4, 40), name="blk.0.attn_q.weight")
    w = torch.randn(2, 32)
    w[1, 3] = float("nan")
    with pytest.raises(QuantError, match=r"tok\.weight: .*1 NaN/inf"):
        quantize_q4_0(w, name="tok.weight")
    with pytest.raises(QuantError, match="whole 34-byte blocks"):
        dequantize_q8_0(np.zeros((2, 33), dtype=np.uint8))


def test_suggested_group_sizes_divide_every_width_whatever_size_was_asked():
    from entrenar.export.quantize import suggest_group_sizes

    assert suggest_group_sizes([128, 384], 7) == [64, 32, 16]  # a size below 16 was asked: the nearest that fit
    assert suggest_group_sizes([576, 1536], 128) == [64, 32, 16]  # SmolLM2's widths: 128 does not divide 576
    assert suggest_group_sizes([128, 384], 128) == [128, 64, 32]
    assert suggest_group_sizes([24, 48], 16) == []  # gcd 24: no power of two from 16 up divides it
