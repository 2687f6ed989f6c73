"""gpt-oss's MXFP4 experts loaded onto a GPU are dequantized there (the packed bytes cross, not fp32 weights; on
the CPU the dequantization takes about half a CPU-minute per gpt-oss-20b layer), to the weights the CPU gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from entrenar.models import gpt_oss_layout
from entrenar.models.hf import load_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU load")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_mxfp4_experts_are_dequantized_on_the_gpu_they_load_onto(tmp_path, monkeypatch):
    from bench_e2e import hf_shape_config
    from gpt_oss_folder import write_mxfp4_folder

    folder = tmp_path / "gpt-oss"
    write_mxfp4_folder(hf_shape_config("gpt-oss-20b", tiny=True, vocab=256), folder, None)
    devices = []
    dequantize = gpt_oss_layout.dequantize_mxfp4

    def spy(blocks, scales, *args, **kwargs):
        devices.append(blocks.device.type)
        return dequantize(blocks, scales, *args, **kwargs)

    monkeypatch.setattr(gpt_oss_layout, "dequantize_mxfp4", spy)
    on_gpu = load_hf(folder, torch.bfloat16, "cuda")
    assert devices and set(devices) == {"cuda"}
    on_cpu = load_hf(folder, torch.bfloat16, "cpu")
    for (name, a), (_, b) in zip(on_gpu.named_parameters(), on_cpu.named_parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=0, rtol=0, msg=name)
