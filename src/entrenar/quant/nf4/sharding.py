"""A QLoRA base sharded over the ranks of an FSDP run: each rank keeps 1/world of every NF4 layer's codes and scales.

FSDP2 shards parameters; an NF4 layer's packed codes and block scales are uint8/fp32 buffers that no gradient
touches, which ``fully_shard`` would leave whole on every rank. :func:`shard_nf4_layers` replaces each
:class:`~entrenar.quant.nf4.format.NF4Linear`, from outside, by a :class:`ShardedNF4Linear` holding this rank's
contiguous chunk of each flat buffer (codes, absmax, absmax scales; the scalar offset is replicated), and
:func:`scatter_nf4` sends every rank its chunks from rank 0 once the model is sharded. The forward all-gathers a
layer's chunks and dequantizes them exactly as NF4Linear does; backward gathers again rather than keeping the
weight (as NF4Linear rebuilds it rather than saving it), so a layer's whole codes exist only while it computes.

Compared with torchao's NF4Tensor under FSDP2 (whose codes FSDP gathers through tensor-subclass hooks), the
gathers here are the layers' own, in the run's default process group. Alone, a layer gathers synchronously when
it computes; with :func:`prefetch_nf4` (``training.fsdp_prefetch``, the default) each decoder block's layers are
gathered together in one asynchronous collective (:class:`BlockGather`) issued while the block before computes,
forward and backward, as FSDP2's prefetch does for parameters. The base is frozen: nothing of it is saved in
checkpoints (a resumed run quantizes it again from ``model.path``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from entrenar.errors import ConfigError
from entrenar.models.recompute import recomputing
from entrenar.models.surgery import replace_module
from entrenar.quant.nf4.experts import NF4Experts
from entrenar.quant.nf4.format import NF4Linear, NF4Tensor, dequantize_nf4

if TYPE_CHECKING:  # a type only: quant sits below distributed
    from entrenar.distributed.world import World

_CHUNKED = ("weight_codes", "weight_absmax", "weight_absmax_scale")
_OFFSET = "weight_absmax_offset"


class _ShardedNF4Fn(torch.autograd.Function):
    """``x @ W.T + b`` with W gathered from the ranks and dequantized, in forward and again in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, layer: ShardedNF4Linear) -> Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return F.linear(x, dequantize_nf4(layer.quantized, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:  # the same on every rank (one graph), so every rank gathers alike
            grad_x = grad_out @ dequantize_nf4(ctx.layer.quantized, grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None


class ShardedNF4Linear(nn.Module):
    """An :class:`NF4Linear` whose flat buffers hold this rank's chunk (padded to ``ceil(n / world)``).

    The buffers are not persistent: a state dict (checkpoints, outputs) holds no part of the frozen base.
    """

    linear_like = True
    holds_shards = True  # its buffers differ by rank: never broadcast them
    block_gather: BlockGather | None = None  # its block's prefetched gather (prefetch_nf4), else its own gathers

    def __init__(self, layer: NF4Linear, world: World) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.dtype, self.blocksize, self.world = layer.dtype, layer.blocksize, world
        self.lengths: dict[str, int] = {}
        for name in _CHUNKED + (_OFFSET,):
            full = getattr(layer, name)
            if full is None:
                self.register_buffer(name, None, persistent=False)
                continue
            size = () if name == _OFFSET else (-(-full.numel() // world.size),)
            self.lengths[name] = full.numel()
            self.register_buffer(name, torch.zeros(size, dtype=full.dtype, device=full.device), persistent=False)
        self.bias = layer.bias  # frozen; fully_shard shards it with the block

    def _apply(self, fn, recurse=True):
        scales = {k: self._buffers.get(k) for k in ("weight_absmax", "weight_absmax_scale", _OFFSET)}
        super()._apply(fn, recurse)
        for k, old in scales.items():
            if old is not None and old.is_floating_point():
                self._buffers[k] = self._buffers[k].to(old.dtype)  # device moves, never dtype casts (the format)
        return self

    def _gathered(self, name: str) -> Tensor | None:
        local = getattr(self, name)
        if local is None:
            return None
        parts = [torch.empty_like(local) for _ in range(self.world.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts)[: self.lengths[name]]

    @property
    def quantized(self) -> NF4Tensor:
        """The whole quantized weight, gathered from every rank (a collective; its block's prefetched one when
        :func:`prefetch_nf4` scheduled it)."""
        if self.block_gather is not None:
            return self.block_gather.quantized(self)
        codes, absmax = self._gathered("weight_codes"), self._gathered("weight_absmax")
        assert codes is not None and absmax is not None  # only the double-quant scale may be None
        return NF4Tensor(codes, absmax, self._gathered("weight_absmax_scale"), getattr(self, _OFFSET),
                         torch.Size((self.out_features, self.in_features)), self.dtype, self.blocksize)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (a collective)."""
        return dequantize_nf4(self.quantized)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _ShardedNF4Fn.apply(x, bias, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocksize={self.blocksize}, sharded over {self.world.size} ranks")


def shard_nf4_layers(model: nn.Module, world: World) -> list[tuple[ShardedNF4Linear, dict[str, Tensor]]]:
    """Replace every NF4Linear of ``model`` by a ShardedNF4Linear (chunks not yet filled); with each, rank 0's
    whole buffers for :func:`scatter_nf4` (empty on the other ranks)."""
    experts = next((name for name, m in model.named_modules() if isinstance(m, NF4Experts)), None)
    if experts is not None:
        # Each rank runs only the experts its tokens are routed to: their gathers would not match across ranks.
        raise ConfigError(f"training.parallel: fsdp does not shard the NF4 experts of a mixture-of-experts model "
                          f"({experts}): ranks run different experts, so their gathers would not match; use "
                          "training.parallel: ddp (each rank holding the 4-bit base)")
    layers = []
    for name, module in list(model.named_modules()):
        if type(module) is NF4Linear:
            sharded = ShardedNF4Linear(module, world)
            replace_module(model, name, sharded)
            full = {k: getattr(module, k) for k in sharded.lengths} if world.is_main else {}
            layers.append((sharded, full))
    return layers


@torch.no_grad()
def scatter_nf4(layers: list[tuple[ShardedNF4Linear, dict[str, Tensor]]], world: World,
                device: torch.device) -> None:
    """Give every rank its chunks of rank 0's NF4 buffers (one layer at a time), after ``fully_shard``."""
    for layer, full in layers:
        for name in layer.lengths:
            local = getattr(layer, name)
            if name == _OFFSET:
                if world.is_main:
                    local.copy_(full[name])
                dist.broadcast(local, src=0)
                continue
            chunks = None
            if world.is_main:
                padded = torch.zeros(local.numel() * world.size, dtype=local.dtype, device=device)
                padded[: full[name].numel()] = full[name].reshape(-1).to(device)
                chunks = list(padded.chunk(world.size))
            dist.scatter(local, chunks, src=0)
        full.clear()  # rank 0: the whole codes go once every rank holds its chunk


class BlockGather:
    """One decoder block's NF4 chunks gathered in one asynchronous collective, so it can be issued ahead.

    Every :class:`ShardedNF4Linear` of the block (codes, absmax, absmax scales: each viewed as bytes) is packed
    into one flat byte buffer per rank and all-gathered at once (``all_gather_into_tensor``, ``async_op``):
    one collective per block instead of three per projection, and it runs on the communication stream while
    the compute stream works on the block before. :meth:`quantized` waits for it (the first access only) and
    gives each layer its whole :class:`NF4Tensor`, the same bytes the per-layer gather gives.
    """

    def __init__(self, layers: list[ShardedNF4Linear], world: World) -> None:
        self.layers, self.world = layers, world
        self._work: object | None = None
        self._sent: Tensor | None = None
        self._out: Tensor | None = None
        self._whole: dict[int, NF4Tensor] | None = None

    def start(self) -> None:
        """Issue the gather unless it is issued or done (every rank calls this at the same points)."""
        if self._work is not None or self._whole is not None:
            return
        parts = [getattr(layer, name).reshape(-1).view(torch.uint8) for layer in self.layers
                 for name in _CHUNKED if getattr(layer, name) is not None]
        self._sent = torch.cat(parts)
        self._out = self._sent.new_empty(self._sent.numel() * self.world.size)
        self._work = dist.all_gather_into_tensor(self._out, self._sent, async_op=True)

    def quantized(self, layer: ShardedNF4Linear) -> NF4Tensor:
        """``layer``'s whole quantized weight (waits for the gather, issuing it first if nobody did)."""
        if self._whole is None:
            self.start()
            assert self._work is not None and self._out is not None
            self._work.wait()  # type: ignore[attr-defined]  # a torch Work
            self._whole = self._unpack(self._out.view(self.world.size, -1))
            self._work = self._sent = self._out = None
        return self._whole[id(layer)]

    def _unpack(self, rows: Tensor) -> dict[int, NF4Tensor]:
        whole, at = {}, 0
        for layer in self.layers:
            full: dict[str, Tensor | None] = {}
            for name in _CHUNKED:
                local = getattr(layer, name)
                if local is None:
                    full[name] = None
                    continue
                n = local.numel() * local.element_size()
                gathered = rows[:, at: at + n].contiguous().view(local.dtype).reshape(-1)
                full[name] = gathered[: layer.lengths[name]]
                at += n
            codes, absmax = full["weight_codes"], full["weight_absmax"]
            assert codes is not None and absmax is not None
            whole[id(layer)] = NF4Tensor(codes, absmax, full["weight_absmax_scale"], getattr(layer, _OFFSET),
                                         torch.Size((layer.out_features, layer.in_features)), layer.dtype,
                                         layer.blocksize)
        return whole

    def release(self) -> None:
        """Drop the gathered codes (an issued, unfinished gather is kept: every rank waits for it later)."""
        self._whole = None


def prefetch_nf4(blocks: list[nn.Module], world: World) -> list[BlockGather]:
    """Gather each block's sharded NF4 base as one collective issued one block ahead, forward and backward.

    Forward: entering block i issues block i's gather (if not yet issued) and block i + 1's, so the next block's
    codes travel while block i computes; leaving block i drops its codes (the last block's are kept: backward
    starts there). Backward: when block i's output gradient is ready (its backward begins), block i - 1's gather
    is issued and block i + 1's codes are dropped; the end of backward drops the rest. A checkpointed block's
    rerun in backward (:func:`entrenar.models.recompute.recomputing`) only reads its codes. Layers outside the
    blocks keep their own gathers. Returns each block's gather (None-free: blocks without NF4 layers are left out
    of the schedule).
    """
    gathers: list[BlockGather | None] = []
    for block in blocks:
        layers = [m for m in block.modules() if isinstance(m, ShardedNF4Linear)]
        gather = BlockGather(layers, world) if layers else None
        for layer in layers:
            layer.block_gather = gather
        gathers.append(gather)
    last = len(blocks) - 1

    def start(i: int) -> None:
        if 0 <= i <= last and gathers[i] is not None:
            gathers[i].start()  # type: ignore[union-attr]

    def release(i: int) -> None:
        if 0 <= i <= last and gathers[i] is not None:
            gathers[i].release()  # type: ignore[union-attr]

    def release_all() -> None:
        for i in range(last + 1):
            release(i)

    def backward_begins(i: int) -> None:
        if i == last:  # the first block backward reaches (if any block needs a gradient, the last one does)
            torch.autograd.Variable._execution_engine.queue_callback(release_all)
        start(i)
        start(i - 1)
        release(i + 1)

    def pre_forward(i: int):
        def hook(module: nn.Module, args: object) -> None:
            start(i)
            if not recomputing():
                start(i + 1)
        return hook

    def post_forward(i: int):
        def hook(module: nn.Module, args: object, output: object) -> None:
            if recomputing():
                return
            out = output[0] if isinstance(output, tuple) else output
            backward = torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad
            if isinstance(out, Tensor) and backward:
                out.register_hook(on_gradient(i))
            if not (backward and i == last):
                release(i)
        return hook

    def on_gradient(i: int):
        def hook(grad: Tensor) -> None:
            backward_begins(i)
        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(pre_forward(i))
        block.register_forward_hook(post_forward(i))
    return [g for g in gathers if g is not None]
