"""Which device and dtype a run or a load uses: one table of dtype names, one rule for ``auto``; whether
Triton kernels run on given tensors; and whether this CPU multiplies 16-bit matrices natively.

The CLI builds its ``--dtype`` choices from :data:`DTYPES` before it imports torch (``entrenar --help`` stays
instant), so torch is imported by the functions that need it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

from entrenar.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ACCELERATORS", "DTYPES", "available_memory", "cpu_products_in_fp32", "interpreting", "resolve_device",
           "resolve_dtype", "triton_available", "use_triton"]

# The weight dtypes a user may name (library and CLI), each to its torch dtype's name; "auto" is handled apart.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None/'auto' means bf16 on a CUDA device that supports it, else fp32. A CUDA device planned for from a
    machine without one (`entrenar inspect --device cuda`) counts as supporting it, as every GPU since Ampere does."""
    import torch  # start-up time (the module docstring)

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_cuda = torch.device(device).type == "cuda"
        bf16 = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return torch.bfloat16 if on_cuda and bf16 else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (allowed: auto, {', '.join(DTYPES)})")
    return getattr(torch, DTYPES[dtype])


# Device types a run may name, beside the CPU, with what PyTorch calls their runtime (ROCm builds are "cuda").
ACCELERATORS = {"cuda": "CUDA (or ROCm)", "xpu": "XPU (Intel GPU)", "mps": "MPS (Apple Metal)"}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None/'auto' means the CUDA device if there is one, else the CPU; a named device (cpu, cuda, xpu, mps) must
    exist here. Devices other than CUDA train through the plain PyTorch paths (no Triton kernels)."""
    import torch  # start-up time (the module docstring)

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device '{device}' (use auto, cpu, cuda, cuda:N, xpu, xpu:N or mps): {e}") from None
    if resolved.type in ACCELERATORS:
        runtime = ACCELERATORS[resolved.type]
        if not _available(resolved.type):
            raise ConfigError(f"device '{device}' was asked for, but {runtime} is not available on this machine")
        count = _count(resolved.type)
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError(f"device '{device}': this machine has {count} {runtime} device(s)")
    return resolved


def _available(kind: str) -> bool:
    import torch  # start-up time (the module docstring)

    if kind == "mps":
        return bool(torch.backends.mps.is_available())
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu
    return bool(module is not None and module.is_available())


def _count(kind: str) -> int:
    import torch  # start-up time (the module docstring)

    return 1 if kind == "mps" else int(getattr(torch, kind).device_count())


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes a new process could take on ``device`` now, where the number comes from), or None where this system
    does not say. CUDA: the device's free memory; a CPU: the kernel's ``MemAvailable`` (what can be allocated
    without swapping), or what a cgroup v2 memory limit leaves when that is less."""
    import torch  # start-up time (the module docstring)

    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device} (torch.cuda.mem_get_info)"
    if device.type != "cpu":
        return None
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
    except (OSError, ValueError):
        return found
    if limit != "max" and (found is None or int(limit) - used < found[0]):
        return max(int(limit) - used, 0), "the cgroup's memory.max less memory.current"
    return found


# ---------------------------------------------------------------- 16-bit products on a CPU


def cpu_products_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """True if ``device`` is a CPU without instructions for matrix products in ``dtype`` (bf16 or fp16).

    Without AVX-512 BF16 or AMX (bf16) or AMX-FP16 (fp16), PyTorch forms such a matrix product element by
    element with conversions: on an AVX2 CPU a bf16 product of a SmolLM2 projection takes about 7x the
    time of the same product in fp32 (docs/PERFORMANCE.md, CPU). Code that asks forms its products in fp32
    from the exact fp32 values of its 16-bit operands and rounds the result once, as the 16-bit GEMM does
    (it accumulates in fp32 too). False on other devices and on CPUs with those instructions; True on ARM CPUs,
    for which PyTorch offers no such test.
    """
    import torch  # start-up time (the module docstring)

    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return not _cpu_has_native(dtype == torch.bfloat16)


@functools.cache
def _cpu_has_native(bf16: bool) -> bool:
    import torch  # start-up time (the module docstring)

    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if bf16 else ("_is_amx_fp16_supported",)
    return any(getattr(torch.cpu, name, lambda: False)() for name in names)


# ---------------------------------------------------------------- Triton

# Triton is imported lazily, only when a kernel is first used on a tensor it can run on, so CPU-only installs never
# need it. Looked up once, without importing triton; a constant is also what torch.compile wants to see. Here, below
# both, because the fused kernels (entrenar.kernels) and NF4's dequantization kernel (entrenar.quant.nf4) ask.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True if the ``triton`` package can be imported."""
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``: slow; for tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True if the Triton kernels can run on these tensors: CUDA tensors (or any, under the interpreter)."""
    import torch  # start-up time (the module docstring)

    if not _TRITON_INSTALLED:
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return not torch.compiler.is_compiling() and interpreting()
