"""2- and 3-bit integer codes stored at their width (#36): one little-endian bit stream per row, checked against
numpy's ``packbits``; a 3-bit folder's codes take 3/4 of a 4-bit one's; folders round-trip exactly, and a format-1
folder (two codes per byte) still loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from entrenar import quickstart
from entrenar.export.quantize import quantize_pretrained
from entrenar.models.config import ModelConfig
from entrenar.models.hf import save_hf
from entrenar.models.transformer import Transformer
from entrenar.quant.checkpoint import load_quantized, save_quantized
from entrenar.quant.int import QuantLinear, dequantize_int, quantize_int, quantize_model_int

IDS = torch.randint(0, 14, (2, 12), generator=torch.Generator().manual_seed(0))


def reference_bitstream(q: np.ndarray, bits: int) -> np.ndarray:
    """Each row's codes, ``bits`` bits each, least significant first, packed by numpy."""
    unsigned = q.astype(np.int64) & ((1 << bits) - 1)
    row_bits = ((unsigned[:, :, None] >> np.arange(bits)) & 1).reshape(q.shape[0], -1).astype(np.uint8)
    return np.packbits(row_bits, axis=1, bitorder="little")


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("width", [8, 15, 64])
def test_codes_are_numpys_little_endian_bit_stream_and_round_trip(bits, symmetric, width):
    w = torch.randn(5, width, generator=torch.Generator().manual_seed(bits + width))
    q = quantize_int(w, bits=bits, symmetric=symmetric)
    assert q.codes.shape == (5, (width * bits + 7) // 8)
    lo = -(2 ** (bits - 1)) if symmetric else 0
    # the codes as integers, from the scales: w_q / scale (+ zero) is exact on the grid
    grid = (dequantize_int(q, torch.float64) / q.scale.double())
    if not symmetric:
        grid = grid + q.zero.double()
    codes = torch.round(grid).long().numpy()
    assert codes.min() >= lo
    assert np.array_equal(q.codes.numpy(), reference_bitstream(codes, bits))


def tiny_folder(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=quickstart.build_tokenizer().vocab_size, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, model_type="llama")
    model = Transformer(config)
    model.reset_parameters()
    save_hf(model, tmp_path / "model")
    quickstart.build_tokenizer().save(tmp_path / "model")
    return tmp_path / "model"


def codes_bytes(folder):
    return sum(t.numel() for k, t in load_file(folder / "model.safetensors").items() if k.endswith("weight_codes"))


def test_a_3_bit_model_is_3_4_of_a_4_bit_one_and_reports_it(tmp_path):
    source = tiny_folder(tmp_path)
    results = {b: quantize_pretrained(source, tmp_path / f"int{b}", f"int{b}", group_size=32) for b in (2, 3, 4)}
    codes = {b: codes_bytes(r.output) for b, r in results.items()}
    assert codes[3] * 4 == codes[4] * 3 and codes[2] * 2 == codes[4]
    scales = results[4].bytes_after - codes[4]  # the same scales at every width
    assert {b: r.bytes_after - scales for b, r in results.items()} == codes
    # on disk the files differ by exactly the codes
    sizes = {b: (r.output / "model.safetensors").stat().st_size for b, r in results.items()}
    assert abs((sizes[4] - sizes[3]) - (codes[4] - codes[3])) < 256  # the headers' lengths differ a little
    entry = json.loads((results[3].output / "config.json").read_text())["quantization_config"]
    assert entry["format_version"] == 2
    assert json.loads((results[4].output / "config.json").read_text())["quantization_config"]["format_version"] == 1


@pytest.mark.parametrize("bits", [2, 3])
def test_a_folder_round_trips_exactly(tmp_path, bits):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=14, hidden_size=48, intermediate_size=72, num_layers=1,
                                    num_heads=4, num_kv_heads=2, model_type="llama"))
    model.reset_parameters()
    quantize_model_int(model, bits=bits, group_size=24, symmetric=bits == 3)
    model.eval()
    folder = save_quantized(model, None, tmp_path / "q")
    loaded = load_quantized(folder)
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            assert torch.equal(loaded.get_submodule(name).weight_codes, layer.weight_codes)
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


def test_a_format_1_folder_of_3_bits_still_loads(tmp_path):
    """Before format 2, 2- and 3-bit codes were stored two per byte, as 4-bit ones are."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=14, hidden_size=32, intermediate_size=64, num_layers=1,
                                    num_heads=4, num_kv_heads=2, model_type="llama"))
    model.reset_parameters()
    quantize_model_int(model, bits=3, group_size=16)
    model.eval()
    folder = save_quantized(model, None, tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    for key in list(tensors):
        if key.endswith("weight_codes"):
            layer = model.get_submodule(key.rsplit(".", 1)[0])
            q = torch.round(layer.weight.double() / layer.weight_scale.repeat_interleave(16, 1).double()).long()
            nibbles = (q & 0x0F).to(torch.uint8)
            tensors[key] = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format_version"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_quantized(folder)
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))
