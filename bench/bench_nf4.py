"""NF4 dequantization bandwidth: entrenar's Triton kernel against a device copy, PyTorch and bitsandbytes.

    PYTHONPATH=src python bench/bench_nf4.py --out bench_nf4.json

The weight is Llama-3.1-8B's largest projection, 14336 x 4096, NF4 with double
quantization (blocksize 64), dequantized to bf16 (and fp16 / fp32). Bytes
moved per dequantization count what must cross device memory once: the packed
codes (n/2), the 8-bit absmax codes (n/64), the fp32 absmax scales (n/16384)
and the output (2n for bf16). The ceiling is a device-to-device copy
(``dst.copy_(src)``, bytes read + written) measured in the same run, on a
large buffer (1 GiB) and on one as large as a dequantization's traffic.

Kernel times come from CUDA-graph replays (no Python launch overhead) of 30
calls rotating over 3 different weights, so the 29 MB of codes are not served
from L2 by the previous call; the median of 20 replays is reported. The
``eager`` column times the public call (custom-op dispatch + allocation +
launch) without a graph. bitsandbytes' ``dequantize_4bit`` is timed the same
way when it imports, on the same weights quantized by bitsandbytes, and our
kernel run on bitsandbytes' packed bytes must give its output bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from entrenar.quant.nf4 import kernel as nf4_kernel
from entrenar.quant.nf4.format import NF4Tensor, dequantize_nf4_reference, quantize_nf4

SHAPE = (14336, 4096)
N_WEIGHTS = 3  # rotated between calls so codes come from DRAM, not L2 (3 x 29 MB > 60 MB L2)
CALLS_PER_GRAPH = 30
SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8)]  # (bytes per program, warps)


def median_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms_per_call(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median time of one call, from replays of a CUDA graph holding ``CALLS_PER_GRAPH`` calls round-robin."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm up (compilation, allocator) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            calls[i % len(calls)]()
    return median_ms(graph.replay, reps) / CALLS_PER_GRAPH


def copy_gbps(nbytes: int) -> tuple[float, float]:
    """(ms, GB/s counting read + write) of a device-to-device copy of ``nbytes``."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return ms, 2 * nbytes / ms / 1e6


def kernel_calls(qs: list[NF4Tensor], outs: list[torch.Tensor], **options) -> list[Callable[[], object]]:
    """One raw kernel launch per weight, each into its own preallocated output."""
    return [functools.partial(nf4_kernel.launch, q.codes, q.absmax, q.absmax_scale, q.absmax_offset, q.blocksize, out,
                              **options) for q, out in zip(qs, outs, strict=True)]


def traffic_bytes(q: NF4Tensor, out_dtype: torch.dtype) -> int:
    return q.nbytes + q.numel * out_dtype.itemsize


def ptx_report(q: NF4Tensor) -> dict:
    """What the compiled kernel does per thread: vector widths of its loads and stores, any FMAs."""
    out = torch.empty(2 * q.codes.numel(), dtype=torch.bfloat16, device="cuda")
    compiled = nf4_kernel.launch(q.codes, q.absmax, q.absmax_scale, q.absmax_offset, q.blocksize, out)
    ptx = compiled.asm.get("ptx", "")
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {
        "ld.global.v4": count(r"ld\.global[.\w]*\.v4"), "ld.global (all)": count(r"ld\.global"),
        "st.global.v4": count(r"st\.global[.\w]*\.v4"), "st.global (all)": count(r"st\.global"),
        "fma": count(r"\bfma\."), "registers": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None), "ptx": ptx,
    }


def from_bitsandbytes(packed: torch.Tensor, state) -> NF4Tensor:
    """bitsandbytes' packed weight and QuantState as an NF4Tensor (same layout: first element in the high nibble)."""
    return NF4Tensor(packed.reshape(-1), state.absmax, state.state2.absmax, state.offset, state.shape, state.dtype,
                     state.blocksize)


