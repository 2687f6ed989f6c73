"""The FSDP plan's memory estimate against peaks measured on GPUs, and when its gradients count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from entrenar.config import load_recipe
from entrenar.train.memory import GiB, MemoryEstimate, estimate_training_memory, per_device
from entrenar.train.plan import plan_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_e2e  # noqa: E402 (bench/, as tests/test_bench_multi_gpu.py reads it)
from multi_gpu import CASES  # noqa: E402

# torch.cuda.max_memory_allocated of every rank (the largest, GiB) in bench/multi_gpu.py's full-8b-8k runs on 4
# H200s of one host, 2026-11-27 (torch 2.11; 78.74 and 54.65 GB): full fine-tuning of the Llama-3.1-8B shape with
# Llama 3's vocabulary, 2 x 8192 tokens a rank, bf16 with fp32 master weights, AdamW, every layer checkpointed,
# one micro-batch a step (bench/results/h200x4-2026-11-27-s11-fsdp-full-8b-8k.json).
MEASURED_PEAKS = {2: 73.33, 4: 50.90}


@pytest.mark.parametrize("processes", sorted(MEASURED_PEAKS))
def test_the_fsdp_plan_is_within_6_percent_of_the_measured_peaks(processes, tmp_path):
    """The plan of bench/multi_gpu.py's own recipe with ``processes`` ranks: within 6% of each measured peak, and
    above it (the plan refuses what does not fit). Counting the sharded gradients at the forward's end, as the
    estimate did before, read 24% and 20% over and refused the 2-rank run on an 80 GB H100."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    document = tmp_path / "doc.jsonl"
    document.write_text('{"text": "x"}\n')
    recipe = bench_e2e.recipe_for(CASES["full-8b-8k"], folder, document, tmp_path / "run", False)
    recipe["model"]["device"] = "cuda"
    recipe["training"]["parallel"] = "fsdp"
    path = tmp_path / "full-8b-8k.yaml"
    path.write_text(yaml.safe_dump(recipe))
    plan = plan_for(load_recipe(path), "cuda", processes, 79.1)[0]
    assert plan.mode == "fsdp" and plan.accumulation == 1
    assert plan.memory.gradients_from_backward
    planned, peak = plan.memory.total / GiB, MEASURED_PEAKS[processes]
    assert 0 <= (planned - peak) / peak < 0.06, (planned, peak)
    if processes == 2:  # fits an 80 GB H100 now
        assert plan.memory.total <= 79.1 * GiB


def _state(**parts: float) -> MemoryEstimate:
    fields = {"method": "full", "total_params": 0, "trainable_params": 0, "weights": 10.0, "gradients": 10.0,
              "optimizer": 20.0, "activations": 6.0, "logits": 2.0, "transient": 1.0}
    return MemoryEstimate(**{**fields, **parts})  # type: ignore[arg-type]


def test_gradients_from_the_backward_on_meet_the_transients_not_the_saved_tensors():
    kept, freed = _state(), _state(gradients_from_backward=True)
    assert kept.total == 10 + 10 + 20 + (6 + 2 + 1)  # held through the forward: on top of the step's peak
    assert freed.total == 10 + 20 + max(6 + 2 + 1, 10 + 1)  # the forward's end, or the backward's end
    big = _state(gradients=30.0, gradients_from_backward=True)  # gradients larger than what the step saves
    assert big.total == 10 + 20 + 30 + 1


def test_only_one_micro_batch_a_step_under_fsdp_frees_the_gradients():
    from tests.test_memory import CONFIG

    full = estimate_training_memory(CONFIG, "full", 2, 256, activation_checkpointing=True)
    assert not full.gradients_from_backward
    assert not per_device(full, CONFIG, 2, "ddp").gradients_from_backward  # DDP's buckets hold them
    assert per_device(full, CONFIG, 2, "fsdp").gradients_from_backward
    accumulated = per_device(full, CONFIG, 2, "fsdp", accumulation=2)  # summed over the micro-batches' backwards
    assert not accumulated.gradients_from_backward
    assert accumulated.total - per_device(full, CONFIG, 2, "fsdp").total == pytest.approx(
        accumulated.gradients + accumulated.step - max(accumulated.step, accumulated.gradients + accumulated.transient))
