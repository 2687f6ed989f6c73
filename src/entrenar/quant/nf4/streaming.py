"""NF4 base weights kept in pinned CPU memory, each decoder block's copied to the GPU just before it runs.

A QLoRA model's largest resident state is its frozen NF4 block weights (3.35
GiB at a Llama-8B shape, with double quantization), yet a step reads one
block's at a time. :class:`WeightStream` keeps every block's NF4 buffers in
one pinned CPU buffer per block and, on a side stream, copies the next
block's into GPU memory while the current block computes (about 105 MiB a
block at that shape: 2 ms at the 50 GB/s a PCIe 5 host moves, against a
block's forward of about 3 ms and its rerun and backward of about 8). The
GPU holds a block's copy while it runs and until autograd lets go of it: a
checkpointed block keeps nothing of its forward, reruns it in backward (which
copies the weights in again, the block before it prefetched) and frees the
copy once its backward is done. A block that is not checkpointed keeps its
copy until its backward, so the memory saved is that of the checkpointed
blocks.

What moves is the module's buffers, not what reads them: an ``NF4Linear``
hands its current buffers to each product it starts
(:attr:`entrenar.quant.nf4.format.NF4Linear.quantized`), so a product's backward
keeps reading the copy it started with after the module's buffers point back
to CPU memory. Everything is ordered on the streams (the compute stream waits
for a copy before the block reads it; a copy's memory is taken on the compute
stream, after the copy stream has waited for it), with no host
synchronisation, so a CUDA graph records the copies with the step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from entrenar.models.recompute import recomputing
from entrenar.quant.nf4.format import NF4Linear

if TYPE_CHECKING:
    from entrenar.models.transformer import Transformer

_loading = threading.local()
_BUFFERS = ("weight_codes", "weight_absmax", "weight_absmax_scale", "weight_absmax_offset")
_ALIGN = 256  # bytes: every buffer's view starts aligned for any dtype and for vectorised loads


@contextlib.contextmanager
def nf4_in_host_memory(on: bool = True) -> Iterator[None]:
    """Models loaded inside keep their NF4 block weights in CPU memory from the start, quantized on the GPU one
    tensor at a time (:meth:`entrenar.quant.nf4.format.NF4Linear.keep_in_host_memory`): a streamed model never holds
    all of them on the GPU, not even while loading."""
    before, _loading.host = getattr(_loading, "host", False), on
    try:
        yield
    finally:
        _loading.host = before


def nf4_host_memory_requested() -> bool:
    """Whether a model built now should keep its NF4 weights in CPU memory (:func:`nf4_in_host_memory`)."""
    return getattr(_loading, "host", False)


class _Block:
    """One block's NF4 buffers: where each lies in the block's flat pinned buffer, and that buffer."""

    def __init__(self, block: nn.Module) -> None:
        self.layout: list[tuple[NF4Linear, str, int, int, torch.dtype, torch.Size]] = []
        size = 0
        for module in block.modules():
            if not isinstance(module, NF4Linear):
                continue
            for name in _BUFFERS:
                t = module._buffers.get(name)
                if t is None:
                    continue
                nbytes = t.numel() * t.element_size()
                self.layout.append((module, name, size, nbytes, t.dtype, t.shape))
                size += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = size
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        for module, name, offset, nbytes, _, _ in self.layout:
            source = module._buffers[name]
            assert source is not None  # the layout holds only the buffers that are set
            self.host[offset:offset + nbytes].copy_(source.reshape(-1).view(torch.uint8))
            module.quantize_on = module.quantize_on or source.device  # a later .to() leaves the buffers here
        self.point_to(self.host)

    def point_to(self, flat: torch.Tensor) -> None:
        """Set the modules' buffers to views of ``flat`` (the pinned copy, or a GPU copy of it)."""
        for module, name, offset, nbytes, dtype, shape in self.layout:
            module._buffers[name] = flat[offset:offset + nbytes].view(dtype).view(shape)


