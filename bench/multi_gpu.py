"""Multi-GPU runs of `entrenar train` on one host (issue 20): DDP scaling, FSDP2 memory, a killed rank's restart.

Every run goes through the product: a random Hugging Face folder of a real model's shape (bench_e2e's cases, with
SmolLM2's tokenizer), a JSONL of real text, a recipe a user would write, and `entrenar train --nproc-per-node N`
(torchrun's agent, NCCL). Nothing here drives the model directly.

    scaling   each N of --gpus trains the case with --parallel (ddp or fsdp: N=1 runs the same code path; auto: N=1
              runs as a plain process, more than one as DDP when a replica fits), after one plain process with
              --plain (the baseline then), the
              replica check every 10 steps; per run: tokens/s of real tokens for the job over the steps after
              --skip (all their tokens over all their time; the median of the steps' rates beside it) and per
              GPU, scaling efficiency against the first N, each rank's peak memory, the first and last losses
    restart   the case trained twice on N GPUs with a checkpoint every --save-every steps: once uninterrupted,
              once under `--max-restarts 1` with a rank killed (SIGKILL, as the OOM killer would) once the run
              has logged step --kill-after; the restarted job resumes from its latest checkpoint on its own, and
              the two runs' final weights are compared tensor by tensor (and, when they differ, against a
              second uninterrupted run: the GPU's own run-to-run spread)
    fsdp      FSDP2 on each N of --gpus with and without training.fsdp_prefetch (--prefetch both|on|off): tokens/s
              (job, per GPU), each rank's peak memory, the prefetch speedup, and for the full-8b cases the ratio to
              torchtitan's published Llama-3.1-8B FSDP rate; --budget bounds the whole script for one device call;
              --no-final-save ends each run once its last step is logged (the measurement is the steps)

Cases: bench_e2e's, plus `full-8b` (full fine-tuning of the Llama-8B shape, fp32 master weights and AdamW state:
about 128 GB of state, which FSDP2 shards) and `qlora-70b` (LoRA on a Llama-70B-shape NF4 base: the folder is
written already quantized, about 40 GB, since the bf16 folder would not fit the machine's disk; FSDP2 shards the
NF4 codes over the ranks).

    python bench/multi_gpu.py scaling --case lora-8b --parallel ddp --gpus 1 2 --out ddp-8b.json
    python bench/multi_gpu.py scaling --case full-8b --parallel fsdp --gpus 2 --out fsdp-8b.json
    python bench/multi_gpu.py scaling --case qlora-70b --parallel fsdp --gpus 2 --out qlora-70b.json
    python bench/multi_gpu.py restart --case lora-1b --gpus 2 --out restart.json
    python bench/multi_gpu.py fsdp --case full-8b-8k --gpus 4 2 --skip 3 --no-final-save --budget 540 --out fsdp-8b.json
    python bench/multi_gpu.py fsdp --case qlora-70b-v128k --gpus 4 --skip 2 --budget 570 --out qlora-70b.json

Issue 38 (DDP with flat gradients: CUDA graphs and step overlap under torchrun), each within one 10-minute call:
three rounds of the plain process, N = 1 through torchrun (training.parallel: ddp, a group of one) and N = 2, 4,
each run's efficiency against the plain run of its round; medians and ranges in "aggregate":

    python bench/multi_gpu.py scaling --case lora-1b --parallel ddp --plain --gpus 1 2 4 --repeats 3 \
        --steps 20 --deadline-s 560 --out ddp-1b.json
    python bench/multi_gpu.py scaling --case lora-8b --parallel ddp --plain --gpus 1 2 4 --repeats 3 \
        --steps 12 --skip 4 --deadline-s 560 --out ddp-8b.json

and the deterministic restart on 2 GPUs (bitwise_equal in clean_vs_restarted):

    python bench/multi_gpu.py restart --case lora-1b --gpus 2 --steps 30 --save-every 10 --kill-after 15 \
        --set training.deterministic=true --out restart-det.json

`--tiny` runs a case at a toy size on the CPU (gloo): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
STARTED = time.perf_counter()  # fsdp's --budget counts from here
sys.path.insert(0, str(HERE))

import bench_e2e  # noqa: E402

CASES: dict[str, dict] = {
    **bench_e2e.CASES,
    "full-8b": {"shape": "llama-8b", "method": "full", "batch": 2, "seq": 2048, "ckpt": True, "steps": 16},
    "qlora-70b": {"shape": "llama-70b", "method": "qlora", "batch": 1, "seq": 2048, "ckpt": True, "steps": 10,
                  "prequantized": True},
    # issue 38: torchtitan's Llama-3.1-8B FSDP setting (local batch 2 x 8192 tokens, Llama 3's 128,256 vocabulary;
    # every layer checkpointed here, selective per-op checkpointing there), and the 70B base with Llama 3's vocabulary
    "full-8b-8k": {"shape": "llama-8b", "method": "full", "batch": 2, "seq": 8192, "ckpt": True, "steps": 8,
                   "vocab": 128256},
    "qlora-70b-v128k": {"shape": "llama-70b", "method": "qlora", "batch": 1, "seq": 2048, "ckpt": True, "steps": 8,
                        "prequantized": True, "vocab": 128256},
}

# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (end of 2024): FSDP, no compile or Float8
TORCHTITAN_8B = {
    "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, row FSDP",
    "tokens_per_s_per_gpu": 5762, "memory_gib": 82.4, "gpus": 8,
    "hardware": "8 H100 (96 GB HBM2e, 500 W power limit) of one Grand Teton host, NVLink",
    "local_batch": 2, "global_batch": 16, "seq": 8192, "activation_checkpointing": "selective (per op)",
    "rate": "logged every 10 iterations, read at iteration 90", "data": "C4 (every token counted)",
}


# ---------------------------------------------------------------- inputs


def make_nf4_folder(shape: str, vocab: int, seq: int, tokenizer_dir: Path, folder: Path, tiny: bool) -> Path:
    """A random model folder of `shape` saved already NF4-quantized (entrenar's quantized layout): each linear
    layer drawn normal(0, 0.02) in bf16 and quantized on the device one at a time, so neither the bf16 model
    nor its bf16 folder ever exists (a 70B one would not fit the disk)."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.hf import empty_model
    from entrenar.quant.checkpoint import save_quantized
    from entrenar.quant.nf4.format import NF4Linear
    from entrenar.quant.nf4.sinks import nf4_sinks

    dev = bench_e2e.device()
    config = bench_e2e.shape_config(shape, vocab, seq, tiny)
    model = empty_model(config, torch.bfloat16, dev, nf4_sinks)
    gen = torch.Generator(dev).manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, NF4Linear):
                w = torch.empty(module.out_features, module.in_features, device=dev, dtype=torch.bfloat16)
                module.load_full_weight(w.normal_(0.0, 0.02, generator=gen), f"{name}.weight")
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    tmp = folder.with_name(folder.name + ".partial")
    save_quantized(model, Tokenizer.from_folder(tokenizer_dir), tmp, info={"source": "bench/multi_gpu.py"})
    (tmp / "tokenizer_config.json").write_bytes((tokenizer_dir / "tokenizer_config.json").read_bytes())
    model = module = w = None  # the last layer and weight drawn too
    torch.cuda.empty_cache()  # this process only launches the runs: leave the device to them
    tmp.rename(folder)
    return folder


