"""Activation offload: what the decoder blocks save for backward waits in pinned CPU memory instead of the GPU.

Between a block's forward and its backward, autograd keeps what backward will
read: for a checkpointed block only its input ``[B, T, hidden]``, for any other
block every activation its products, norms and attention save (about 11x
that at Llama shapes). :class:`ActivationOffload` moves those tensors to
pinned CPU memory on a side stream as autograd saves them, so the copies run
beside the block's compute, and brings them back in backward one block ahead
of the block that needs them. The GPU then holds a block's activations only
while it runs, plus the copies in flight (those of the last two layers in
forward, one block ahead in backward). The last block keeps its activations:
backward reads them first, and the blocks whose copies are still running when
backward starts keep theirs too.

What it costs is PCIe traffic, not compute: on an H200 host the copies ran at
49-55 GB/s each way while matrix products ran at full speed beside them
(``bench/pcie_probe.py``, docs/PERFORMANCE.md). So a block that would be recomputed in
backward can instead keep its activations, in CPU memory, as long as the
copies keep pace with the compute.

Everything is ordered on the streams, with no host synchronisation and no
allocation once the shapes have been seen: pinned buffers come from a pool
keyed by where a tensor was saved (grown to the largest size seen), a tensor's
GPU memory is let go only after the compute stream has waited for its copy,
and when a backward ends the compute stream waits for any copy back it did not
read (a backward that stops short). So a CUDA graph records the copies along
with the step and replays them (``training.cuda_graphs``).

Weights stay where they are: parameters, buffers, tensors made without
autograd (which include a frozen embedding's output), and autocast's copies
and views of parameters. So do tensors the caller names
as shared by every block (RoPE tables, masks) and tensors under ``min_bytes``. Tensors
that share a storage (views) travel once, as the whole storage, and come back
with their own sizes, strides and offsets.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn


class _Entry:
    """One storage saved in a block: its pinned copy, and its GPU bytes while they are needed."""

    __slots__ = ("group", "host", "gpu", "unpacks", "__weakref__")
    gpu: torch.Tensor | None  # None while only the pinned copy holds the bytes

    def __init__(self, group: _Group, host: torch.Tensor, gpu: torch.Tensor) -> None:
        self.group, self.host, self.gpu, self.unpacks = group, host, gpu, 0


class _Saved:
    """What autograd holds instead of a tensor: its storage's entry and its layout in that storage."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry, self.dtype, self.size, self.stride, self.offset = (
            entry, t.dtype, t.shape, t.stride(), t.storage_offset())


class _Group:
    """The storages one block saved, in one forward pass."""

    def __init__(self, forward: _Forward, index: int, layer: int) -> None:
        self.forward, self.index, self.layer = forward, index, layer
        # storage data_ptr -> entry; weak, as autograd's saved objects own the entries (and their pinned buffers)
        self.entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
        self.copied: list[torch.cuda.Event] = []  # the copies to the CPU, on the copy stream
        self.joined = False  # the compute stream has waited for those copies
        self.loaded: torch.cuda.Event | None = None  # the GPU bytes are back (or never left) once this fires
        self.waited = False  # the compute stream has waited for ``loaded``


class _Forward:
    """One forward pass's offloaded blocks, in forward order."""

    def __init__(self, owner: ActivationOffload, device: torch.device, keep: set[int]) -> None:
        self.owner, self.device, self.keep = owner, device, keep
        self.groups: list[_Group] = []
        self.backward_started = False
        self.finish_queued = False

    @contextlib.contextmanager
    def block(self, layer: int) -> Iterator[None]:
        """Saved-tensor hooks for layer ``layer``'s forward: what it saves goes to the CPU."""
        group = _Group(self, len(self.groups), layer)
        self.groups.append(group)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.owner._pack(group, t), _unpack):
            yield

    def layer_done(self, layer: int) -> None:
        """After layer ``layer``'s forward: the copies of blocks ``in_flight`` layers back must be done."""
        for group in self.groups:
            if group.layer <= layer - self.owner.in_flight:
                self._join(group)

    def _join(self, group: _Group, keep: bool = False) -> None:
        """The compute stream waits for the group's copies to the CPU; then its GPU bytes may go, unless
        ``keep`` (backward is about to read them: they count as loaded)."""
        if group.joined:
            return
        stream = torch.cuda.current_stream(self.device)
        for event in group.copied:
            stream.wait_event(event)
        group.joined = True
        if keep and group.loaded is None:
            group.loaded = torch.cuda.Event()
            group.loaded.record(stream)
            return
        for entry in list(group.entries.values()):
            entry.gpu = None

    def start_backward(self) -> None:
        """At the first unpack of a backward: blocks whose copies may still run keep their GPU bytes, and the
        compute stream waits for every copy to the CPU; the autograd engine is asked to call
        :meth:`finish_backward` when this backward ends."""
        if not self.backward_started:
            self.backward_started = True
            for group in self.groups:
                self._join(group, keep=True)
        if not self.finish_queued:
            self.finish_queued = True
            stream = torch.cuda.current_stream(self.device)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish_backward(stream))

    def finish_backward(self, stream: torch.cuda.Stream) -> None:
        """The compute stream waits for every copy back it has not waited for (a block prefetched but never
        read, as when backward stops short): no copy may still write memory the allocator hands out again,
        and a CUDA graph's capture ends with every side-stream copy joined."""
        for group in self.groups:
            if group.loaded is not None and not group.waited:
                stream.wait_event(group.loaded)
                group.waited = True
        self.finish_queued = False

    def load(self, group: _Group) -> None:
        """Issue the copies of ``group`` back to the GPU on the copy stream (once)."""
        if group.loaded is not None:
            return
        stream, copy_stream = torch.cuda.current_stream(self.device), self.owner.copy_stream(self.device)
        entries = list(group.entries.values())
        for entry in entries:  # allocated in compute-stream order, filled on the copy stream
            entry.gpu = torch.empty(entry.host.shape, dtype=torch.uint8, device=self.device)
        copy_stream.wait_stream(stream)
        with torch.cuda.stream(copy_stream):
            for entry in entries:
                assert entry.gpu is not None  # allocated above
                entry.gpu.copy_(entry.host, non_blocking=True)
            group.loaded = torch.cuda.Event()
            group.loaded.record(copy_stream)
        group.waited = False

    def previous(self, group: _Group) -> _Group | None:
        """The block before ``group`` in forward order that saved something: the next one backward reads."""
        return next((g for g in reversed(self.groups[:group.index]) if g.entries), None)


