"""Where the host's time goes in an eager ``bench_qlora.py`` row: cProfile over a few steps after warm-up.

    PYTHONPATH=src python bench/host_profile.py loop-qlora [steps]

Prints the step time without and with the profiler, then the functions with the most time of their own and the
most time under them. An eager step is host-bound when the host takes longer to issue its kernels than the GPU
takes to run them; this says which Python is in the way.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import bench_qlora as bq
import torch


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "loop-qlora"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    row = bq.ROWS[name]
    model = bq.build_entrenar(row)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=bq.LR, weight_decay=0.0, fused=True)
    step = bq.step_fn(row)
    ids = torch.randint(0, bq.CONFIG.vocab_size, (bq.BATCH, bq.SEQ), device=bq.DEVICE)

    def one() -> None:
        step(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms a step")
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"{name} under cProfile: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms a step")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