def prepare(name: str, case: dict, work: Path, tokenizer_dir: Path, text: Path, tiny: bool) -> Path:
    """The case's model folder (cached under `work`) and its recipe file; returns the recipe's path."""
    vocab = max(len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]), 49152)
    vocab = case.get("vocab", vocab)  # a larger table than the tokenizer's: its rows past the tokens never train
    folder = work / (case["shape"] + (f"-v{vocab}" if "vocab" in case else "") + ("-nf4" if case.get("prequantized")
                                                                                 else "") + ("-tiny" if tiny else ""))
    started = time.perf_counter()
    if case.get("prequantized"):
        make_nf4_folder(case["shape"], vocab, case["seq"], tokenizer_dir, folder, tiny)
    else:
        bench_e2e.make_model_folder(case["shape"], vocab, case["seq"], tokenizer_dir, folder, tiny)
    print(f"{folder}: ready in {time.perf_counter() - started:.0f} s", flush=True)
    recipe = bench_e2e.recipe_for(case, folder, text, work / "run", False)
    if case.get("prequantized"):
        recipe["lora"]["quantize_base"] = None  # the folder's layers are NF4 already
    recipe["training"].update(replica_check_every=10, log_every=1)
    path = work / f"{name}{'-tiny' if tiny else ''}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# ---------------------------------------------------------------- runs


