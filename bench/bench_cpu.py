"""CPU LoRA training step: transformers + PEFT against entrenar, side by side, on the SmolLM2-135M shape.

    PYTHONPATH=src python bench/bench_cpu.py --steps 8 --out bench_cpu.json

All rows are built first with identical weights (drawn per parameter name,
as in bench_train.py) and then stepped round-robin, one step of each row in
turn, so that drift in the machine's speed falls on every row alike. Each
step is forward, backward and AdamW on the LoRA parameters (r=16, alpha=32,
all linear layers but the output head), fp32, on the same token batch.
Reported: median and best wall-clock step time after the warm-up steps, the
median process CPU time of a step (a fairer measure when other programs load
the machine: the load average is recorded too), tokens/s, the ratio to
transformers + PEFT, and the loss of every step. ``--profile DIR`` writes a
torch.profiler table of one more step of each row.

Rows: hf (transformers + PEFT, sdpa), plain (entrenar, PyTorch chunked
cross-entropy), kernels (entrenar with apply_kernels: on CPU only the fused
LoRA layer is active, the Triton ops fall back to their PyTorch paths), and
plain-compiled / kernels-compiled (each decoder block under torch.compile;
the first step includes compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from bench_train import (
    LORA_ALPHA,
    LORA_R,
    build_entrenar,
    build_hf,
    entrenar_step_loss,
    environment,
    hf_step_loss,
    model_config,
)

from entrenar.kernels import fused_linear_cross_entropy
from entrenar.models.loss import chunked_cross_entropy

ROWS = ("hf", "plain", "kernels", "plain-compiled", "kernels-compiled")


def build(row: str, shape: str, seq: int, layers: int | None):
    cfg = model_config(shape, seq)
    if layers:
        cfg = cfg.replace(num_layers=layers)
    torch.manual_seed(0)
    if row == "hf":
        return build_hf(cfg, "lora", False, "cpu", torch.float32), hf_step_loss
    kernels = row.startswith("kernels")
    mode = "compiled" if row.endswith("compiled") else "eager"
    model = build_entrenar(cfg, "lora", False, "cpu", torch.float32, kernels, mode)
    return model, entrenar_step_loss(fused_linear_cross_entropy if kernels else chunked_cross_entropy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS[:3]))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (for profiling)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", default=None, help="folder for per-row profiler tables of one extra step")
    parser.add_argument("--out", default="bench_cpu.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = args.rows.split(",")
    built = {row: build(row, args.shape, args.seq, args.layers) for row in rows}
    optims = {row: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
              for row, (m, _) in built.items()}
    g = torch.Generator().manual_seed(1234)
    vocab = model_config(args.shape, args.seq).vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g) for _ in range(4)]

    def train_step(row: str, ids: torch.Tensor) -> float:
        model, step_loss = built[row]
        loss = step_loss(model, ids)
        loss.backward()
        optims[row].step()
        optims[row].zero_grad(set_to_none=True)
        return loss.item()

    times: dict[str, list[float]] = {row: [] for row in rows}
    cpu_times: dict[str, list[float]] = {row: [] for row in rows}
    losses: dict[str, list[float]] = {row: [] for row in rows}
    load = [os.getloadavg()[0]]
    for step in range(args.steps):
        ids = batches[step % len(batches)]
        for row in rows:
            start, cpu_start = time.perf_counter(), time.process_time()
            losses[row].append(train_step(row, ids))
            times[row].append(time.perf_counter() - start)
            cpu_times[row].append(time.process_time() - cpu_start)
        load.append(os.getloadavg()[0])
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for row in rows:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train_step(row, batches[0])
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
            (Path(args.profile) / f"profile_cpu_{row}.txt").write_text(table)

    tokens = args.batch * args.seq
    result = {"environment": {**environment(), "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                              "load_average_during": load},
              "shape": args.shape, "layers": args.layers, "batch": args.batch, "seq": args.seq,
              "lora": {"r": LORA_R, "alpha": LORA_ALPHA}, "rows": {}}
    print(f"{args.shape} LoRA r={LORA_R}, batch {args.batch} x seq {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads, steps {args.warmup + 1}..{args.steps}; "
          f"load average {min(load):.1f}..{max(load):.1f}")
    print(f"{'row':<17}{'median ms':>10}{'best ms':>9}{'cpu ms':>9}{'tok/s':>7}{'x hf':>6}{'best':>6}{'cpu':>6}"
          "  first losses")
    hf = None
    for row in rows:
        wall, cpu = times[row][args.warmup:], cpu_times[row][args.warmup:]
        r = {"step_ms_median": statistics.median(wall) * 1e3, "step_ms_best": min(wall) * 1e3,
             "cpu_ms_median": statistics.median(cpu) * 1e3, "step_ms_all": [t * 1e3 for t in times[row]],
             "cpu_ms_all": [t * 1e3 for t in cpu_times[row]], "losses": losses[row]}
        r["tokens_per_s"] = tokens / r["step_ms_median"] * 1e3
        hf = r if row == "hf" else hf
        r["speed_vs_hf"] = hf["step_ms_median"] / r["step_ms_median"] if hf else None
        r["cpu_speed_vs_hf"] = hf["cpu_ms_median"] / r["cpu_ms_median"] if hf else None
        r["best_speed_vs_hf"] = hf["step_ms_best"] / r["step_ms_best"] if hf else None
        result["rows"][row] = r
        ratios = [r[k] or float("nan") for k in ("speed_vs_hf", "best_speed_vs_hf", "cpu_speed_vs_hf")]
        print(f"{row:<17}{r['step_ms_median']:10.0f}{r['step_ms_best']:9.0f}{r['cpu_ms_median']:9.0f}"
              f"{r['tokens_per_s']:7.0f}" + "".join(f"{x:6.2f}" for x in ratios) + "  "
              + " ".join(f"{x:.4f}" for x in losses[row][:4]))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