def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    entry = saved.entry
    group = entry.group
    forward = group.forward
    forward.start_backward()
    stream = torch.cuda.current_stream(forward.device)
    if entry.gpu is None and group.loaded is not None:  # unpacked before (retain_graph): copy it back again
        entry.gpu = torch.empty(entry.host.shape, dtype=torch.uint8, device=forward.device)
        entry.gpu.copy_(entry.host, non_blocking=True)
    else:
        forward.load(group)
        assert group.loaded is not None  # load() recorded it
        stream.wait_event(group.loaded)
        group.waited = True
        ahead = forward.previous(group)
        if ahead is not None:
            forward.load(ahead)
    gpu = entry.gpu
    assert gpu is not None  # copied back above, or kept since the pack
    entry.unpacks -= 1
    if entry.unpacks <= 0:
        entry.gpu = None  # autograd holds what it unpacked for as long as it needs it
    return torch.empty(0, dtype=saved.dtype, device=gpu.device).set_(
        gpu.untyped_storage(), saved.offset, saved.size, saved.stride)


# Backward nodes of casts and views: a chain of them from a parameter ends in its AccumulateGrad.
_WEIGHT_PATH = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                          "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
                          "ExpandBackward0"})


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, a buffer, a tensor made without autograd, or casts and views of a trained parameter (the
    transposed bf16 copy autocast makes for a product): not an activation of the step, so it stays where it
    is. Judged by the autograd history, not by what a view's storage belongs to: a node's output is often a
    view of a tensor made inside its forward, without history, and is an activation all the same."""
    fn = t.grad_fn
    while fn is not None:
        if fn.name() not in _WEIGHT_PATH:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return True  # no history: a leaf (a parameter, a buffer, or a tensor made without autograd)


class ActivationOffload:
    """Keeps the activations that decoder blocks save for backward in pinned CPU memory (see the module).

    ``in_flight``: how many blocks' copies to the CPU may still be running when a block ends (their GPU
    memory waits for them); more lets the copies fall further behind the compute before it waits.
    """

    def __init__(self, min_bytes: int = 1 << 20, in_flight: int = 2) -> None:
        self.min_bytes, self.in_flight = min_bytes, in_flight
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pool: dict[tuple[int, int], list[torch.Tensor]] = {}  # (block, slot) -> pinned buffers
        self._in_use: set[int] = set()  # data_ptrs of pooled buffers an entry holds
        self._static: set[int] = set()

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def forward(self, model: nn.Module, device: torch.device, shared: Iterable[object] = ()) -> _Forward:
        """A forward pass of ``model`` on ``device``; the tensors among ``shared`` (used by every block) stay on the
        GPU."""
        self._static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        keep = {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}
        return _Forward(self, device, keep)

    def _pack(self, group: _Group, t: torch.Tensor) -> torch.Tensor | _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if (not t.is_cuda or storage.nbytes() < self.min_bytes or key in self._static or key in group.forward.keep
                or _is_weight(t)):
            # Kept as it is, but without its autograd history: a node that saves its own output would
            # otherwise hold that output, whose grad_fn is the node, a cycle no garbage collector sees, and
            # a graph dropped before backward reached it (backward(inputs=...), retain_graph) would never
            # be freed. Autograd gives the unpacked tensor its history back.
            return t if t.grad_fn is None else t.detach()
        entry = group.entries.get(key)
        if entry is None:
            host = self._host_buffer(group.index, len(group.entries), storage.nbytes())
            gpu = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            entry = _Entry(group, host, gpu)
            group.entries[key] = entry
            weakref.finalize(entry, self._in_use.discard, host.data_ptr())
            copy_stream = self.copy_stream(t.device)
            copy_stream.wait_stream(torch.cuda.current_stream(t.device))  # the tensor is complete
            with torch.cuda.stream(copy_stream):
                host.copy_(gpu, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            group.copied.append(copied)
        entry.unpacks += 1
        return _Saved(entry, t)

    def _host_buffer(self, block: int, slot: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of a pinned buffer for the ``slot``-th storage block ``block`` saves: the same buffer every
        step (a CUDA graph's copies land where this step's entries read), grown to the largest size asked, so
        batches of changing shapes (padding-free) do not add buffers."""
        buffers = self._pool.setdefault((block, slot), [])
        free = [b for b in buffers if b.data_ptr() not in self._in_use]
        buffer = next((b for b in free if b.numel() >= nbytes), None)
        if buffer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"activation offload: block {block} saved a new tensor ({nbytes} bytes) while a CUDA graph was "
                    "being captured; its warm-up steps must save what the captured step saves")
            for smaller in free:  # outgrown: the larger one takes its place
                buffers.remove(smaller)
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            buffers.append(buffer)
        self._in_use.add(buffer.data_ptr())
        return buffer[:nbytes]
