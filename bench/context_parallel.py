"""The longest context that trains with context parallelism (issue 38): the Llama-3.1-8B shape, LoRA or QLoRA,
each row split over --cp GPUs (`training.context_parallel`, Ulysses all-to-all), found by a short search.

Every trial goes through the product: `entrenar train --nproc-per-node N` on a recipe a user would write (one
document of L tokens a row, batch 1, --steps steps, every layer recomputed, bf16, padding-free rows), with
`--force` so that the GPU's memory, not the plan's estimate, decides. A trial passes when every step logged a
finite loss; a run that stops on CUDA out-of-memory fails. The search walks --lengths from the longest down
(a failure costs the load and part of a step; a pass costs --steps steps, which grow with L squared through
attention), then goes up from the longest pass (x1.5 while nothing above it failed, else halfway to the shortest
failure) while --budget-s allows, each trial's time predicted from the last pass as quadratic in L. Attention
bounds it as much as memory: by count, a step of 256k tokens of the 8B shape is about 9e16 FLOPs (attention
4.5 x 2 N^2 x hidden x layers with the recomputation, the projections 6 x 8e9 x N), a minute or more on four
H100s, so the budget, not the memory, may stop the search; a trial cut by it reports the losses it logged.
tokens/s is the last step's, of the job (all ranks), from metrics.jsonl; each rank's peak memory beside it.

The model folder is a random bf16 Hugging Face folder of the shape (transformers' initialisation), written
once under --work, with a byte-level tokenizer (so any L needs no corpus: the text is random letters, one
record a row); the vocabulary stays Llama-3.1's 128,256 (embedding and output head as large as the real ones).

On 4 GPUs of one host, from the repository root (one 10-minute call):

    PYTHONPATH=src python bench/context_parallel.py --nproc 4 --cp 4 --out $OUT/cp4.json

One GPU, the same search without context parallelism (the baseline):

    PYTHONPATH=src python bench/context_parallel.py --nproc 1 --cp 1 --lengths 131072 98304 65536 32768 \
        --out $OUT/cp1.json

`--tiny` runs a toy shape on the CPU (gloo): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_e2e  # noqa: E402

VOCAB = 128256  # Llama-3.1's
DEFAULT_LENGTHS = (262144, 196608, 131072, 65536)


def write_inputs(work: Path, shape: str, longest: int, tiny: bool) -> Path:
    """The model folder (random weights of ``shape``, byte-level tokenizer), written once."""
    from entrenar.models.random_init import byte_tokenizer

    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        byte_tokenizer().save(tokenizer_dir)
    folder = work / (shape + ("-tiny" if tiny else ""))
    return bench_e2e.make_model_folder(shape, VOCAB, longest, tokenizer_dir, folder, tiny)


def write_text(work: Path, length: int, rows: int) -> Path:
    """``rows`` records of ``length`` random letters and spaces (one byte, one token each), seeded."""
    path = work / f"text-{length}.jsonl"
    if not path.is_file():
        rng = random.Random(length)
        with open(path, "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz     ", k=length))}) + "\n")
    return path


def recipe(folder: Path, text: Path, length: int, args: argparse.Namespace, run_dir: Path) -> dict:
    cpu = bench_e2e.device() == "cpu"
    training = {"max_steps": args.steps, "batch_size": 1, "grad_accum": 1, "precision": "fp32" if cpu else "bf16",
                "activation_checkpointing": True, "offload_activations": bool(args.offload) and not cpu,
                "kernels": "auto", "seed": 0, "eval_every": 0, "save_every": 0, "log_every": 1,
                "replica_check_every": 0, "dist_timeout_s": 900, "stall_timeout_s": None,
                "context_parallel": args.cp}
    if args.nproc > 1:
        training["parallel"] = "ddp"
    return {
        "model": {"path": str(folder), "device": "cpu" if cpu else "cuda"},
        "data": {"train": str(text), "validation_split": 0.0, "seq_len": length, "packing": True,
                 "padding_free": True, "train_on": "all", "add_eos": False, "shuffle": False},
        "lora": {**bench_e2e.LORA, "dropout": 0.0, "target_modules": "all-linear",
                 "quantize_base": "nf4" if args.method == "qlora" else None},
        "optimizer": {"name": "adamw", "lr": bench_e2e.LR},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "training": training,
        "output": {"dir": str(run_dir)},
    }


def trial(folder: Path, length: int, args: argparse.Namespace, work: Path, timeout_s: float) -> dict:
    """One `entrenar train` of rows of ``length`` tokens: passed, oom, timeout or error, with its numbers."""
    from entrenar.train.metrics import read_metrics

    run_dir = work / f"run-{args.nproc}x{args.cp}-{length}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun's trial starts fresh, not from an earlier checkpoint
    path = work / f"recipe-{length}.yaml"
    path.write_text(yaml.safe_dump(recipe(folder, write_text(work, length, args.steps + 1), length, args, run_dir),
                                   sort_keys=False))
    launch = ["--nproc-per-node", str(args.nproc)] if args.nproc > 1 else []
    cmd = [sys.executable, "-m", "entrenar.cli.main", "train", str(path), *launch, "--no-progress", "--force",
           "--set", f"output.dir={run_dir}", *[a for item in args.set for a in ("--set", item)]]
    log = work / f"train-{length}.log"
    started = time.perf_counter()
    result: dict = {"length": length, "tokens_per_rank": -(-length // args.cp)}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the launcher and its ranks: this trial's own process group
            proc.wait()
            code = None
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = log.read_text()
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] \
        if (run_dir / "metrics.jsonl").is_file() else []
    losses = [r["loss"] for r in rows]
    if code == 0 and len(losses) == args.steps and all(math.isfinite(x) for x in losses):
        last = rows[-1]
        result.update(status="passed", losses=losses, tokens_per_s=last.get("tokens_per_s"),
                      step_s=round(last["tokens"] / last["tokens_per_s"], 2) if last.get("tokens_per_s") else None,
                      peak_mem_gb_ranks=last.get("peak_mem_gb_ranks", last.get("peak_mem_gb")))
    elif code is None:
        result.update(status="timeout", losses=losses)  # finite losses logged: it fit, but ran out of time
    elif "out of memory" in text.lower() or "OutOfMemoryError" in text:
        result.update(status="oom", steps_logged=len(losses))
    else:
        result.update(status="error", exit=code, losses=losses, error=text[-2000:])
    print(f"  L={length:>8,}: {result['status']:<8} {result['wall_s']:>6.0f} s"
          + (f"  {result['tokens_per_s']:,.0f} tokens/s  peak {result['peak_mem_gb_ranks']} GB"
             if result["status"] == "passed" else ""), flush=True)
    return result


def search(folder: Path, args: argparse.Namespace, work: Path, deadline: float) -> list[dict]:
    """Longest first down the list until one passes; then up from the longest pass (x1.5 while nothing above it
    failed, else halfway to the shortest failure, to within an eighth) while the predicted time fits."""
    quantum = 1024 * args.cp
    trials: list[dict] = []
    passed: dict | None = None
    for length in sorted(set(args.lengths), reverse=True):
        if time.perf_counter() >= deadline:
            break
        trials.append(trial(folder, length, args, work, deadline - time.perf_counter()))
        write(args.out, args, trials)
        if trials[-1]["status"] == "passed":
            passed = trials[-1]
            break
    while passed is not None:
        lo = passed["length"]
        above = [t["length"] for t in trials if t["status"] != "passed" and t["length"] > lo]
        if above and min(above) - lo <= max(quantum, lo // 8):
            break
        target = (lo + min(above)) // 2 if above else lo * 3 // 2
        nxt = max(lo + quantum, target // quantum * quantum)
        predicted = passed["wall_s"] * (nxt / lo) ** 2  # attention's share grows with L squared: an upper bound
        if time.perf_counter() + predicted > deadline:
            print(f"  L={nxt:>8,}: not tried (about {predicted:.0f} s, over the budget)", flush=True)
            break
        trials.append(trial(folder, nxt, args, work, deadline - time.perf_counter()))
        write(args.out, args, trials)
        if trials[-1]["status"] == "passed":
            passed = trials[-1]
    return trials


def write(out: str, args: argparse.Namespace, trials: list[dict]) -> None:
    if not out:
        return
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    passed = [t for t in trials if t["status"] == "passed"]
    best = max(passed, key=lambda t: t["length"]) if passed else None
    report = {"shape": "llama-8b" + ("-tiny" if args.tiny else ""), "method": args.method, "nproc": args.nproc,
              "cp": args.cp, "steps": args.steps, "sets": args.set, "offload": args.offload,
              "device": gpu, "date": time.strftime("%Y-%m-%d"),
              "longest_passed": best, "trials": trials}
    Path(out).write_text(json.dumps(report, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="processes (GPUs) of the job")
    p.add_argument("--cp", type=int, default=4, help="training.context_parallel: processes a row is split over")
    p.add_argument("--method", choices=("lora", "qlora"), default="lora")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="tokens a row, tried from the longest down (then bisected)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--offload", action="store_true", help="training.offload_activations: true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every trial (repeatable), e.g. training.tiled_mlp=8192")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall time for the whole search, folder included")
    p.add_argument("--work", default="/tmp/cp-bench", help="model folder, data and runs")
    p.add_argument("--out", default="", help="JSON results file (rewritten after each trial)")
    p.add_argument("--tiny", action="store_true", help="toy shape on the CPU: a smoke test, not a measurement")
    args = p.parse_args(argv)
    if bench_e2e.device() == "cpu" and not args.tiny:
        p.error("no CUDA device: the search is a GPU measurement (--tiny runs a toy shape on the CPU)")
    deadline = time.perf_counter() + args.budget_s
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    folder = write_inputs(work, "llama-8b", max(args.lengths), args.tiny)
    print(f"{folder}: ready in {time.perf_counter() - started:.0f} s; {args.method} on {args.nproc} process(es), "
          f"each row over {args.cp}", flush=True)
    trials = search(folder, args, work, deadline)
    write(args.out, args, trials)
    passed = [t for t in trials if t["status"] == "passed"]
    if passed:
        best = max(passed, key=lambda t: t["length"])
        print(f"longest context that trained: {best['length']:,} tokens ({best['tokens_per_rank']:,} a rank), "
              f"{best['tokens_per_s']:,.0f} tokens/s, peak {best['peak_mem_gb_ranks']} GB")
    else:
        print("no length trained (see the trials' logs under --work)")


if __name__ == "__main__":
    main()
