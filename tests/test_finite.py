"""The save-time check: no writer puts a NaN or inf on disk, each names the tensor and writes nothing."""

from __future__ import annotations

import pytest
import torch

import entrenar
from entrenar.adapters.lora import LoraConfig, apply_lora, save_adapter
from entrenar.errors import AdapterError, CheckpointError, ModelError
from entrenar.export import save_merged
from entrenar.export.gguf_write import write_gguf
from entrenar.io import finite
from entrenar.models.hf import save_hf
from entrenar.train.checkpoint import latest_checkpoint, save_checkpoint

BAD = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [[float("nan")], [float("inf")], [float("-inf")], [float("nan"), float("inf")]])
def test_first_nonfinite_finds_each_kind_and_counts_every_bad_value(dtype, bad):
    t = torch.randn(5, 8).to(dtype)
    for i, value in enumerate(bad):
        t[2 + i, 5] = value
    tensors = {"ok": torch.ones(3, dtype=dtype), "codes": torch.zeros(4, dtype=torch.uint8),
               "empty": torch.zeros(0, dtype=dtype), "t": t, "later": torch.full((2,), float("nan"))}
    assert finite.first_nonfinite(tensors) == ("t", len(bad))
    assert finite.first_nonfinite({"ok": torch.randn(30).to(dtype) * 1e4}) is None


def test_model_writers_refuse_nan_weights_and_write_nothing(workspace):
    model, tokenizer = entrenar.load(workspace / "model", device="cpu")
    with torch.no_grad():
        dict(model.named_parameters())[BAD][0, 3] = float("nan")
    out = workspace / "out"
    writers = [lambda: save_hf(model, out / "hf"), lambda: save_merged(model, tokenizer, out / "merged"),
               lambda: write_gguf(model, tokenizer, out / "m.gguf", "f16")]
    for write, target in zip(writers, ["hf", "merged", "m.gguf"]):
        with pytest.raises(ModelError, match=rf"^{out / target}: tensor '{BAD}' holds 1 non-finite value\(s\) "
                                             r"\(NaN/inf\); nothing was written"):
            write()
        assert not out.exists() or list(out.iterdir()) == []


def test_save_adapter_refuses_a_nan_adapter(workspace):
    model, _ = entrenar.load(workspace / "model", device="cpu")
    config = LoraConfig(r=2, alpha=4, target_modules=["down_proj"])
    apply_lora(model, config)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.lora_B.weight[1, 0] = float("-inf")
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: tensor "
                                           r"'base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_B\.weight'"):
        save_adapter(model, workspace / "adapter", config)
    assert not (workspace / "adapter").exists()


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_save_checkpoint_refuses_nan_weights_or_moments(tmp_path, where):
    w = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(4)
    optimizer.step()
    save_checkpoint(tmp_path, 1, {"w": w}, optimizer, {})
    state = {"w": w.detach().clone()}
    if where == "model":
        state["w"][2] = float("nan")
        name = r"model\.safetensors: tensor 'w'"
    else:
        optimizer.state[w]["exp_avg"][0] = float("inf")
        name = r"optimizer\.safetensors: tensor 'state\.0\.exp_avg'"
    with pytest.raises(CheckpointError, match=rf"step-2/{name} holds 1 non-finite"):
        save_checkpoint(tmp_path, 2, state, optimizer, {})
    assert latest_checkpoint(tmp_path).name == "step-1"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-1"]
