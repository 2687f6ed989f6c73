"""What every kernel file shares: when the Triton path may run, launch arithmetic, autocast at a fused node's door.

Triton is imported lazily, only when a kernel is first used on a tensor it can
run on, so CPU-only installs never need it. ``TRITON_INTERPRET=1`` lets the
kernels run on CPU tensors through Triton's interpreter (slow; for tests and
debugging without a GPU). When Triton runs is :mod:`entrenar.device`'s answer (NF4's kernel in
:mod:`entrenar.quant.nf4`, below the kernels, asks too); it is re-exported here for the kernel files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from entrenar.device import interpreting, triton_available, use_triton

if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    Ts = TypeVarTuple("Ts")
R = TypeVar("R")

__all__ = ["autocast_dtype", "autocast_inputs", "call_op", "cdiv", "interpreting", "next_power_of_2",
           "triton_available", "use_triton"]


def next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts to on ``t``'s device, or None where it is off."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def autocast_inputs(*tensors: Unpack[Ts]) -> tuple[tuple[Unpack[Ts]], contextlib.AbstractContextManager]:
    """Do at the door of a hand-written autograd path what autocast would do inside it.

    Under autocast, floating inputs are cast to its dtype and the path runs
    with autocast off, so its own products see one dtype (autocast does not
    reach in-place ops or ``out=`` arguments). Elsewhere the inputs pass as they are, and so do arguments
    that are not tensors (None, an NF4 weight: quantized weights are dequantized to the input's dtype).
    """
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    dtype = None if first is None else autocast_dtype(first)
    if dtype is None:
        return tensors, contextlib.nullcontext()
    assert first is not None  # it gave the dtype
    castable = (torch.float32, torch.float16, torch.bfloat16)  # as autocast: float64 stays float64
    casted = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in castable else t for t in tensors)
    # A tensor comes out a tensor, anything else as it went in.
    return cast("tuple[Unpack[Ts]]", casted), torch.autocast(first.device.type, enabled=False)


def call_op(op: Callable[..., Any], impl: Callable[..., R], *args: object) -> R:
    """``op(*args)``, a registered custom op, where something must see it as one op: under ``torch.compile``,
    or when autograd records the call (grad mode on and an input requiring grad). Elsewhere ``impl(*args)``,
    the op's own implementation, directly: the dispatcher's Python layers around a custom op cost host time
    on every call, and the fused nodes make hundreds of such calls a step with autograd off.

    Not for the backward of an op's ``register_autograd``: torch.compile traces that outside dynamo, where
    ``is_compiling()`` is False, so it must call the op itself. The backward of a ``torch.autograd.Function``
    is traced by dynamo and may use this.
    """
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    ):
        return op(*args)
    return impl(*args)
