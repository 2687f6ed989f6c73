"""Merging one tensor by row blocks: the elementwise methods in one pass, TIES / DARE / task arithmetic in two.

A block is a range of rows (the first dimension) of about :data:`BLOCK_ELEMENTS`
elements: its float32 copies stay in the CPU's caches, buffers are reused from
block to block (no fresh pages to fault in), and peak memory is a few blocks,
whatever the size of the tensor.

Linear and passthrough need nothing beyond the block. The task-arithmetic family
(task_arithmetic, ties, dare_linear, dare_ties) needs what is global to a tensor
first, so it reads its inputs twice:

- pass 1 finds each model's TIES magnitude cut exactly: a sample of rows brackets
  the k-th largest ``|delta|``; the pass counts the entries above the bracket and
  keeps those inside it, and the k-th largest is picked among them (a bracket that
  misses sends the tensor to the whole-tensor path). For DARE with a norm rescale it
  draws the random masks (stored as bits) and sums the norms before and after;
- pass 2 rebuilds each block's task vectors, applies the cut or the mask and the
  rescale, and combines them with :func:`entrenar.merge.methods.combine_task_vectors`.

Every step is elementwise or an exact reduction (norms by rows, see
:func:`~entrenar.merge.methods.norm_parts`), so the result has the same bits as
:func:`~entrenar.merge.methods.task_arithmetic_family` on the whole tensor; DARE's
masks are the same draws from the same per-tensor generator, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from entrenar.errors import ConfigError
from entrenar.merge import methods
from entrenar.merge.plan import PlannedTensor
from entrenar.merge.stream import Input

BLOCK_ELEMENTS = 1 << 20  # 4 MiB of float32 per block and input
SAMPLE_ELEMENTS = 1 << 18  # entries sampled to bracket a magnitude cut
STREAMED = ("linear", "passthrough", "task_arithmetic", "ties", "dare_linear", "dare_ties")


def row_spans(rows: int, cols: int, block_elements: int | None = None) -> list[tuple[int, int]]:
    """Row ranges of about ``block_elements`` (:data:`BLOCK_ELEMENTS`) each; never one row alone."""
    per = max(2, (block_elements or BLOCK_ELEMENTS) // max(cols, 1))
    spans = [(start, min(start + per, rows)) for start in range(0, rows, per)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] == 1:
        spans[-2:] = [(spans[-2][0], rows)]
    return spans


def widen(x: torch.Tensor, out: torch.Tensor, compute: torch.dtype | None) -> None:
    """``out`` (float32) = ``x`` as merge arithmetic sees it: rounded to ``compute`` when set, then float32."""
    if x.dtype == torch.bfloat16 and compute in (None, torch.bfloat16):
        _widen_bf16_bits(x.reshape(-1).view(torch.int16).numpy().view(np.uint16), out)
    elif compute is None or x.dtype == compute:
        out.copy_(x)
    else:
        out.copy_(x.to(compute))


def _widen_bf16_bits(bits: np.ndarray, out: torch.Tensor) -> None:
    """bfloat16 bit patterns into float32: a bfloat16 is the top half of a float32, so a shift is exact; it reads
    the (read-only, mapped) bytes in place."""
    np.left_shift(bits.reshape(-1), 16, out=out.reshape(-1).view(torch.int32).numpy().view(np.uint32), dtype=np.uint32)


class BlockReader:
    """Reads row blocks of input tensors into buffers reused from block to block, widened to float32.

    Each ``slot`` (a position among a tensor's inputs) has its own buffers, so two
    inputs never share one even when they are the same file.
    """

    def __init__(self, compute: torch.dtype | None) -> None:
        self.compute = compute
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def buffer(self, kind: str, slot: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        key = (kind, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype)
        return buf[:n]

    def rows(self, slot: int, model: Input, name: str, start: int, stop: int) -> torch.Tensor:
        info = model.tensors()[name]
        shape = (stop - start, *info.shape[1:])
        n = math.prod(shape)
        out = self.buffer("wide", slot, n, torch.float32).view(shape)
        stored = model.view_rows(name, start, stop)
        if stored is not None and info.dtype == torch.bfloat16 and self.compute in (None, torch.bfloat16):
            _widen_bf16_bits(stored.view(np.uint16), out)  # straight from the mapped file
            return out
        if stored is not None:
            raw = self.buffer("raw", slot, stored.size, torch.uint8)
            raw.numpy()[:] = stored
            x = raw.view(info.dtype).view(shape)
        else:
            x = model.read_rows(name, start, stop, self.buffer("raw", slot, n * info.dtype.itemsize, torch.uint8))
        widen(x, out, self.compute)
        return out

    def output(self, result: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``result`` rounded to ``dtype``, in a reused buffer (valid until the next call)."""
        if result.dtype == dtype:
            return result
        return self.buffer("out", 0, result.numel(), dtype).view(result.shape).copy_(result)


def streamable(pt: PlannedTensor, spec_name: str, inputs: dict[str, Input], aligning_vocab: bool,
               rescale: str | None, sparsifier: str | None) -> bool:
    """Whether ``pt`` is merged here: a float matrix of a streamed method, read from inputs that seek rows."""
    shape = pt.info.shape
    if spec_name not in STREAMED or len(shape) < 2 or shape[0] < 2 or not pt.info.dtype.is_floating_point:
        return False
    if (aligning_vocab and pt.vocab) or not pt.sources or (sparsifier == "magnitude" and rescale is not None):
        return False  # magnitude + rescale would need a third pass; it stays whole
    for ref, name in ([pt.base] if pt.base else []) + list(pt.sources):
        info = inputs[ref].tensors()[name]
        if not inputs[ref].reads_rows or not info.dtype.is_floating_point or tuple(info.shape) != tuple(shape):
            return False
    return True


def merge_blocks(pt: PlannedTensor, cfg, inputs: dict[str, Input],
                 reader: BlockReader) -> Iterator[torch.Tensor] | None:
    """``pt``'s output row blocks in its dtype, or None when this tensor must be merged whole (a missed bracket)."""
    shape = pt.info.shape
    spans = row_spans(shape[0], math.prod(shape[1:]))
    refs = ([pt.base] if pt.base else []) + list(pt.sources)

    def read(slot: int, start: int, stop: int) -> torch.Tensor:
        ref, name = refs[slot]
        return reader.rows(slot, inputs[ref], name, start, stop)

    spec = cfg.spec
    if spec.recipe is None:
        return _elementwise(pt, spec.name, spans, read, reader)
    tasks = _prepare(pt, cfg, spans, read)
    if tasks is None:
        return None
    consensus = pt.params.get("consensus_method") or spec.recipe.consensus
    return _task_blocks(pt, spans, read, reader, tasks, consensus)


def _elementwise(pt, name: str, spans, read, reader) -> Iterator[torch.Tensor]:
    p, mp = pt.params, pt.model_params
    first = 1 if pt.base else 0  # the slots of the sources (a base, if planned, is not merged by these methods)
    for start, stop in spans:
        xs = [read(first + i, start, stop) for i in range(len(pt.sources))]
        if name == "linear":
            result = methods.linear(xs, [m["weight"] for m in mp], normalize=bool(p["normalize"]))
        else:
            result = methods.passthrough(xs[0], mp[0].get("scale"))
        yield reader.output(result, pt.info.dtype)


@dataclass
class _Task:
    """One model's task vector: its weight and how it is sparsified (what pass 1 found)."""

    weight: float
    density: float
    sparsifier: str | None  # None (kept whole), "zero", "magnitude" or "random"
    rescale: str | None = None
    generator: torch.Generator | None = None
    k: int = 0  # magnitude: entries kept
    bracket: tuple[float, float] = (0.0, math.inf)
    above: int = 0  # entries above the bracket
    candidates: list[np.ndarray] = field(default_factory=list)
    threshold: float = 0.0  # the k-th largest |delta|
    ties: int = 0  # entries equal to the threshold still to keep, lowest index first
    masks: list[np.ndarray] = field(default_factory=list)  # random: packed keep bits per block (pass 1)
    before: list[np.ndarray] = field(default_factory=list)
    after: list[np.ndarray] = field(default_factory=list)
    scale: float | None = None

    @property
    def first_pass(self) -> bool:
        return self.sparsifier == "magnitude" or (
            self.sparsifier == "random" and self.rescale not in (None, "inverse_density"))


def _prepare(pt: PlannedTensor, cfg, spans, read) -> list[_Task] | None:
    """Pass 1: each model's magnitude cut or random masks and rescale; None if a bracket missed."""
    recipe = cfg.spec.recipe
    rescale = methods.rescale_norm(pt.params)
    n = math.prod(pt.info.shape)
    tasks = []
    for i, m in enumerate(pt.model_params):
        density = float(m["density"])
        if not 0 <= density <= 1:
            raise ConfigError(f"{cfg.source}: density must be in [0, 1], got {m['density']} (tensor {pt.name})")
        kind = recipe.sparsifier if density < 1 else None
        task = _Task(float(m["weight"]), density, kind, rescale)
        if cfg.spec.random:  # drawn for every model, as the whole-tensor path does
            task.generator = methods.tensor_generator(cfg.seed, pt.name, i)
        if kind == "magnitude":
            task.k = int(density * n)
            if task.k <= 0:
                task.sparsifier = "zero"
        tasks.append(task)
    if not any(t.first_pass for t in tasks):
        return tasks
    for i, task in enumerate(tasks):
        if task.sparsifier == "magnitude":
            task.bracket = _bracket(pt, read, i, task.k, n)
    for start, stop in spans:
        base = read(0, start, stop)
        for i, task in enumerate(tasks):
            if not task.first_pass:
                continue
            delta = read(1 + i, start, stop).sub_(base)
            if task.sparsifier == "magnitude":
                a = np.abs(delta.numpy())
                if np.isnan(a).any():
                    return None  # NaN's place in the order is the whole-tensor path's to decide
                lo, hi = task.bracket
                task.above += int(np.count_nonzero(a > hi))
                task.candidates.append(a[(a >= lo) & (a <= hi)])
            else:
                assert task.rescale is not None  # first_pass: random with a norm to rescale by
                keep = (torch.rand(delta.numel(), generator=task.generator) < task.density).view(delta.shape)
                task.before.append(methods.norm_parts(delta, task.rescale))
                np.multiply(delta.numpy(), keep.numpy(), out=delta.numpy())  # = delta.mul_(keep), faster
                task.after.append(methods.norm_parts(delta, task.rescale))
                task.masks.append(np.packbits(keep.numpy().reshape(-1)))
    for task in tasks:
        if task.sparsifier == "magnitude":
            values = np.concatenate(task.candidates)
            task.candidates = []
            r = task.k - task.above  # the cut is the r-th largest candidate
            if not 1 <= r <= values.size:
                return None
            task.threshold = float(np.partition(values, values.size - r)[values.size - r])
            task.ties = task.k - task.above - int(np.count_nonzero(values > task.threshold))
        elif task.first_pass:
            assert task.rescale is not None  # first_pass: random with a norm to rescale by
            before = methods.finish_norm(task.before, task.rescale)
            task.scale = methods.rescale_factor(before, methods.finish_norm(task.after, task.rescale))
            task.before = task.after = []
    return tasks


def _bracket(pt: PlannedTensor, read, i: int, k: int, n: int) -> tuple[float, float]:
    """Bounds the k-th largest ``|delta|`` of model ``i`` most likely lies within, from a sample of rows."""
    rows, cols = pt.info.shape[0], n // pt.info.shape[0]
    if n <= 4 * SAMPLE_ELEMENTS:
        return 0.0, math.inf  # small: every entry is a candidate
    picked = np.unique(np.linspace(0, rows - 1, max(2, SAMPLE_ELEMENTS // cols)).round().astype(np.int64))
    sample = np.concatenate([np.abs(read(1 + i, r, r + 1).sub_(read(0, r, r + 1)).numpy()).reshape(-1)
                             for r in picked.tolist()])
    sample[::-1].sort()  # descending
    m = sample.size
    q = k / n
    pos = int(q * m)
    margin = int(5 * math.sqrt(m * q * (1 - q)) + 0.02 * m + 16)  # wide: rows are not independent draws
    lo = float(sample[pos + margin]) if pos + margin < m else 0.0
    hi = float(sample[pos - margin]) if pos - margin >= 0 else math.inf
    return lo, hi


def _task_blocks(pt: PlannedTensor, spans, read, reader: BlockReader, tasks: list[_Task],
                 consensus: str | None) -> Iterator[torch.Tensor]:
    """Pass 2: rebuild, sparsify and combine each block's task vectors."""
    p = pt.params
    weights = [t.weight for t in tasks]
    for j, (start, stop) in enumerate(spans):
        base = read(0, start, stop)
        deltas = []
        for i, task in enumerate(tasks):
            d = read(1 + i, start, stop).sub_(base)
            _sparsify(d, task, j)
            if task.weight != 1.0:
                d.mul_(task.weight)
            deltas.append(d)
        mixed = methods.combine_task_vectors(deltas, base, weights, consensus=consensus,
                                             normalize=bool(p["normalize"]), lambda_=float(p["lambda"]))
        yield reader.output(mixed, pt.info.dtype)


def _sparsify(d: torch.Tensor, task: _Task, block: int) -> None:
    """The block's part of the whole-tensor sparsifier, in place (same operations, so the same bits)."""
    kind = task.sparsifier
    if kind is None:
        return
    if kind == "zero":
        d.zero_()
        return
    if kind == "magnitude":
        a = np.abs(d.numpy())
        keep = a > task.threshold
        if task.ties > 0:
            equal = np.flatnonzero(a == task.threshold)[: task.ties]
            keep.reshape(-1)[equal] = True
            task.ties -= equal.size
        methods.zero_dropped(d, keep)
        return
    if task.masks:
        keep = np.unpackbits(task.masks[block], count=d.numel()).view(np.bool_).reshape(d.shape)
    else:
        keep = (torch.rand(d.numel(), generator=task.generator) < task.density).view(d.shape).numpy()
    if task.rescale is None:
        methods.zero_dropped(d, keep)
        return
    np.multiply(d.numpy(), keep, out=d.numpy())  # = d.mul_(keep), the whole-tensor path's step
    if task.rescale == "inverse_density":
        d.div_(task.density)
    elif task.scale is not None:
        d.mul_(task.scale)


__all__ = ["BLOCK_ELEMENTS", "BlockReader", "STREAMED", "merge_blocks", "row_spans", "streamable", "widen"]
