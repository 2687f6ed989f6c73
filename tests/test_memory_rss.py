"""The CPU memory estimate against the peak resident memory of real `entrenar train` processes."""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from entrenar import quickstart
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    folder = tmp_path_factory.mktemp("rss")
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    model.reset_parameters()
    save_hf(model, folder / "model")
    quickstart.build_tokenizer().save(folder / "model")
    with open(folder / "train.jsonl", "w") as f:
        for a in range(60):  # long records: every packed sequence is full
            f.write(json.dumps({"prompt": f"{a}+{a % 9}=" * 20, "completion": str(a + a % 9) * 40}) + "\n")
    return folder


def peak_rss(folder: Path, sets: list[str]) -> int:
    """ru_maxrss in bytes of one `entrenar train` process, measured from a parent started for it alone."""
    recipe = folder / "recipe.yaml"
    recipe.write_text(f"model: {{path: {folder / 'model'}, device: cpu}}\n"
                      # full rows, as the estimate counts them (padding-free rows run fewer positions)
                      f"data: {{train: {folder / 'train.jsonl'}, seq_len: 256, validation_split: 0, "
                      "padding_free: false}\n"
                      "training: {max_steps: 2, batch_size: 4, save_every: 0, eval_every: 0, cpu_threads: 1}\n")
    args = [a for kv in [*sets, f"output.dir={folder / 'run'}-{len(sets)}"] for a in ("--set", kv)]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, sys.executable, "-m", "entrenar.cli", "train", str(recipe),
                           "--no-progress", *args], capture_output=True, text=True, env=env, timeout=300, check=True)
    rc, stderr, kib = json.loads(done.stdout)
    assert rc == 0, stderr
    return kib * 1024


@pytest.mark.slow
@pytest.mark.parametrize("method, sets", [
    ("lora", ["lora.r=16", "lora.dropout=0.05", "lora.target_modules=all-linear", "training.precision=bf16"]),
    ("full", ["lora=null", "training.precision=fp32"]),
])
def test_cpu_estimate_within_25_percent_of_peak_rss(model_folder, method, sets):
    measured = peak_rss(model_folder, sets)
    lora = method == "lora"
    est = estimate_training_memory(CONFIG, method, 4, 256, dtype_bytes=2 if lora else 4, param_bytes=4,
                                   lora_targets="all-linear", lora_dropout=0.05 if lora else 0.0, cpu=True)
    gpu_view = estimate_training_memory(CONFIG, method, 4, 256, dtype_bytes=2 if lora else 4, param_bytes=4,
                                        lora_targets="all-linear")
    assert est.total - est.runtime > 0.5 * est.total  # the model's terms, not the runtime constant, are tested
    print(f"{method}: estimate {est.total / GiB:.3f} GiB, peak RSS {measured / GiB:.3f} GiB")
    assert abs(est.total - measured) / measured < 0.25, (est.as_dict(), measured / GiB)
    assert abs(gpu_view.total - measured) / measured > 0.25  # what the GPU count leaves out is worth modelling


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