def train_command(recipe: Path, nproc: int, run_dir: Path, sets: list[str], max_restarts: int = 0) -> list[str]:
    """`entrenar train` through torchrun with `nproc` processes, or as one plain process (`nproc` 0)."""
    launch = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)] if nproc else []
    return [sys.executable, "-m", "entrenar.cli.main", "train", str(recipe), *launch, "--no-progress",
            "--set", f"output.dir={run_dir}", *[a for s in sets for a in ("--set", s)]]


def metrics(run_dir: Path) -> list[dict]:
    """The step lines of a run's metrics.jsonl; a step logged twice (before and after a restart) counts once,
    as the resumed run logged it."""
    from entrenar.train.metrics import read_metrics  # complete lines only: the run may be writing the last

    by_step: dict[int, dict] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        if "loss" in row and row.get("tokens"):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def summary(run_dir: Path, nproc: int, skip: int, wall_s: float) -> dict:
    rows = metrics(run_dir)
    timed = rows[min(skip, len(rows) - 1):]
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    # A step's rate moves with the real tokens its packed rows hold (a row ends in padding): the job's rate over
    # the timed steps, all tokens over all step time, is the measure of scaling; the median is kept beside it.
    total = sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    per_rank = [r.get("peak_mem_gb_ranks") or [r.get("peak_mem_gb") or 0.0] for r in rows]  # GB; 0 on a CPU
    peaks = [round(max(p[i] for p in per_rank), 2) for i in range(len(per_rank[-1]))]
    return {"gpus": nproc, "steps": len(rows), "tokens_per_s": round(total), "per_gpu": round(total / nproc),
            "tokens_per_s_median": round(tps), "step_tokens_per_s": [round(r["tokens_per_s"]) for r in rows],
            "peak_gb_ranks": peaks, "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "losses": [round(r["loss"], 5) for r in rows], "wall_s": round(wall_s, 1)}


STOPPED = 125  # run()'s code for a run ended by its `stop` test


def run(cmd: list[str], log: Path, timeout: float, stop: Callable[[], bool] | None = None) -> tuple[int, float]:
    """Run ``cmd``; past ``timeout`` (code 124), or once ``stop()`` holds (code STOPPED), it is killed with every
    process below it, and run() returns once they are gone: torchrun starts each worker in a session of its own,
    and a worker outliving its agent held its GPU into the next run (2026-11-27: the 4-GPU run that followed a
    stopped 2-GPU one found 31 of 140 GiB free)."""
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        code = None
        try:
            while code is None:
                try:
                    code = proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    over = time.perf_counter() - started > timeout
                    if over or (stop is not None and stop()):
                        code = 124 if over else STOPPED
        finally:  # also when this script is interrupted
            if proc.poll() is None:
                kill_tree(proc)
    return code, time.perf_counter() - started


def kill_tree(proc: subprocess.Popen, wait_s: float = 120.0) -> None:
    """SIGKILL ``proc`` and every process below it (found before the kill: orphans leave the tree), then wait
    until none is left (a dead process's GPU memory is free once it has exited)."""
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.perf_counter() + wait_s
    while any(alive(pid) for pid in tree) and time.perf_counter() < deadline:
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has: it holds no memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def failed(log: Path, code: int) -> dict:
    return {"status": "failed", "exit": code, "error": log.read_text()[-3000:]}


def outcome(run_dir: Path, log: Path, code: int, nproc: int, skip: int, wall_s: float) -> dict:
    """A run's record: ok with its summary; a run its time cut (exit 124) after it had logged steps past ``skip``:
    "cut", with the summary of those steps (a full 8B fine-tune's final save outlasted a call's budget, 2026-11-27,
    and lost the peaks its steps had logged); otherwise failed."""
    if code == 0:
        return {"status": "ok", **summary(run_dir, nproc, skip, wall_s)}
    if code == STOPPED:
        return {"status": "ok", "final_save": "skipped: stopped once its last step was logged (--no-final-save)",
                **summary(run_dir, nproc, skip, wall_s)}
    if code == 124 and len(metrics(run_dir)) > skip:
        return {"status": "cut", "exit": code, "note": "stopped by its time limit; the steps it logged",
                **summary(run_dir, nproc, skip, wall_s)}
    return failed(log, code)


def scaling(args, recipe: Path, work: Path) -> list[dict]:
    """Each N of --gpus through torchrun; with --plain, first one plain process (no torchrun, no process group):
    the baseline every efficiency is then measured against. --repeats R runs the whole sequence R times in
    rounds (plain, N1, N2, ...; then again), so a drift of the machine reaches every N alike; each run's
    efficiency is against the plain run of its own round. No run starts once --deadline-s would be passed by a
    run as long as the longest so far."""
    results: list[dict] = []
    started, longest = time.perf_counter(), 0.0
    for round_ in range(args.repeats):
        base: dict | None = None
        for n in ([0] if args.plain else []) + args.gpus:
            if args.deadline_s and time.perf_counter() - started + longest > args.deadline_s:
                print(json.dumps({"skipped": f"round {round_ + 1}, {n} process(es): past --deadline-s"}), flush=True)
                continue
            name = (f"{args.case}-{args.parallel}-{n}" if n else f"{args.case}-plain") + f"-r{round_ + 1}"
            run_dir, log = work / name, work / f"{name}.log"
            subprocess.run(["rm", "-rf", str(run_dir)])
            sets = [f"training.parallel={args.parallel}"] if n else []
            code, wall = run(train_command(recipe, n, run_dir, [*sets, *args.set]), log, args.timeout)
            longest = max(longest, wall)
            row = failed(log, code) if code else {"status": "ok", **summary(run_dir, max(n, 1), args.skip, wall)}
            row["launch"] = f"torchrun, {n} process(es)" if n else "plain process"
            row["round"] = round_ + 1
            reductions = [line.strip() for line in log.read_text().splitlines() if "ddp gradients" in line]
            if reductions:
                row["ddp_gradients"] = reductions[0]
            if n == 0 or (not args.plain and base is None):
                base = row if row["status"] == "ok" else None
            elif row["status"] == "ok" and base is not None:
                gpus = max(n, 1)
                row["efficiency"] = round(row["tokens_per_s"] / (base["tokens_per_s"] / base["gpus"] * gpus), 3)
                per_gpu = base["tokens_per_s_median"] / base["gpus"]
                row["efficiency_median"] = round(row["tokens_per_s_median"] / (per_gpu * gpus), 3)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            results.append({"parallel": args.parallel if n else "single", **row})
    return results


def fsdp(args, recipe: Path, work: Path, out: dict) -> list[dict]:
    """FSDP2 on each N of --gpus, with and without training.fsdp_prefetch (--prefetch), each run bounded by
    --timeout and the whole script (the model folder's making included) by --budget seconds: a run that cannot
    start in what is left is skipped and says so; the results are written to --out after every run, so a cut-off
    call keeps the runs it finished."""
    started = STARTED
    choices = {"both": (True, False), "on": (True,), "off": (False,)}[args.prefetch]
    results: list[dict] = []
    for n in args.gpus:
        for prefetch in choices:
            name = f"{args.case}-fsdp-{n}-{'prefetch' if prefetch else 'noprefetch'}"
            run_dir, log = work / name, work / f"{name}.log"
            left = args.budget - (time.perf_counter() - started)
            row: dict = {"parallel": "fsdp", "gpus": n, "fsdp_prefetch": prefetch}
            if left < args.min_run:
                row.update(status="skipped", reason=f"{left:.0f} s of --budget left, under --min-run {args.min_run:g}")
            else:
                subprocess.run(["rm", "-rf", str(run_dir)])
                sets = ["training.parallel=fsdp", f"training.fsdp_prefetch={str(prefetch).lower()}", *args.set]
                trained = (lambda d=run_dir: (d / "metrics.jsonl").exists() and len(metrics(d)) >= args.case_steps
                           ) if args.no_final_save else None
                code, wall = run(train_command(recipe, n, run_dir, sets), log, min(args.timeout, left), trained)
                row.update(outcome(run_dir, log, code, n, args.skip, wall))
                subprocess.run(["rm", "-rf", str(run_dir / "model")])  # a full fine-tune's output: the disk's
            measured = row.get("status") in ("ok", "cut")
            if measured and args.case.startswith("full-8b"):
                row["vs_torchtitan_8b"] = round(row["per_gpu"] / TORCHTITAN_8B["tokens_per_s_per_gpu"], 3)
            pair = next((r for r in results if r["gpus"] == n and r.get("status") in ("ok", "cut")), None)
            if pair is not None and measured:
                on, off = (row, pair) if prefetch else (pair, row)
                row["prefetch_speedup"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "error")}), flush=True)
            results.append(row)
            if args.out:
                args.out.write_text(json.dumps({**out, "runs": results}, indent=1) + "\n")
    return results