def bench_bitsandbytes(weights: list[torch.Tensor], ours: list[NF4Tensor]) -> dict:
    """Time bitsandbytes' dequantize_4bit; check its output against our kernel on the same packed bytes."""
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except Exception as err:  # not installed, or no binary for this CUDA
        return {"status": f"unavailable: {type(err).__name__}: {err}"[:300]}
    packed = [bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4") for w in weights]
    calls = [lambda p=p: bnbf.dequantize_4bit(p[0], p[1]) for p in packed]
    theirs = calls[0]()
    mine = nf4_kernel.dequantize_nf4_triton(from_bitsandbytes(*packed[0]), torch.bfloat16)
    q = ours[0]
    result = {
        "status": "ok", "version": bitsandbytes.__version__,
        "dequantize_equal_bits": bool(torch.equal(theirs.view(torch.int16), mine.view(torch.int16))),
        "same_codes_as_entrenar": bool(torch.equal(packed[0][0].reshape(-1), q.codes)),
        "same_absmax_codes_as_entrenar": bool(torch.equal(packed[0][1].absmax, q.absmax)),
    }
    try:
        result["ms"] = graph_ms_per_call(calls)
        result["timing"] = "cuda graph"
    except Exception as err:  # some bitsandbytes paths do not capture; fall back to eager timing
        result["graph_error"] = f"{type(err).__name__}: {err}"[:300]
        result["ms"] = statistics.median(median_ms(c) for c in calls)
        result["timing"] = "eager"
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_nf4.json")
    parser.add_argument("--ptx", default=None, help="write the kernel's PTX here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_nf4.py needs a CUDA GPU")
    torch.manual_seed(0)
    weights = [torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(N_WEIGHTS)]
    qs = [quantize_nf4(w) for w in weights]
    q = qs[0]
    bf16_bytes = traffic_bytes(q, torch.bfloat16)

    big_ms, big_gbps = copy_gbps(2**30)
    same_ms, same_gbps = copy_gbps(bf16_bytes // 2)  # half read + half written = a dequantization's traffic
    doc: dict = {
        "shape": SHAPE, "bytes_bf16": bf16_bytes,
        "copy": {"1GiB": {"ms": big_ms, "GBps": big_gbps}, "same_traffic": {"ms": same_ms, "GBps": same_gbps}},
    }

    # Correctness on the benchmark weight itself: kernel == PyTorch reference (on the GPU) bit for bit.
    ours = [nf4_kernel.dequantize_nf4_triton(x, torch.bfloat16) for x in qs]
    ref = dequantize_nf4_reference(q, torch.bfloat16)
    doc["equal_bits_to_reference"] = bool(torch.equal(ours[0].view(torch.int16), ref.view(torch.int16)))
    del ref

    rows = []

    def row(name: str, ms: float, traffic: int, **extra) -> None:
        gbps = traffic / ms / 1e6
        rows.append({"name": name, "ms": ms, "GBps": gbps, "of_copy": gbps / big_gbps, **extra})

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        outs = [torch.empty(2 * x.codes.numel(), dtype=dtype, device="cuda") for x in qs]
        calls = kernel_calls(qs, outs)
        row(f"entrenar triton -> {str(dtype).removeprefix('torch.')}", graph_ms_per_call(calls),
            traffic_bytes(q, dtype))
        del outs, calls
    outs = [torch.empty(2 * x.codes.numel(), dtype=torch.bfloat16, device="cuda") for x in qs]
    for nbytes, warps in SWEEP:
        calls = kernel_calls(qs, outs, bytes_per_program=nbytes, num_warps=warps)
        row(f"  sweep {nbytes} B/program, {warps} warps", graph_ms_per_call(calls), bf16_bytes)
    del outs
    eager = [lambda x=x: nf4_kernel.dequantize_nf4_triton(x, torch.bfloat16) for x in qs]
    row("entrenar triton, eager call", statistics.median(median_ms(c) for c in eager), bf16_bytes)
    row("PyTorch reference (GPU)", median_ms(lambda: dequantize_nf4_reference(q, torch.bfloat16), reps=5),
        bf16_bytes)
    bnb = bench_bitsandbytes(weights, qs)
    doc["bitsandbytes"] = bnb
    if bnb.get("ms"):
        row(f"bitsandbytes {bnb['version']} dequantize_4bit ({bnb['timing']})", bnb["ms"], bf16_bytes)

    ptx = ptx_report(q)
    if args.ptx:
        Path(args.ptx).write_text(ptx["ptx"])
    doc["ptx"] = {k: v for k, v in ptx.items() if k != "ptx"}
    doc["rows"] = rows
    doc["environment"] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "triton": __import__("triton").__version__,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))

    print(f"NF4 dequantization of a {SHAPE[0]}x{SHAPE[1]} weight on {doc['environment']['gpu']}")
    print(f"copy ceiling: {big_gbps:.0f} GB/s (1 GiB), {same_gbps:.0f} GB/s ({bf16_bytes / 1e6:.0f} MB, same traffic)")
    print(f"bit-exact vs PyTorch reference: {doc['equal_bits_to_reference']}; "
          f"bitsandbytes' dequantize of its own bytes equals ours: {bnb.get('dequantize_equal_bits', bnb['status'])}")
    print(f"PTX: {doc['ptx']}")
    print(f"{'':<48}{'us':>9}{'GB/s':>8}{'of copy':>9}")
    for r in rows:
        print(f"{r['name']:<48}{1e3 * r['ms']:9.1f}{r['GBps']:8.0f}{100 * r['of_copy']:8.1f}%")


if __name__ == "__main__":
    main()
