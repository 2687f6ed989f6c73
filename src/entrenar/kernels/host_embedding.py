"""Input embeddings whose frozen table stays in pinned CPU memory; the GPU gathers the rows it needs over PCIe.

In a LoRA or QLoRA run the input embedding table is frozen and only ever
read a row at a time, yet it is held whole on the GPU: [vocab, hidden], 1 GiB
at a Llama-3 8B shape (128k x 4096 in bf16), a sixth of a QLoRA model. Here
the table lives in page-locked CPU memory, which CUDA maps into the GPU's
address space, and a Triton kernel reads a batch's rows straight from it
(32 MiB for 4096 tokens at that shape, well under a millisecond over PCIe).
The read is a kernel in stream order like any other: no synchronisation with
the host, and it records in a CUDA graph. The GPU memory it frees is what
lets more layers keep their activations instead of recomputing them.

An id outside the table stops the kernel with a device-side assertion, as
``F.embedding`` does on a GPU; no row outside the table is read.

A table tied to the output head (Llama 3.2, Qwen3's small models, Gemma) is
also the head's weight, whose products read all of it: :class:`HostHead`
copies it to the GPU for each use, on a side stream ahead of the loss when the
caller asks (:func:`prefetch_head`), and lets the copy go once the loss and its
backward are done. The GPU then holds the table from the step's loss to the
head's backward, not through the decoder layers' backward, where a
checkpointed step peaks (1.25 GiB of Gemma-3-4B's 8.6 at its peak).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.errors import ConfigError
from entrenar.kernels._common import (
    call_op,
    cdiv,
    next_power_of_2,
    triton_available,
    use_triton,
)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit(debug=True)  # keeps the device_assert below (Triton drops asserts otherwise)
    def gather(TABLE, IDS, OUT, n_rows, width, row_stride, BLOCK: tl.constexpr):
        # One program per (id, block of columns).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        idx = tl.load(IDS + row).to(tl.int64)
        inside = (idx >= 0) & (idx < n_rows)
        tl.device_assert(inside, "embedding: token id outside the table")
        idx = tl.where(inside, idx, 0)
        mask = cols < width
        tl.store(OUT + row * width + cols, tl.load(TABLE + idx * row_stride + cols, mask=mask), mask=mask)

    return SimpleNamespace(gather=gather)


def _gather_impl(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), table.shape[1], dtype=table.dtype, device=ids.device)
    if flat.numel():
        block = min(next_power_of_2(table.shape[1]), 2048)
        _kernels().gather[(flat.numel(), cdiv(table.shape[1], block))](
            table, flat, out, table.shape[0], table.shape[1], table.stride(0), BLOCK=block, num_warps=4)
    return out.view(*ids.shape, table.shape[1])


_gather = torch.library.custom_op("entrenar::gather_rows", mutates_args=())(_gather_impl)


@_gather.register_fake
def _(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ids.new_empty(*ids.shape, table.shape[1], dtype=table.dtype)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` on ``ids``' device, for a ``table`` [rows, width] that no gradient flows to.

    ``table`` may be in pinned CPU memory while ``ids`` are on the GPU (the
    kernel reads it over PCIe); where the kernel cannot run, both must be on
    one device and this is ``F.embedding``.
    """
    if table.requires_grad:
        raise ConfigError("gather_rows reads a frozen table; this one requires grad")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ConfigError(f"gather_rows reads a [rows, width] table with contiguous rows, got shape "
                          f"{tuple(table.shape)} and strides {table.stride()}")
    if use_triton(ids):
        return call_op(_gather, _gather_impl, table, ids)
    return F.embedding(ids, table)


class HostEmbedding(nn.Embedding):
    """An :class:`nn.Embedding` whose frozen table may sit in pinned CPU memory while its ids are on the GPU
    (:func:`offload_embeddings`); same parameter, same state dict."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device == ids.device:
            return super().forward(ids)
        if weight.requires_grad or (weight.device.type == "cpu" and not weight.is_pinned()):
            raise ConfigError(
                f"embed_tokens.weight is on {weight.device} ({'trainable' if weight.requires_grad else 'not pinned'}) "
                f"and its ids on {ids.device}: the GPU reads only a frozen table in pinned CPU memory "
                "(call offload_embeddings(model) again after changing the table, or move the model to one device)")
        return gather_rows(weight, ids)


class HostHead(nn.Linear):
    """An output head whose weight is the tied embedding table in pinned CPU memory (:func:`offload_embeddings`):
    each use copies the table to the hidden states' device, the one :func:`prefetch_head` started if any, and keeps
    no copy after it. Same parameter (the embedding's), same state dict."""

    # (the copy, its copy's event, whether it was made while a CUDA graph was being captured)
    _prefetched: tuple[torch.Tensor, torch.cuda.Event, bool] | None = None

    def prefetch(self, device: torch.device) -> None:
        """Start copying the table to ``device`` on a side stream; the host does not wait, and :meth:`weight_on`
        makes the compute stream wait for the copy only where it reads it. Under CUDA graphs the copy is recorded
        with the step (the side stream forks from the compute stream and joins it where the table is read). A copy
        never read (an error, a failed capture) is dropped, never reused."""
        _forget(self._take())
        weight = self._host_table(device)
        if weight.device == device or device.type != "cuda":
            return
        compute = torch.cuda.current_stream(device)
        table = torch.empty(weight.shape, dtype=weight.dtype, device=device)  # memory of the compute stream
        copies = _copy_stream(device)
        copies.wait_stream(compute)  # past whatever last used that memory
        with torch.cuda.stream(copies):
            table.copy_(weight, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copies)
        self._prefetched = (table, ready, torch.cuda.is_current_stream_capturing())

    def weight_on(self, device: torch.device) -> torch.Tensor:
        """The table on ``device``: the prefetched copy made in the same mode (captured or not; the compute stream
        waits for it), else one copied now in stream order."""
        prefetched, weight = self._take(), self._host_table(device)
        if weight.device == device:
            _forget(prefetched)
            return weight
        if prefetched is not None:
            table, ready, captured = prefetched
            if table.device == device and captured == torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream(device).wait_event(ready)
                return table
            _forget(prefetched)
        return weight.to(device, non_blocking=True)

    def _take(self) -> tuple[torch.Tensor, torch.cuda.Event, bool] | None:
        prefetched, self._prefetched = self._prefetched, None
        return prefetched

    def _host_table(self, device: torch.device) -> torch.Tensor:
        """The weight, checked where a GPU is to copy it in: only pinned memory copies asynchronously (and under
        CUDA graphs at all)."""
        weight = self.weight
        if weight.device.type == "cpu" and device.type == "cuda" and not weight.is_pinned():
            raise ConfigError("lm_head.weight (the tied embedding table) is in CPU memory but not pinned: the GPU "
                              "copies it in asynchronously only from pinned memory (call offload_embeddings(model) "
                              "again, or move the model to one device)")
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_on(x.device), self.bias)


