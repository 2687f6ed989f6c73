"""Peak RSS of short `entrenar train` runs on the CPU against the dry run's memory estimate.

    PYTHONPATH=src python bench/cpu_memory.py --work /tmp/cpu-memory --out bench/results/cpu-memory.json

Builds a random model of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536,
vocabulary 49152, tied embeddings) as a Hugging Face folder stored in bf16, as the published checkpoint is, with
a character tokenizer and prompt/completion data long enough to fill every packed sequence. Each case trains a
few steps in a fresh `entrenar train` process (one thread); its peak is `ru_maxrss` of that child, read with
`resource.getrusage(RUSAGE_CHILDREN)` in a process started for it alone. The estimate is what `--dry-run` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5)

# name -> recipe overrides (--set key=value) on top of the base recipe below
CASES = {
    # recipes/smollm2-lora-chat.yaml: LoRA r=16 all-linear, 4 x 256 tokens, fp32 weights, bf16 autocast
    "smollm2-lora": ["lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear",
                     "training.batch_size=4",
                     "data.seq_len=256", "training.precision=bf16", "model.dtype=float32"],
    "smollm2-lora-no-dropout": ["lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear",
                                "training.batch_size=4", "data.seq_len=256", "training.precision=bf16",
                                "model.dtype=float32"],
    "smollm2-lora-fp32": ["lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear", "training.batch_size=4",
                          "data.seq_len=256", "training.precision=fp32", "model.dtype=float32"],
    # full fine-tuning of the same shape (recipes/full-smollm.yaml's method, a CPU-sized step)
    "smollm2-full": ["lora=null", "training.batch_size=2", "data.seq_len=256", "training.precision=bf16"],
    "smollm2-full-fp32": ["lora=null", "training.batch_size=2", "data.seq_len=256", "training.precision=fp32"],
}


def build(work: Path) -> None:
    import transformers

    from entrenar import quickstart

    folder = work / "smollm2-shape"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
        model.save_pretrained(folder)
        quickstart.build_tokenizer().save(folder)
    with open(work / "train.jsonl", "w") as f:
        for a in range(400):
            f.write(json.dumps({"prompt": f"{a}+{a % 97}=" * 8, "completion": str(a + a % 97) * 20}) + "\n")
    (work / "base.yaml").write_text(
        f"model: {{path: {folder}, device: cpu}}\n"
        f"data: {{train: {work / 'train.jsonl'}, train_on: completion, packing: true, validation_split: 0.05}}\n"
        "lora: {r: 16, alpha: 32}\n"
        "training: {max_steps: 3, eval_every: 0, save_every: 0, log_every: 1, cpu_threads: 1}\n"
    )


def peak_rss(args: list[str], env: dict) -> tuple[int, float, str]:
    """ru_maxrss (bytes) of `args` run as the only child of a fresh Python process."""
    probe = ("import resource,subprocess,sys,json;"
             "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
             "peak=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
             "print(json.dumps([p.returncode,peak,p.stdout[-3000:],p.stderr[-3000:]]))")
    started = time.time()
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env, check=True)
    rc, kib, stdout, stderr = json.loads(out.stdout)
    if rc != 0:
        raise RuntimeError(f"{args}: exit {rc}\n{stdout}\n{stderr}")
    return kib * 1024, time.time() - started, stdout


def estimate(args: list[str], env: dict) -> tuple[float, str]:
    out = subprocess.run(args + ["--dry-run"], capture_output=True, text=True, env=env, check=True).stdout
    line = next(text for text in out.splitlines() if text.startswith("memory estimate"))
    return float(re.search(r"([\d.]+) GiB", line).group(1)) * 2**30, line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/cpu-memory"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", nargs="*", default=[*CASES, "quickstart"])
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    build(args.work)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for name in args.cases:
        out_dir = args.work / f"run-{name}-{os.getpid()}"
        if name == "quickstart":
            cmd = [sys.executable, "-m", "entrenar.cli", "train", "--no-progress", "--set", f"output.dir={out_dir}"]
        else:
            sets = [s for kv in CASES[name] + [f"output.dir={out_dir}"] for s in ("--set", kv)]
            cmd = [sys.executable, "-m", "entrenar.cli", "train", str(args.work / "base.yaml"), "--no-progress", *sets]
        est, line = estimate(cmd[:-2] + ["--set", f"output.dir={out_dir}-dry"], env)
        peak, seconds, _ = peak_rss(cmd, env)
        row = dict(case=name, estimate_gib=round(est / 2**30, 3), peak_rss_gib=round(peak / 2**30, 3),
                   estimate_over_peak=round(est / peak, 3), seconds=round(seconds, 1), dry_run=line)
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), load=os.getloadavg(),
                torch=torch.__version__, python=platform.python_version())
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