class WeightStream:
    """Streams the NF4 weights of ``blocks`` from pinned CPU memory to ``device`` as each block runs.

    ``rerun(i)``: whether block ``i`` reruns its forward in backward (is checkpointed), so that a rerun can
    prefetch the block that reruns after it. Construction moves the buffers to CPU memory (the GPU copies are
    freed once nothing else refers to them).
    """

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, rerun: Callable[[int], bool]) -> None:
        self.device, self.rerun = device, rerun
        self.blocks = [_Block(b) for b in blocks]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # block -> (its GPU copy, the copy's event, the stream that took the memory); no event on a CPU
        self._pending: dict[int, tuple[torch.Tensor, torch.cuda.Event | None, torch.cuda.Stream | None]] = {}
        self._installed: set[int] = set()
        self._hooks = []
        for i, block in enumerate(blocks):
            self._hooks.append(block.register_forward_pre_hook(lambda _m, args, i=i: self._before(i, args)))
            self._hooks.append(block.register_forward_hook(lambda _m, _a, out, i=i: self._after(i, out)))

    @property
    def host_bytes(self) -> int:
        """Pinned CPU memory the weights occupy."""
        return sum(b.nbytes for b in self.blocks)

    def remove(self) -> None:
        """Stop streaming: hooks removed, the weights back on ``device`` for good."""
        for h in self._hooks:
            h.remove()
        self._new_pass()
        for b in self.blocks:
            b.point_to(b.host.to(self.device))

    def _fetch(self, i: int) -> None:
        """Start copying block ``i``'s weights to the GPU (on the side stream), unless already under way."""
        if i in self._pending or i in self._installed or not 0 <= i < len(self.blocks):
            return
        block = self.blocks[i]
        if self._stream is None:  # a CPU model (tests): a copy of its own all the same, as a GPU would get
            self._pending[i] = (block.host.clone(), None, None)
            return
        compute = torch.cuda.current_stream(self.device)
        gpu = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)  # taken on the compute stream
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            gpu.copy_(block.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending[i] = (gpu, done, compute)

    def _before(self, i: int, args: tuple = ()) -> None:
        if i == 0 and not recomputing():
            self._new_pass()
        # A rerun that checkpointing stopped early never reached its forward hook: its buffers are let go here.
        for j in list(self._installed):
            if j != i:
                self._release(j)
        if i not in self._installed:
            self._fetch(i)
            flat, done, _ = self._pending.pop(i)
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
            self.blocks[i].point_to(flat)
            self._installed.add(i)
        if recomputing():  # backward reruns blocks last to first, down to the first whose input needs a gradient
            if i > 0 and self.rerun(i - 1) and _needs_grad(args):
                self._fetch(i - 1)
        else:
            self._fetch(i + 1)

    def _after(self, i: int, output: object = None) -> None:
        self._release(i)
        if i == len(self.blocks) - 1 and self.rerun(i) and not recomputing() and _needs_grad((output,)):
            self._fetch(i)  # backward reruns this block first

    def _new_pass(self) -> None:
        """A forward pass starts: let go of every copy an earlier pass left (the last rerun's, a prefetch no
        backward used). Never reusing them keeps a CUDA graph's reads inside memory its capture allocated."""
        for _, done, compute in self._pending.values():
            if done is not None:  # its memory may be taken again only once the copy into it is done
                assert compute is not None  # _fetch records the two together
                compute.wait_event(done)
        self._pending.clear()
        for j in list(self._installed):
            self._release(j)

    def _release(self, i: int) -> None:
        self.blocks[i].point_to(self.blocks[i].host)
        self._installed.discard(i)


def _needs_grad(values: tuple) -> bool:
    """Whether backward will reach the block these are the input (or output) of: a copy prefetched for a rerun
    that never comes would stay unused, and a CUDA graph capture refuses a side-stream copy nothing waits for."""
    first = values[0] if values else None
    return isinstance(first, torch.Tensor) and first.requires_grad and torch.is_grad_enabled()


def stream_weights(model: nn.Module, device: torch.device) -> WeightStream | None:
    """Keep ``model``'s NF4 block weights in pinned CPU memory and stream them to ``device`` block by block
    (``training.offload_weights``); None when its blocks hold no NF4 layer."""
    transformer = cast("Transformer", model)  # the blocks and their checkpointing are a Transformer's
    blocks = list(transformer.model.layers)
    if not any(isinstance(m, NF4Linear) for b in blocks for m in b.modules()):
        return None
    return WeightStream(blocks, device, lambda i: i in transformer.checkpointed_layers)