def aggregate(results: list[dict]) -> list[dict]:
    """Per process count (0: the plain process): the median and the range of tokens/s over the repeated runs,
    and of the efficiency against the plain run of the same round (1.0: linear)."""
    out = []
    # A failed run (its record has no process count) is left out: one failure no longer loses the call's results.
    for n in sorted({r["gpus"] if r["launch"] != "plain process" else 0 for r in results if r["status"] == "ok"}):
        rows = [r for r in results if r["status"] == "ok"
                and (r["launch"] == "plain process") == (n == 0) and (n == 0 or r["gpus"] == n)]
        if not rows:
            continue
        tps = [r["tokens_per_s"] for r in rows]
        row = {"launch": rows[0]["launch"], "runs": len(rows), "tokens_per_s_median": round(statistics.median(tps)),
               "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
               "spread": round((max(tps) - min(tps)) / statistics.median(tps), 3),
               "peak_gb_ranks_max": max(max(r["peak_gb_ranks"] or [0.0]) for r in rows)}
        effs = [r["efficiency"] for r in rows if "efficiency" in r]
        if effs:
            row.update(efficiency_median=statistics.median(effs), efficiency_min=min(effs),
                       efficiency_max=max(effs))
        out.append(row)
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_of_rank(launcher: int, rank: int) -> int | None:
    for pid in descendants(launcher):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return pid
    return None


