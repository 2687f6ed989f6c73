"""Activation checkpointing of one layer, and a flag that tells the layer when it is being rerun.

A checkpointed layer runs its forward twice: once without keeping its
activations, and again in backward to rebuild what backward reads. The rerun's
output is thrown away (non-reentrant :func:`torch.utils.checkpoint.checkpoint`
even stops it as soon as everything backward needs has been saved again), so
work whose only use is the layer's output can be skipped during it. The
largest such work in a decoder block is its last product, the MLP's down
projection (about a quarter of the block's matrix-product FLOPs on Llama shapes): its backward needs
its inputs (gate and up), never its output, nor even ``silu(gate) * up``,
which it rebuilds. :func:`recomputing` is True during a rerun; the fused block
(:class:`entrenar.kernels.norm_projections.FusedBlock`) reads it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

# Per thread: the rerun runs on the thread that enters its context (autograd's device thread for a GPU), and
# two models training in two threads must not see each other's reruns.
_state = threading.local()


def recomputing() -> bool:
    """True while a layer checkpointed by :func:`checkpointed` reruns its forward for backward, in eager mode.

    Under ``torch.compile`` this is always False (and not guarded on): the compiler decides itself what a
    traced rerun computes.
    """
    return not torch.compiler.is_compiling() and getattr(_state, "rerunning", False)


@contextlib.contextmanager
def _rerun() -> Iterator[None]:
    before, _state.rerunning = getattr(_state, "rerunning", False), True
    try:
        yield
    finally:
        _state.rerunning = before


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _rerun()


def checkpointed(layer: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``layer(*args)`` under non-reentrant activation checkpointing, with :func:`recomputing` set in the rerun."""
    if torch.compiler.is_compiling():  # traced: the plain call (dynamo takes no context_fn of ours)
        return checkpoint(layer, *args, use_reentrant=False)
    return checkpoint(layer, *args, use_reentrant=False, context_fn=_contexts)
