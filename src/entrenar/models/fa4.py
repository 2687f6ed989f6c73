"""FlashAttention-4 for packed rows on Hopper: an optional extra (``pip install 'entrenar[fa4]'``).

``training.attention_kernel: fa4`` runs the variable-length attention of packed and padding-free rows
(:func:`entrenar.models.padding_free.documents_attention`) through FlashAttention-4's CuTe DSL kernels
(the ``flash-attn-4`` package, module ``flash_attn.cute``, compiled on first call) instead of FlashAttention-2's
(:func:`torch.nn.attention.varlen.varlen_attn`), with the same semantics: causal within each segment, a sliding
window as ``(window - 1, 0)``, the softmax scale, fewer key/value heads than query heads passed as they are (GQA),
and segments with fewer queries than keys (shared-prompt preference pairs) masked bottom-right. Forward and
backward of packed rows measured 1.23-1.55x FA2's on one H100 (docs/RECIPES.md, "Hopper attention").

What FA4 does not take here stays on FA2's kernel or the per-document path: attention sinks and soft-capped
scores (they never reach the variable-length call), head sizes outside 8-256, fp32, a device other than a
compute capability 9.0 GPU, and blocks that ``torch.compile`` traces. Source read: flash-attn-4 4.0.0b36,
``flash_attn/cute/interface.py`` (``flash_attn_varlen_func``, ``_validate_head_dims``: on SM90 head sizes 8-256,
multiples of 8 in 16-bit; ``_resolve_causal_local_window``) and ``mask.py`` (the causal and local limits offset by
``seqlen_k - seqlen_q``: bottom-right, as FlashAttention-2's ``mask.h``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

INSTALL = "pip install 'entrenar[fa4]'"  # the extra pins flash-attn-4 (pyproject.toml)
HOPPER = (9, 0)  # the compute capability FA4's SM90 kernels were measured on (H100); SM100 kernels are not checked
KERNELS = ("fa2", "fa4")  # what Documents.kernel may name


def fa4_module() -> Any | None:
    """``flash_attn.cute`` where it imports, else None (the extra is not installed, or its CUDA libraries are
    missing)."""
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError:
        return None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, or None where it is not a CUDA device this process has."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device`` here (None: it can): the package and a Hopper GPU."""
    if fa4_module() is None:
        return f"flash_attn.cute (the flash-attn-4 package) does not import here; install the extra: {INSTALL}"
    capability = device_capability(device)
    if capability is None:
        return f"it runs on a Hopper GPU (CUDA compute capability 9.0), and this run trains on {device}"
    if capability != HOPPER:
        return (f"it runs on a Hopper GPU (CUDA compute capability 9.0) only, and {device} has compute capability "
                f"{capability[0]}.{capability[1]}")
    return None


def fa4_takes(q: torch.Tensor, v_dim: int) -> bool:
    """Whether FA4 can run this call: q ``[N, H, D]`` in bf16/fp16 on a Hopper GPU, a head size of 8-256 in steps
    of 8 for queries and values alike (narrower values are padded by the caller), outside ``torch.compile``."""
    d = q.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and 8 <= d <= 256 and d % 8 == 0 and v_dim == d
            and not torch.compiler.is_compiling() and device_capability(q.device) == HOPPER
            and fa4_module() is not None)


def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, window: int | None, scale: float | None) -> torch.Tensor:
    """Causal attention of each segment's queries q ``[N, Hq, D]`` over its keys and values k, v ``[K, Hk, D]``
    (segments ``cu_q``, ``cu_k``: int32 ``[D + 1]``; a segment with fewer queries than keys aligned bottom-right)
    through FA4 -> ``[N, Hq, D]``. ``window``: each query sees its ``window`` latest keys, itself included (None:
    all); ``scale`` None is ``D ** -0.5``. Under PyTorch's deterministic algorithms its backward runs in a fixed
    order, as FA2's does there."""
    module = fa4_module()
    assert module is not None  # fa4_takes checked
    extra: dict[str, Any] = {}
    if window is not None and window < max(max_q, max_k):  # a window no segment reaches is plain causal
        extra["window_size"] = (window - 1, 0)  # (left, right): keys in [i - left, i]
    if torch.are_deterministic_algorithms_enabled():
        extra["deterministic"] = True
    out = module.flash_attn_varlen_func(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=scale, causal=True, **extra)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0.0b36
