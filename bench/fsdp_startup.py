"""Where an FSDP run's start-up goes, phase by phase: `entrenar train --nproc-per-node N` with
`training.parallel: fsdp` on a random Llama-shaped folder, every process timed by bench/startup_probe.py.

Builds (once, under --work) a random bf16 Hugging Face folder of the given shape with a one-character-a-token
tokenizer and a JSONL of text, writes a full fine-tuning recipe (fp32 master weights, AdamW, --steps steps of
--batch x --seq), and runs it through the product with a generated ``sitecustomize`` that loads the probe in the
launcher and in each worker. Prints each rank's phases (start after the launch, duration) and writes them with the
settings to --out. On a CPU the run uses gloo; on GPUs NCCL (``--device cuda``).

    python bench/fsdp_startup.py --layers 12 --hidden 1536 --intermediate 4096 --vocab 32768 --nproc 2 \
        --out fsdp-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

WORDS = ["the", "model", "reads", "every", "shard", "of", "its", "weights", "from", "the", "files", "once", "and",
         "trains", "on", "the", "text", "of", "each", "line"]


def make_folder(folder: Path, args: argparse.Namespace) -> Path:
    """A random bf16 Llama-shaped folder (entrenar's own initialisation, seed 0) with the character tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from entrenar import quickstart
    from entrenar.models.config import ModelConfig
    from entrenar.models.hf import save_hf
    from entrenar.models.transformer import Transformer

    tokenizer = quickstart.build_tokenizer()
    config = ModelConfig(vocab_size=max(args.vocab, tokenizer.vocab_size), hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, model_type="llama", tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.reset_parameters()
    tmp = folder.with_name(folder.name + ".partial")
    save_hf(model, tmp)
    tokenizer.save(tmp)
    tmp.rename(folder)
    return folder


def make_text(path: Path, lines: int) -> Path:
    if not path.is_file():
        with open(path, "w") as f:
            for i in range(lines):
                words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12 + i % 9)]
                f.write(json.dumps({"text": f"{i}: " + " ".join(words)}) + "\n")
    return path


def recipe(folder: Path, text: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {"path": str(folder), "device": args.device},
        "data": {"train": str(text), "validation_split": 0.0, "seq_len": args.seq, "packing": True,
                 "train_on": "all", "add_eos": True},
        "lora": None,
        "optimizer": {"name": "adamw", "lr": 1e-5},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "training": {"max_steps": args.steps, "batch_size": args.batch, "grad_accum": 1, "parallel": "fsdp",
                     "precision": args.precision, "kernels": False, "seed": 0, "eval_every": 0, "save_every": 0,
                     "log_every": 1, "replica_check_every": 0},
        "output": {"dir": str(run_dir)},
    }


def phases(folder: Path, launched: float) -> dict[str, list[dict]]:
    """Each process's records, as offsets from the launch (s) and durations (s), in the order they started."""
    out: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows.sort(key=lambda r: (r["start"], -r["end"]))
        merged: dict[str, dict] = {}  # a phase run several times (fully_shard per block): its first start, total
        for r in rows:
            row = merged.setdefault(r["phase"], {"phase": r["phase"], "at_s": round(r["start"] - launched, 2),
                                                 "took_s": 0.0, "calls": 0})
            row["took_s"] = round(row["took_s"] + r["end"] - r["start"], 2)
            row["calls"] += 1
        out[path.stem.removeprefix("rank-")] = list(merged.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    p.add_argument("--work", type=Path, default=Path("/tmp/fsdp_startup"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    shape = f"l{args.layers}-h{args.hidden}-i{args.intermediate}-v{args.vocab}"
    started = time.perf_counter()
    folder = make_folder(args.work / shape, args)
    print(f"{folder}: ready in {time.perf_counter() - started:.0f} s", flush=True)
    text = make_text(args.work / "text.jsonl", 400)
    run_dir = args.work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    recipe_path = args.work / f"{shape}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(folder, text, run_dir, args), sort_keys=False))

    with tempfile.TemporaryDirectory(prefix="fsdp-startup-") as tmp:
        site, records = Path(tmp) / "site", Path(tmp) / "phases"
        site.mkdir()
        records.mkdir()
        (site / "sitecustomize.py").write_text(
            "import time\n_T0 = time.time()\nimport startup_probe\nstartup_probe.install(_T0)\n")
        env = dict(os.environ, ENTRENAR_PHASES=str(records),
                   PYTHONPATH=os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "entrenar.cli.main", "train", str(recipe_path), "--nproc-per-node",
               str(args.nproc), "--no-progress", *[a for s in args.set for a in ("--set", s)]]
        launched = time.time()
        code = subprocess.run(cmd, env=env).returncode
        total = time.time() - launched
        result = {"command": " ".join(sys.argv), "train": " ".join(cmd[1:]), "exit": code, "wall_s": round(total, 2),
                  "shape": shape, "parameters": None, "settings": vars(args) | {"work": str(args.work),
                                                                                "out": str(args.out)},
                  "phases": phases(records, launched)}
    from entrenar.models.hf import read_config

    result["parameters"] = read_config(folder).num_parameters
    for rank, rows in result["phases"].items():
        print(f"-- {rank}")
        for r in rows:
            calls = f" (x{r['calls']})" if r["calls"] > 1 else ""
            print(f"  {r['at_s']:8.2f} s  {r['took_s']:8.2f} s  {r['phase']}{calls}")
    print(f"exit {code}, {total:.1f} s, {result['parameters']:,} parameters")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
