"""The MLP half of a decoder block run in tiles of tokens ("tiled MLP"), for long sequences.

At long context the MLP is what a layer holds most of: gate and up (and, eager, their product) are
``intermediate_size`` wide, three to four times the hidden size, for every token. :func:`tiled_feed_forward` runs
``fn`` (the MLP half of one block: the MLP and the norms around it, :meth:`Block.feed_forward_modules
<entrenar.models.transformer.Block.feed_forward_modules>`) on ``tile`` tokens at a time under ``no_grad`` and
keeps only its input for backward; backward runs each tile's forward again with gradients on and backpropagates
through it, so no more than one tile's intermediates exist at once, forward or backward. The price is one more
forward of the MLP (about a third of a LoRA block's matrix products); the saving is the MLP's saved activations,
which become one ``[T, hidden]`` input, and its backward transients, which become one tile's.

The parameters' gradients come back through autograd as outputs of the node (summed over tiles), so gradient
hooks (DDP, FSDP) see them as usual. The autocast state of the forward is restored for backward's recomputation,
and so is the random-number state where ``fn`` draws random numbers (LoRA dropout), as
:func:`torch.utils.checkpoint.checkpoint` does; an ``fn`` that draws none (``random=False``) touches no generator,
so nothing is read back from the device and a CUDA graph can capture the step.

Inside a checkpointed layer's rerun (:func:`entrenar.models.recompute.recomputing`) the node only saves its input
again: its output is thrown away there, so the tiles are not run at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from entrenar.models.recompute import recomputing


def draws_random(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether running ``modules`` in training draws random numbers: a dropout with a non-zero rate (LoRA's) in
    training mode among them or their children."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
               for module in modules for m in module.modules())


def _rng_devices(x: torch.Tensor) -> list[int]:
    return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []


class _TiledFeedForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], tile: int, random: bool, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        ctx.fn, ctx.tile, ctx.params, ctx.random = fn, tile, params, random
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        if random:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in _rng_devices(x)]
        ctx.save_for_backward(x)
        if recomputing():  # a checkpointed layer's rerun: only the saved input matters
            return torch.empty_like(x)
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor | None = None
        for start in range(0, flat.shape[0], tile):
            y = fn(flat[start:start + tile])
            if out is None:
                out = y.new_empty((flat.shape[0], y.shape[-1]))
            out[start:start + tile] = y
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        need_x = ctx.needs_input_grad[3]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[4:], strict=True) if need]
        flat = x.detach().reshape(-1, x.shape[-1])
        grad = grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if need_x else None
        dparams: list[torch.Tensor | None] = [None] * len(wanted)
        device, enabled, dtype = ctx.autocast
        devices = _rng_devices(x)
        with torch.random.fork_rng(devices=devices, enabled=ctx.random):
            if ctx.random:
                torch.set_rng_state(ctx.cpu_rng)
                for d, state in zip(devices, ctx.cuda_rng, strict=True):
                    torch.cuda.set_rng_state(state, d)
            for start in range(0, flat.shape[0], ctx.tile):
                piece = flat[start:start + ctx.tile].detach().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    y = ctx.fn(piece)
                inputs = ([piece] if need_x else []) + wanted
                if not inputs:
                    break
                grads = torch.autograd.grad(y, inputs, grad[start:start + ctx.tile], allow_unused=True)
                if need_x:
                    assert dx is not None
                    dx[start:start + ctx.tile] = grads[0]
                    grads = grads[1:]
                for j, g in enumerate(grads):
                    so_far = dparams[j]
                    if g is not None:
                        dparams[j] = g if so_far is None else so_far.add_(g)
        out_params: list[torch.Tensor | None] = []
        it = iter(dparams)
        for need in ctx.needs_input_grad[4:]:
            out_params.append(next(it) if need else None)
        return None, None, None, dx.view_as(x) if dx is not None else None, *out_params


def tiled_feed_forward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int,
                       params: Sequence[torch.Tensor], random: bool = True) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` (``[N, hidden] -> [N, out]``), run ``tile`` tokens at a time and rerun
    tile by tile in backward (module docstring). ``params``: every tensor ``fn`` reads that may need a gradient
    (those that do not are skipped). ``random``: whether ``fn`` draws random numbers (its rerun then replays the
    forward's). Outside autograd (no tensor needs a gradient), the plain call."""
    trained = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or trained):
        return fn(x)
    return _TiledFeedForward.apply(fn, tile, random, x, *trained)