def weights(run_dir: Path) -> dict:
    """Every tensor of the run's final output (``adapter/`` for LoRA, ``model/`` for full fine-tuning)."""
    from safetensors.torch import load_file

    files = [f for kind in ("adapter", "model") for f in sorted((run_dir / kind).glob("*.safetensors"))]
    if not files:
        raise SystemExit(f"{run_dir}: no adapter/ or model/ safetensors to compare")
    return {f"{f.relative_to(run_dir)}:{k}": v for f in files for k, v in load_file(f).items()}


def compare(a: dict, b: dict) -> dict:
    if a.keys() != b.keys():
        return {"same_names": False, "only_a": sorted(a.keys() - b.keys())[:5],
                "only_b": sorted(b.keys() - a.keys())[:5]}
    worst = max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)
    scale = max(a[k].float().abs().max().item() for k in a)
    return {"same_names": True, "tensors": len(a), "bitwise_equal": all(a[k].equal(b[k]) for k in a),
            "max_abs_diff": worst[0], "worst_tensor": worst[1], "largest_value": scale}


def restart(args, recipe: Path, work: Path) -> dict:
    n = args.gpus[0]
    sets = [f"training.parallel={args.parallel}", f"training.save_every={args.save_every}", *args.set]
    out: dict = {"gpus": n, "parallel": args.parallel, "save_every": args.save_every, "kill_after": args.kill_after}
    clean = work / f"restart-{args.case}-clean"
    subprocess.run(["rm", "-rf", str(clean)])
    code, wall = run(train_command(recipe, n, clean, sets), work / "restart-clean.log", args.timeout)
    if code:
        return {**out, "clean": failed(work / "restart-clean.log", code)}
    out["clean"] = {"status": "ok", **summary(clean, n, args.skip, wall)}

    killed, log = work / f"restart-{args.case}-killed", work / "restart-killed.log"
    subprocess.run(["rm", "-rf", str(killed)])
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(train_command(recipe, n, killed, sets, max_restarts=1), stdout=f,
                                stderr=subprocess.STDOUT)
        victim = None
        while proc.poll() is None and victim is None and time.perf_counter() - started < args.timeout:
            time.sleep(0.2)
            logged = metrics(killed) if (killed / "metrics.jsonl").is_file() else []
            if logged and logged[-1]["step"] >= args.kill_after:
                victim = worker_of_rank(proc.pid, n - 1)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    out["killed"] = {"rank": n - 1, "pid": victim, "after_step": logged[-1]["step"],
                                     "at_s": round(time.perf_counter() - started, 1)}
        try:
            code = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 124
    if code or victim is None:
        return {**out, "restarted": failed(log, code) if code else {"status": "no rank was killed"}}
    out["restarted"] = {"status": "ok", **summary(killed, n, args.skip, time.perf_counter() - started)}
    out["restarted"]["resumed"] = [line for line in log.read_text().splitlines() if line.startswith("resuming from")]
    a, b = weights(clean), weights(killed)
    out["clean_vs_restarted"] = compare(a, b)
    out["losses_equal"] = out["clean"]["losses"] == out["restarted"]["losses"]
    if not out["clean_vs_restarted"].get("bitwise_equal"):  # the GPU's own spread between two identical runs
        again = work / f"restart-{args.case}-clean2"
        subprocess.run(["rm", "-rf", str(again)])
        code, _ = run(train_command(recipe, n, again, sets), work / "restart-clean2.log", args.timeout)
        out["clean_vs_clean"] = compare(a, weights(again)) if not code else failed(work / "restart-clean2.log", code)
    return out


