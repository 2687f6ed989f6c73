"""Context parallelism: one padding-free row split over ``cp`` processes, attention by all-to-all (Ulysses).

Each rank of a context-parallel group holds a contiguous slice of the row's tokens (the row padded with a
filler document to a multiple of ``cp``) through every layer. Before attention an all-to-all turns the
sequence-sharded q, k, v ``[B, H, N / cp, D]`` into head-sharded full-sequence ones ``[B, H / cp, N, D]``;
attention runs on them with the row's whole ``cu_seqlens`` through
:func:`entrenar.models.padding_free.documents_attention` (the variable-length kernel on CUDA, any of its
fallbacks elsewhere: sliding windows, soft-capping, sinks and MLA's narrower values included), and a second
all-to-all turns its output back into the slice's tokens with every head. Each all-to-all's backward is the
inverse all-to-all, so gradients reach the ranks whose tokens made the keys and values.

Why this scheme rather than ring attention: the all-to-all is indifferent to where documents start and end,
so the packing's documents may cross slice boundaries freely and any attention kernel that takes
``cu_seqlens`` serves; PyTorch's ``context_parallel`` (torch 2.13,
``torch.distributed.tensor.experimental``) rings SDPA's flash/efficient/cuDNN kernels over one causal sequence
(or flex_attention with a block mask) and takes no ``cu_seqlens``. The cost: the query heads, and the key/value
heads (or, where they do not divide, copies of them), must divide by ``cp``; each layer's two
all-to-alls (q, k and v together, then the output) move ``(2 + 2 x kv_heads / heads) x N x hidden / cp`` values a
rank forward, as many backward, on NVLink within a host.

The rest of the step needs no change of formula: RoPE reads each token's own position (positions travel with
the slice), the labels of a slice are those of its tokens plus the next slice's first (so the loss of the
slice's last token is counted where its hidden state is), every rank's summed loss is divided by the step's
global target count over ``world.size`` as under plain data parallelism, and DDP or FSDP2 over the whole world
average the gradients of replicated parameters: each cp rank's gradient is its tokens' share, so the average
over ``dp x cp`` ranks times ``world.size`` is the sum over the cp group and the mean over data-parallel
groups. The ranks of a cp group read the same micro-batches (:class:`DataWorld`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.distributed.parallelize import Single
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.models.config import ModelConfig
from entrenar.models.padding_free import sharded_sequence

Batch = dict[str, Any]


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (one chunk per rank of ``group``); its gradient is the same exchange backwards."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too: the exchange reads and writes flat memory
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` [cp, ...] exchanged over ``group``: chunk j goes to rank j, rank j's chunk for this rank comes back."""
    return _AllToAll.apply(x, group)


