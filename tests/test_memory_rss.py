"""The CPU memory estimate against the peak resident memory of real `entrenar train` processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entrenar.models.config import ModelConfig
from entrenar.train.memory import GiB, estimate_training_memory

SRC = Path(__file__).resolve().parents[1] / "src"
# Wide enough that the step (logits, activations, autocast copies), not the runtime, is most of the peak.
CONFIG = ModelConfig(vocab_size=16384, hidden_size=384, intermediate_size=1024, num_layers=4, num_heads=6,
                     num_kv_heads=2, tie_word_embeddings=True, model_type="llama")
PROBE = ("import json,resource,subprocess,sys;"
         "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
         "print(json.dumps([p.returncode,p.stderr[-2000:],resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")


# SmolLM2-135M's block (recipes/smollm2-lora-chat.yaml), with 3 of its 30 layers and a sixth of its vocabulary:
# bf16 products run emulated on CPUs without AVX-512 BF16, where its full output layer takes minutes a step.
SMOLLM2_SHAPED = ModelConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_layers=3, num_heads=9,
                             num_kv_heads=3, tie_word_embeddings=True, model_type="llama")
SMOLLM2_SETTINGS = ["lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear",
                    "training.precision=bf16", "model.dtype=float32"]


def model_folder(tmp_path: Path, config: ModelConfig) -> Path:
    from entrenar import quickstart
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(config)
    model.reset_parameters()
    save_hf(model, tmp_path / "model")
    quickstart.build_tokenizer().save(tmp_path / "model")
    with open(tmp_path / "train.jsonl", "w") as f:
        for a in range(60):  # long records: every packed sequence is full
            f.write(json.dumps({"prompt": f"{a}+{a % 9}=" * 20, "completion": str(a + a % 9) * 40}) + "\n")
    return tmp_path


def peak_rss(argv: list[str]) -> int:
    """ru_maxrss in bytes of one `entrenar` process, measured from a parent started for it alone."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, sys.executable, "-m", "entrenar.cli", *argv],
                          capture_output=True, text=True, env=env, timeout=600, check=True)
    rc, stderr, kib = json.loads(done.stdout)
    assert rc == 0, stderr
    return kib * 1024


def dry_run_estimate(argv: list[str]) -> float:
    """The memory estimate (bytes) the dry run of the same command prints: the number the plan refuses by."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-m", "entrenar.cli", *argv, "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    match = re.search(r"memory estimate\s+([\d.]+) GiB", out)
    assert match, out
    return float(match.group(1)) * GiB


def recipe_args(folder: Path, sets: list[str]) -> list[str]:
    recipe = folder / "recipe.yaml"
    recipe.write_text(f"model: {{path: {folder / 'model'}, device: cpu}}\n"
                      # full rows, as the estimate counts them (padding-free rows run fewer positions)
                      f"data: {{train: {folder / 'train.jsonl'}, seq_len: 256, validation_split: 0, "
                      "padding_free: false}\n"
                      "training: {max_steps: 2, batch_size: 4, save_every: 0, eval_every: 0, cpu_threads: 1}\n")
    return ["train", str(recipe), "--no-progress",
            *[a for kv in [*sets, f"output.dir={folder / 'run'}"] for a in ("--set", kv)]]


@pytest.mark.slow
@pytest.mark.parametrize("config, sets", [
    pytest.param(CONFIG, ["lora=null", "training.precision=fp32"], id="full-fp32"),
    pytest.param(SMOLLM2_SHAPED, [*SMOLLM2_SETTINGS, "data.seq_len=128", "training.max_steps=1"],
                 id="smollm2-shaped-recipe"),
])
def test_the_plans_cpu_estimate_is_within_25_percent_of_peak_rss(tmp_path, config, sets):
    argv = recipe_args(model_folder(tmp_path, config), sets)
    estimate, measured = dry_run_estimate(argv), peak_rss(argv)
    print(f"{sets}: estimate {estimate / GiB:.3f} GiB, peak RSS {measured / GiB:.3f} GiB")
    assert abs(estimate - measured) / measured < 0.25, (estimate / GiB, measured / GiB)


@pytest.mark.slow
def test_the_quickstarts_cpu_estimate_is_within_25_percent_of_peak_rss(tmp_path):
    argv = ["train", "--no-progress", "--set", f"output.dir={tmp_path / 'run'}", "--set", "training.max_steps=3"]
    estimate, measured = dry_run_estimate(argv), peak_rss(argv)
    assert abs(estimate - measured) / measured < 0.25, (estimate / GiB, measured / GiB)


def test_what_a_gpu_count_leaves_out_is_worth_modelling_on_a_cpu():
    args = dict(lora_targets="all-linear", dtype_bytes=2, param_bytes=4)
    cpu = estimate_training_memory(SMOLLM2_SHAPED, "lora", 4, 256, lora_dropout=0.05, cpu=True, **args)
    gpu_view = estimate_training_memory(SMOLLM2_SHAPED, "lora", 4, 256, **args)
    assert cpu.total - cpu.runtime > 0.5 * cpu.total  # the model's terms, not the runtime constant, dominate
    assert cpu.total > 1.25 * gpu_view.total


def test_the_cpu_dry_run_prints_the_cpu_estimate_of_its_recipe(workspace):
    from entrenar.config import load_recipe
    from entrenar.models.hf import read_config
    from entrenar.train.loop import train

    path = workspace / "recipe.yaml"
    path.write_text(f"model: {{path: {workspace / 'model'}, device: cpu}}\n"
                    f"data: {{train: {workspace / 'train.jsonl'}, seq_len: 32}}\n"
                    "lora: {r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}\n"
                    f"training: {{batch_size: 2, precision: bf16}}\noutput: {{dir: {workspace / 'run'}}}\n")
    summary = train(load_recipe(path), dry_run=True, progress=False).summary
    est = estimate_training_memory(read_config(workspace / "model"), "lora", 2, 32, dtype_bytes=2, param_bytes=4,
                                   lora_r=4, lora_targets="all-linear", lora_dropout=0.1, cpu=True)
    assert f"memory estimate       {est.total / GiB:.2f} GiB" in summary
    assert f"runtime {est.runtime / GiB:.2f}, autocast copies {est.casts / GiB:.2f}" in summary
    assert "left out: loading" in summary
