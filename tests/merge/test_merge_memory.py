"""Streaming: merging two checkpoints holds a few tensors, not the models (peak RSS of a merge subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1024, 2816, 8, 4096


def write_checkpoint(folder: Path, seed: int) -> int:
    """A random Llama-shaped bf16 checkpoint in two shards (no transformers model built); returns its bytes."""
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=HIDDEN,
                  intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False, rms_norm_eps=1e-5)
    (folder / "config.json").write_text(json.dumps(config))
    kv = HIDDEN // 4
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                   p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map, total = {}, 0
    for k, part in enumerate(halves, 1):
        shard = {n: torch.randn(shapes[n], generator=g).to(torch.bfloat16) for n in part}
        total += sum(t.numel() * 2 for t in shard.values())
        fname = f"model-{k:05d}-of-00002.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
        del shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


CHILD = """
import resource, sys, json
import torch
from entrenar.merge import merge
torch.set_num_threads(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
merge(json.loads(sys.argv[1]), sys.argv[2], max_shard_bytes=100_000_000)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after}))
"""


@pytest.mark.slow
def test_peak_memory_of_a_merge_stays_far_below_the_checkpoints(tmp_path):
    size = write_checkpoint(tmp_path / "a", 0) + write_checkpoint(tmp_path / "b", 1)
    cfg = {"merge_method": "ties", "base_model": str(tmp_path / "a"),
           "models": [{"model": str(tmp_path / "b"), "parameters": {"weight": 1.0, "density": 0.5}}]}
    src = Path(__file__).resolve().parents[2] / "src"
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(tmp_path / "out")], capture_output=True,
                         text=True, env={"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    increase = (rss["after_kib"] - rss["before_kib"]) * 1024
    assert size > 300e6
    assert increase < size / 3, f"peak RSS grew by {increase / 1e6:.0f} MB while merging {size / 1e6:.0f} MB"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