class Ulysses:
    """The all-to-alls of one context-parallel group around attention (what a sharded
    :class:`~entrenar.models.padding_free.Documents` carries)."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def to_heads(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``[B, H, N / cp, D]`` (this slice's tokens, every head) -> ``[B, H / cp, N, D]`` (this rank's
        heads), in one exchange when they share a head size (q, k and v: one all-to-all, not three)."""
        if len({x.shape[-1] for x in xs}) > 1:  # MLA's narrower values
            return tuple(y for x in xs for y in self.to_heads(x))
        b, _, t, d = xs[0].shape
        parts = [x.reshape(b, self.size, x.shape[1] // self.size, t, d) for x in xs]
        sizes = [part.shape[2] for part in parts]
        chunks = torch.cat(parts, dim=2).transpose(0, 1)  # [cp, B, heads / cp, t, D]
        out = all_to_all(chunks, self.group)  # chunk j: rank j's tokens of this rank's heads
        whole = out.permute(1, 2, 0, 3, 4).reshape(b, sum(sizes), self.size * t, d)
        return tuple(whole.split(sizes, dim=1))

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, N, H / cp, D]`` (this rank's heads, every token) -> ``[B, N / cp, H, D]`` (this slice's tokens)."""
        b, n, h, d = y.shape
        t = n // self.size
        chunks = y.reshape(b, self.size, t, h, d).transpose(0, 1)  # [cp, B, t, H / cp, D]
        out = all_to_all(chunks, self.group)  # chunk j: rank j's heads of this rank's tokens
        return out.permute(1, 2, 0, 3, 4).reshape(b, t, self.size * h, d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``attention(q, k, v, sinks)`` over the whole sequence on this rank's heads; q ``[B, Hq, N / cp, D]``,
        k/v ``[B, Hk, N / cp, D]`` -> ``[B, N / cp, Hq, Dv]``. Key/value heads that do not divide by ``cp`` are
        repeated first, as few times as makes them divide (each query head keeps its key/value head)."""
        hq, hk = q.shape[1], k.shape[1]
        copies = kv_copies(hq, hk, self.size)
        if copies > 1:
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        if sinks is not None:  # one learned logit per query head: this rank's heads'
            local = hq // self.size
            sinks = sinks[self.rank * local:(self.rank + 1) * local]
        q, k, v = self.to_heads(q, k, v)
        return self.to_sequence(attention(q, k, v, sinks))


def kv_copies(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that ``cp`` divides their count (1: it already does);
    the copies still divide the query heads, so each query keeps its own key/value head."""
    for copies in range(1, heads // kv_heads + 1):
        if (kv_heads * copies) % cp == 0 and heads % (kv_heads * copies) == 0:
            return copies
    raise ConfigError(f"{kv_heads} key/value heads cannot be split over {cp} ranks")


@dataclass(frozen=True)
class DataWorld(World):
    """The data-parallel view of a context-parallel world: ``rank`` and ``size`` count cp groups (each group
    reads the same micro-batches), and :meth:`all_sum` adds over one rank of each group, so a step's target and
    token counts count every row once."""

    group: Any = None  # the data-parallel process group (this rank's peers at the same cp position)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed and self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor


def shard_row(batch: Batch, cp: int, rank: int) -> Batch:
    """This rank's slice of a padding-free micro-batch (:func:`entrenar.data.padding_free`'s ``[1, N]`` row).

    The row is padded to a multiple of ``cp`` with a filler document (its labels -100), so the slices are equal;
    ``cu_seqlens`` and ``max_seqlen`` stay the whole row's (attention runs over all of it). Every ``[1, N]``
    tensor is cut to ``[1, N / cp]`` except the labels, which get one more column, the next slice's first label
    (-100 after the last slice): position ``i`` predicts label ``i + 1``, and the slice's last token predicts
    the next slice's first.
    """
    ids = batch["input_ids"]
    if ids.shape[0] != 1 or "cu_seqlens" not in batch:
        raise ConfigError("training.context_parallel needs padding-free rows ([1, N] with cu_seqlens)")
    n = ids.shape[1]
    size = -(-n // cp)
    pad = size * cp - n
    out: Batch = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.shape != ids.shape:
            out[key] = value
            continue
        if pad:
            filler = torch.arange(pad) if key == "position_ids" else \
                torch.full((pad,), IGNORE_INDEX if key == "labels" else 0)
            value = torch.cat([value, filler.to(value)[None]], dim=1)
        if key == "labels":
            value = torch.cat([value, value.new_full((1, 1), IGNORE_INDEX)], dim=1)
            out[key] = value[:, rank * size:(rank + 1) * size + 1]
        else:
            out[key] = value[:, rank * size:(rank + 1) * size]
    if pad:
        cu = batch["cu_seqlens"]
        out["cu_seqlens"] = torch.cat([cu, cu.new_tensor([n + pad])])
        out["max_seqlen"] = max(int(batch["max_seqlen"]), pad)
    return out


class ContextParallel(Single):
    """The step model of a context-parallel run: ``inner`` (the model, or its DDP/FSDP wrapper) run on this
    rank's slice under the group's all-to-all attention. Outputs get one zero position more, so the loss's
    shift pairs the slice's last token with the next slice's first label (:func:`shard_row`)."""

    def __init__(self, inner: Single, ulysses: Ulysses, data_world: DataWorld) -> None:
        super().__init__(inner.model)
        self.inner, self.ulysses, self.data_world = inner, ulysses, data_world
        self.mode = inner.mode

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with sharded_sequence(self.ulysses):
            return _one_more(self.inner(*args, **kwargs))

    def hidden_states(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with sharded_sequence(self.ulysses):
            return _one_more(self.inner.hidden_states(*args, **kwargs))

    def sync(self, last: bool) -> AbstractContextManager:
        return self.inner.sync(last)

    def carry(self, values: torch.Tensor) -> torch.Tensor | None:
        return self.inner.carry(values)

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of a padding-free micro-batch (:func:`shard_row`)."""
        return shard_row(batch, self.ulysses.size, self.ulysses.rank)


def _one_more(out: torch.Tensor) -> torch.Tensor:
    return torch.cat([out, out.new_zeros(out.shape[0], 1, *out.shape[2:])], dim=1)


def context_parallel(inner: Single, world: World, cp: int, device: torch.device) -> ContextParallel:
    """``inner`` split over context-parallel groups of ``cp`` consecutive ranks (a ``dp x cp`` device mesh:
    the ranks of one host's GPUs form a group when ``cp`` divides the processes per host)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world.size // cp, cp), mesh_dim_names=("dp", "cp"))
    ulysses = Ulysses(mesh.get_group("cp"), cp, world.rank % cp)
    data_world = DataWorld(rank=world.rank // cp, size=world.size // cp, local_rank=world.local_rank,
                           backend=world.backend, group=mesh.get_group("dp"))
    return ContextParallel(inner, ulysses, data_world)


def check_context_parallel(cp: int, world: World, config: ModelConfig, task: str, padding_free: str | bool,
                           moe: bool, compile: bool = False, cuda_graphs: bool = False) -> str:
    """Refuse what context parallelism cannot split this way (one ConfigError naming the key); the line the plan
    prints for ``training.context_parallel``."""
    key = "training.context_parallel"
    if world.size % cp:
        raise ConfigError(f"{key}: {cp} does not divide the {world.size} process(es) of this run; start a "
                          f"multiple of {cp} (entrenar train --nproc-per-node)")
    if task != "causal_lm":
        raise ConfigError(f"{key}: splits causal-LM rows only; this run's task is {task}")
    if padding_free is False:
        raise ConfigError(f"{key}: splits padding-free rows; data.padding_free is false (set it to auto or true)")
    if compile:
        raise ConfigError(f"{key}: the all-to-all around attention runs eagerly; training.compile with context "
                          "parallelism is not supported (turn one off)")
    if cuda_graphs:
        raise ConfigError(f"{key}: a CUDA graph replays one row length, and split padding-free rows vary; "
                          "training.cuda_graphs: true is not supported with it (auto turns graphs off)")
    if moe:
        raise ConfigError(f"{key}: MoE layers balance their routers over the tokens of a step, which a split "
                          "row would count per slice; not supported")
    rope = (config.rope_scaling or {}).get("rope_type")
    if rope in ("dynamic", "longrope"):
        raise ConfigError(f"{key}: {rope} RoPE scaling picks its frequencies from the row's longest position, "
                          "which a slice does not see; not supported")
    heads, kv = config.num_heads, config.num_kv_heads
    if heads % cp:
        raise ConfigError(f"{key}: the model's {heads} attention heads do not divide over {cp} ranks (the "
                          "all-to-all gives each rank heads / context_parallel of them)")
    copies = kv_copies(heads, kv, cp) if not config.is_mla else 1
    kv_note = f", key/value heads x{copies}" if copies > 1 else ""
    return (f"{cp} ranks per sequence (Ulysses all-to-all: {heads // cp} query heads a rank{kv_note}); "
            f"{world.size // cp} data-parallel group(s); activations per rank / {cp}")


def describe(mode: str, world: World, cp: int, batch_size: int, accumulation: int, seq_len: int) -> str:
    """The line a context-parallel run prints at its start (:func:`entrenar.distributed.steps.describe`'s)."""
    groups = world.size // cp
    rows = batch_size * accumulation * groups
    return (f"{mode} on {world.size} processes ({world.backend}), each row split over {cp} of them: global batch "
            f"{rows} rows = {batch_size} per group x {accumulation} accumulation x {groups} data-parallel group(s) "
            f"(up to {rows * seq_len:,} tokens a step, {-(-batch_size * seq_len // cp):,} a process)")


__all__ = ["ContextParallel", "DataWorld", "Ulysses", "check_context_parallel", "context_parallel", "kv_copies",
           "shard_row"]