def _forget(prefetched: tuple[torch.Tensor, torch.cuda.Event, bool] | None) -> None:
    """Let go of a copy nobody read: the compute stream first waits for it where it ran (a captured one never
    ran), so its memory is not handed out again while the copy may still be writing it."""
    if prefetched is not None and not prefetched[2] and not torch.cuda.is_current_stream_capturing():
        table, ready, _ = prefetched
        torch.cuda.current_stream(table.device).wait_event(ready)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def is_plain_head(head: object) -> bool:
    """Whether ``head`` is an output head whose weight the chunked losses may read directly (:func:`head_weight`):
    an ``nn.Linear`` or a :class:`HostHead`, not a LoRA-wrapped or quantized one."""
    return type(head) in (nn.Linear, HostHead)


def plain_head(model: object) -> nn.Linear | None:
    """A model's output head when the chunked losses may read its weight directly (:func:`is_plain_head`: a plain
    ``nn.Linear`` or a tied table in CPU memory); None: a LoRA'd or quantized head, read through the model's
    logits."""
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) and is_plain_head(head) else None


def prefetch_head(head: nn.Module, device: torch.device) -> None:
    """Start bringing a :class:`HostHead`'s table to ``device`` (call before the forward whose loss reads it)."""
    if isinstance(head, HostHead):
        head.prefetch(device)


def head_weight(head: nn.Module, device: torch.device) -> torch.Tensor:
    """``head.weight`` on ``device``, copied in for a :class:`HostHead` (prefetched by :func:`prefetch_head`)."""
    return head.weight_on(device) if isinstance(head, HostHead) else cast(torch.Tensor, head.weight)


def offload_embeddings(model: nn.Module) -> int:
    """Move ``model.model.embed_tokens``' table to pinned CPU memory, read from there by the GPU; return the
    bytes of GPU memory freed.

    The table must be frozen (LoRA, QLoRA); tied to the output head, the head becomes a :class:`HostHead` that
    copies it in for its products. The model must be on a GPU with Triton. ``model.to(device)`` later brings
    the table back (the layers then read it as a plain embedding and head).
    """
    embedding = cast(nn.Module, cast(nn.Module, model.model).embed_tokens)
    weight = cast(torch.Tensor, embedding.weight)
    name = "model.embed_tokens.weight"
    if type(embedding) not in (nn.Embedding, HostEmbedding):
        raise ConfigError(f"{name}: the input embeddings are a {type(embedding).__name__}, not an nn.Embedding")
    if weight.requires_grad:
        raise ConfigError(f"{name}: the input embeddings are trained in this run; only a frozen table can stay in "
                          "CPU memory")
    head = plain_head(model)
    tied = head is not None and head.weight is weight
    sharing = [n for n, p in model.named_parameters(remove_duplicate=False)
               if p is weight and n != name and not (tied and n == "lm_head.weight")]
    if sharing:
        raise ConfigError(f"{name}: the input embeddings are tied to {sharing[0]}, whose products need them on the "
                          "GPU")
    if not weight.is_cuda:
        raise ConfigError(f"{name}: the input embeddings are on {weight.device}; offloading moves them off a GPU")
    if not triton_available():
        raise ConfigError(f"{name}: reading the table from CPU memory needs Triton, which does not import here")
    freed = weight.numel() * weight.element_size()
    move_table(model, lambda t: t.to("cpu").pin_memory())
    return freed


def move_table(model: nn.Module, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace the embedding table by ``place(table)`` (a frozen parameter) and read it through
    :class:`HostEmbedding`, and through :class:`HostHead` where the output head is tied to it (the tie kept: one
    parameter under both names). :func:`offload_embeddings` checks what may move; ``place`` pins it in CPU memory."""
    embedding = cast(nn.Module, cast(nn.Module, model.model).embed_tokens)
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, nn.Linear) and head.weight is embedding.weight
    with torch.no_grad():
        embedding.weight = nn.Parameter(place(cast(torch.Tensor, embedding.weight).detach()), requires_grad=False)
    embedding.__class__ = HostEmbedding
    if tied:
        assert isinstance(head, nn.Linear)
        head.weight = embedding.weight
        head.__class__ = HostHead
