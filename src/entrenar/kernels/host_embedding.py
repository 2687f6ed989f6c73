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
"""

from __future__ import annotations

import functools
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


def offload_embeddings(model: nn.Module) -> int:
    """Move ``model.model.embed_tokens``' table to pinned CPU memory, read from there by the GPU; return the
    bytes of GPU memory freed.

    The table must be frozen (LoRA, QLoRA) and not shared with the output
    head, which needs it on the GPU for its products; the model must be on a
    GPU with Triton. ``model.to(device)`` later brings the table back (the
    layer then reads it as a plain embedding).
    """
    embedding = cast(nn.Module, cast(nn.Module, model.model).embed_tokens)
    weight = cast(torch.Tensor, embedding.weight)
    name = "model.embed_tokens.weight"
    if type(embedding) not in (nn.Embedding, HostEmbedding):
        raise ConfigError(f"{name}: the input embeddings are a {type(embedding).__name__}, not an nn.Embedding")
    if weight.requires_grad:
        raise ConfigError(f"{name}: the input embeddings are trained in this run; only a frozen table can stay in "
                          "CPU memory")
    sharing = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight and n != name]
    if sharing:
        raise ConfigError(f"{name}: the input embeddings are tied to {sharing[0]}, whose products need them on the "
                          "GPU")
    if not weight.is_cuda:
        raise ConfigError(f"{name}: the input embeddings are on {weight.device}; offloading moves them off a GPU")
    if not triton_available():
        raise ConfigError(f"{name}: reading the table from CPU memory needs Triton, which does not import here")
    freed = weight.numel() * weight.element_size()
    with torch.no_grad():
        embedding.weight = nn.Parameter(weight.detach().to("cpu").pin_memory(), requires_grad=False)
    embedding.__class__ = HostEmbedding
    return freed
