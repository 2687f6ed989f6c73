"""``training.deterministic`` on a CUDA device: two runs, and a run resumed after a crash, give the same bits.

Documents here are longer than FlashAttention's key blocks, whose backward adds each block's share of a query's
gradient with atomics: without the mode, two such runs differed from step 2 on (bench/det_control.py,
docs/TRAINING.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_loop import recipe_for

from conftest import crash_after_step
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# bf16 LoRA on packed rows: FlashAttention's varlen kernel, the fused kernels, CUDA graphs and overlapped steps.
COMMON = ["model.device=cuda", "model.dtype=bfloat16", "lora.dropout=0", "data.seq_len=1024", "training.batch_size=4",
          "optimizer.fused=true"]


def long_documents(ws) -> list[str]:
    """Overrides that train a wider model (head size 64) on ~900-token documents in the workspace."""
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.config import ModelConfig
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=Tokenizer.from_folder(ws / "model").vocab_size, hidden_size=256,
                         intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                         max_position_embeddings=2048, model_type="llama")
    model = Transformer(config)
    model.reset_parameters()
    save_hf(model, ws / "wide")
    Tokenizer.from_folder(ws / "model").save(ws / "wide")
    with open(ws / "long.jsonl", "w") as f:
        for a in range(40):
            completion = "".join(str((a * 7 + i * i) % 10) for i in range(900))
            f.write(json.dumps({"prompt": f"{a}=", "completion": completion}) + "\n")
    return [f"model.path={ws / 'wide'}", f"data.train={ws / 'long.jsonl'}", *COMMON]


def records(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def adapters(run):
    return load_file(str(run.output / "adapter_model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_deterministic_runs_repeat_bit_for_bit(workspace):
    common = long_documents(workspace)
    runs = [train(recipe_for(workspace, *common, "training.deterministic=true", f"output.dir={workspace / n}"),
                  progress=False) for n in ("a", "b")]
    assert records(runs[0].run_dir) == records(runs[1].run_dir)
    assert same(adapters(runs[0]), adapters(runs[1]))
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back


def test_a_deterministic_run_resumed_after_a_crash_ends_with_the_same_bits(workspace, monkeypatch):
    common = long_documents(workspace)
    straight = train(recipe_for(workspace, *common, "training.deterministic=true", f"output.dir={workspace / 's'}"),
                     progress=False)
    recipe = recipe_for(workspace, *common, "training.deterministic=true")
    crash_after_step(monkeypatch, recipe, 7)  # the last checkpoint is step 6
    resumed = train(recipe, resume=True, progress=False)
    assert records(resumed.run_dir) == records(straight.run_dir)
    assert same(adapters(resumed), adapters(straight))
