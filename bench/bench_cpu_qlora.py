"""CPU QLoRA: one SmolLM2-135M decoder layer's LoRA projections on NF4 bases, forward and backward, as
`entrenar train` runs them with `lora.quantize_base: nf4` and `training.precision: bf16` on a CPU.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/bench_cpu_qlora.py --repeat 5 --out cpu_qlora.json

The layer's seven projections (q, k, v and gate, up in two fused nodes; o and down alone; LoRA r=16,
alpha=32 on fp32 adapters) on 4 x 256 tokens under bf16 autocast. Rows, stepped round-robin so the machine's
drift falls on each alike:

- ``before``: the code before CPU products in fp32: 16-bit products (as on a CPU with AVX-512 BF16 or AMX;
  on one without them PyTorch emulates them) and the reference dequantization (nibbles unpacked to int64).
- ``bf16-bytes``: 16-bit products, dequantization by byte lookup.
- ``after``: what runs now on this CPU (:func:`entrenar.device.cpu_products_in_fp32` decides): on a CPU without
  16-bit product instructions, products in fp32 and dequantization by byte lookup.

Also timed alone: one dequantization of the 1536 x 576 gate weight to bf16, reference and byte lookup.
Reported: median process CPU time (fair under load from other programs; the load average is recorded) and
wall time per layer step, and the ratio to ``before``. A step of the whole model runs 30 such layers plus
attention, norms, the embedding and the loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import entrenar.device
import entrenar.quant.nf4.format as nf4_format
from entrenar.kernels.lora_linear import FusedLoraLinear, project_together
from entrenar.quant.nf4.format import NF4Linear, dequantize_nf4_by_bytes, dequantize_nf4_reference, quantize_nf4

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192  # SmolLM2-135M
PROJECTIONS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
               "gate": (HIDDEN, INTERMEDIATE), "up": (HIDDEN, INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}
ROWS = ("before", "bf16-bytes", "after")


def layer() -> dict[str, FusedLoraLinear]:
    torch.manual_seed(0)
    out = {}
    for name, (n_in, n_out) in PROJECTIONS.items():
        proj = FusedLoraLinear(NF4Linear.from_linear(nn.Linear(n_in, n_out, bias=False)), r=16, alpha=32.0)
        proj.base_layer.requires_grad_(False)
        with torch.no_grad():
            proj.lora_B.weight.normal_(0, 0.02)
        out[name] = proj
    return out


@contextlib.contextmanager
def row_settings(row: str):
    """Patch the two decisions the rows differ in, restoring them after."""
    native, by_bytes = entrenar.device._cpu_has_native, nf4_format.dequantize_nf4_by_bytes
    if row in ("before", "bf16-bytes"):
        entrenar.device._cpu_has_native = lambda bf16: True  # type: ignore[assignment]
    if row == "before":
        nf4_format.dequantize_nf4_by_bytes = dequantize_nf4_reference  # type: ignore[assignment]
    try:
        yield
    finally:
        entrenar.device._cpu_has_native = native  # type: ignore[assignment]
        nf4_format.dequantize_nf4_by_bytes = by_bytes  # type: ignore[assignment]


def step(projections: dict[str, FusedLoraLinear], x0: torch.Tensor) -> None:
    x = x0.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = project_together(x, [projections["q"], projections["k"], projections["v"]])
        o = projections["o"](q)
        gate, up = project_together(x, [projections["gate"], projections["up"]])
        down = projections["down"](gate * up)
    (q.float().sum() + k.float().sum() + v.float().sum() + o.float().sum() + down.float().sum()).backward()


def timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    projections = layer()
    x0 = torch.randn(args.tokens, HIDDEN)
    gate = quantize_nf4(torch.randn(INTERMEDIATE, HIDDEN) * 0.02)
    times: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": []} for r in (*ROWS, "deq-ref", "deq-bytes")}
    load = [os.getloadavg()[0]]
    for i in range(args.repeat + 1):  # the first round warms up and is dropped
        for row in ROWS:
            with row_settings(row):
                wall, cpu = timed(lambda: step(projections, x0))
            if i:
                times[row]["wall"].append(wall)
                times[row]["cpu"].append(cpu)
        for row, fn in (("deq-ref", dequantize_nf4_reference), ("deq-bytes", dequantize_nf4_by_bytes)):
            wall, cpu = timed(lambda: fn(gate, torch.bfloat16))
            if i:
                times[row]["wall"].append(wall)
                times[row]["cpu"].append(cpu)
        load.append(os.getloadavg()[0])
    native = not entrenar.device.cpu_products_in_fp32(torch.device("cpu"), torch.bfloat16)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, bf16 products "
          f"{'native' if native else 'emulated'} ({torch.backends.cpu.get_cpu_capability()}), "
          f"load average {min(load):.1f}..{max(load):.1f}")
    base = statistics.median(times["before"]["cpu"])
    result = {"threads": torch.get_num_threads(), "bf16_native": native, "load_average": load,
              "torch": torch.__version__, "tokens": args.tokens, "rows": times}
    for row, t in times.items():
        cpu, wall = statistics.median(t["cpu"]), statistics.median(t["wall"])
        ratio = f"  {base / cpu:5.2f}x before" if row in ROWS else ""
        print(f"{row:<11} CPU median {cpu * 1e3:8.1f} ms ({min(t['cpu']) * 1e3:.1f}-{max(t['cpu']) * 1e3:.1f})  "
              f"wall median {wall * 1e3:8.1f} ms{ratio}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
