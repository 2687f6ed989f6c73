"""PCIe copy bandwidth between pinned CPU memory and the GPU, alone and beside matrix products.

What activation offload (``training.offload_activations``) spends: a block's
saved activations cross the bus once each way per step, on a side stream, while
the compute stream runs the model. This measures whether that is free on the
machine at hand: copies of 256 MiB to and from pinned memory, both directions
at once, and bf16 8192^3 products timed alone and with copies running beside
them (warmed up first).

    python bench/pcie_probe.py --out pcie.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

MIB = 2**20


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms / 1e3) / 1e9


def _timed(fn, stream: torch.cuda.Stream | None = None) -> float:
    """Milliseconds of ``fn``'s GPU work, enqueued on ``stream`` (default: the current one)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="pcie.json")
    parser.add_argument("--reps", type=int, default=20, help="copies of 256 MiB per measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("pcie_probe.py needs a CUDA GPU")
    n = 256 * MIB
    gpu, gpu2 = (torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2))
    host, host2 = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    side, side2 = torch.cuda.Stream(), torch.cuda.Stream()

    def to_cpu(reps: int = args.reps) -> None:
        for _ in range(reps):
            host.copy_(gpu, non_blocking=True)

    def to_gpu() -> None:
        for _ in range(args.reps):
            gpu2.copy_(host2, non_blocking=True)

    to_cpu(2)
    result = {"to_cpu_GBps": _gbps(args.reps * n, _timed(to_cpu, side)),
              "to_gpu_GBps": _gbps(args.reps * n, _timed(to_gpu, side2))}
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(side):
        to_cpu()
    with torch.cuda.stream(side2):
        to_gpu()
    torch.cuda.synchronize()
    result["both_ways_GBps_each"] = _gbps(args.reps * n, (time.perf_counter() - began) * 1e3)

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    products = 40

    def matmuls() -> None:
        for _ in range(products):
            a @ b

    matmuls()  # cuBLAS picks its kernel
    alone = _timed(matmuls)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        to_cpu(3 * args.reps)  # longer than the products: they run beside copies throughout
    beside = _timed(matmuls)
    flops = products * 2 * 8192**3
    result.update(matmul_tflops_alone=flops / (alone / 1e3) / 1e12,
                  matmul_tflops_beside_copies=flops / (beside / 1e3) / 1e12,
                  device=torch.cuda.get_device_name(), torch=torch.__version__)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
