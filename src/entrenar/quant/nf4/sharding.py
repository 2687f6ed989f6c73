"""A QLoRA base sharded over the ranks of an FSDP run: each rank keeps 1/world of every NF4 layer's codes and scales.

FSDP2 shards parameters; an NF4 layer's packed codes and block scales are uint8/fp32 buffers that no gradient
touches, which ``fully_shard`` would leave whole on every rank. :func:`shard_nf4_layers` replaces each
:class:`~entrenar.quant.nf4.format.NF4Linear`, from outside, by a :class:`ShardedNF4Linear` holding this rank's
contiguous chunk of each flat buffer (codes, absmax, absmax scales; the scalar offset is replicated), and
:func:`scatter_nf4` sends every rank its chunks from rank 0 once the model is sharded. The forward all-gathers a
layer's chunks and dequantizes them exactly as NF4Linear does; backward gathers again rather than keeping the
weight (as NF4Linear rebuilds it rather than saving it), so a layer's whole codes exist only while it computes.

Compared with torchao's NF4Tensor under FSDP2 (whose codes FSDP gathers through tensor-subclass hooks), the
gathers here are the layer's own: synchronous, one projection at a time, in the run's default process group,
not prefetched by FSDP, so they do not overlap compute. The base is frozen: nothing of it is saved in
checkpoints (a resumed run quantizes it again from ``model.path``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from entrenar.errors import ConfigError
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
        """The whole quantized weight, gathered from every rank (a collective)."""
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
