"""bench/gpt_oss_folder.py: the random gpt-oss folder bench_e2e.py's qlora-gpt-oss-20b case trains on is what
transformers reads as an MXFP4 checkpoint (its own dequantization), and entrenar loads it to the same logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_e2e import hf_shape_config  # noqa: E402
from gpt_oss_folder import write_mxfp4_folder  # noqa: E402

from entrenar.models.hf import load_hf  # noqa: E402


def test_the_mxfp4_folder_loads_in_transformers_and_entrenar_alike(tmp_path):
    import transformers

    config = hf_shape_config("gpt-oss-20b", tiny=True, vocab=256)
    folder = tmp_path / "gpt-oss"
    write_mxfp4_folder(config, folder, None, shard_bytes=2**15)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # shards and their index, as save_pretrained writes them
    experts = "model.layers.1.mlp.experts.down_proj"
    assert f"{experts}_blocks" in index and f"{experts}_scales" in index and experts not in index
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager").eval()
    experts = ref.model.layers[1].mlp.experts  # transformers' own dequantization of the blocks
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 32, 64)
    assert 0.015 < experts.down_proj.std() < 0.03  # near initializer_range, as the bf16 weights
    model = load_hf(folder).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))  # past the sliding window
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=0)