def machine() -> dict:
    """bench_train's environment record, with every GPU of the host and NCCL's version."""
    import torch
    from bench_train import environment

    info = environment()
    if torch.cuda.is_available():
        info.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("scaling", "restart", "fsdp"))
    p.add_argument("--case", default="lora-1b", choices=sorted(CASES))
    p.add_argument("--parallel", default="ddp", choices=("auto", "ddp", "fsdp"),
                   help="training.parallel of the torchrun runs (auto: one process runs as a plain one)")
    p.add_argument("--plain", action="store_true", help="first one plain process: the baseline of the efficiencies")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="process counts (restart: the first)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default: the case's)")
    p.add_argument("--repeats", type=int, default=1, help="scaling: rounds of every run (median and range)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="scaling: start no run that would end past this many seconds (0: no limit)")
    p.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=15)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for every run")
    p.add_argument("--timeout", type=float, default=400, help="seconds a run may take")
    p.add_argument("--work", type=Path, default=Path("/tmp/multi_gpu"))
    p.add_argument("--tokenizer", type=Path, default=Path(".e2e"))
    p.add_argument("--text", type=Path, default=Path(".e2e/text.jsonl"))
    p.add_argument("--tiny", action="store_true", help="a toy size on the CPU: a smoke test")
    p.add_argument("--out", type=Path)
    p.add_argument("--prefetch", default="both", choices=("both", "on", "off"), help="fsdp: training.fsdp_prefetch")
    p.add_argument("--budget", type=float, default=1e9, help="fsdp: seconds for all the runs (a device call's)")
    p.add_argument("--min-run", type=float, default=120, help="fsdp: a run needs this much --budget left to start")
    p.add_argument("--no-final-save", action="store_true",
                   help="fsdp: end each run once its last step is logged (a full fine-tune's final save of the whole "
                        "model is not what is measured, and can outlast a device call)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.set = ["model.device=cpu", "training.precision=fp32", *args.set]
    case = bench_e2e.case_for(args.case, args.steps, args.tiny, CASES)
    args.case_steps = case["steps"]
    recipe = prepare(args.case, case, args.work, args.tokenizer, args.text, args.tiny)
    result = {"what": args.what, "case": args.case, "settings": case, "machine": machine(), "sets": args.set,
              "command": " ".join(sys.argv)}
    if args.what == "fsdp":
        if args.case.startswith("full-8b"):
            result["torchtitan"] = TORCHTITAN_8B
        result["runs"] = fsdp(args, recipe, args.work, result)
    elif args.what == "scaling":
        result["runs"] = scaling(args, recipe, args.work)
    else:
        result["runs"] = restart(args, recipe, args.work)
    if args.what == "restart":
        print(json.dumps({k: v for k, v in result["runs"].items() if k not in ("clean", "restarted")}, indent=1))
    elif args.what == "scaling":
        result["aggregate"] = aggregate(result["runs"])
        for row in result["aggregate"]:
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
