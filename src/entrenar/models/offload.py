"""Offload of checkpointed activations: a recomputed layer's input waits for backward in CPU memory.

Under activation checkpointing each recomputed layer keeps one tensor from
forward to backward: its input, ``[B, T, hidden]``. At long context these
inputs are most of what training holds on the GPU (for a Llama-8B shape,
batch 1 x 32k tokens, 32 layers x 256 MiB = 8 GiB). :func:`offload_saved_input`
moves that tensor to pinned CPU memory as soon as autograd saves it, on a side
stream so the copy overlaps the layer's compute, and copies it back when the
backward pass recomputes the layer. Everything else autograd saves is left
where it is.

Non-reentrant :func:`torch.utils.checkpoint.checkpoint` saves its inputs
through the saved-tensor hooks active around the call (and what the layer
saves inside through its own), which is what this relies on.
"""

from __future__ import annotations

import torch

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def offload_saved_input(tensor: torch.Tensor) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks under which autograd keeps ``tensor``, when it saves it, in CPU memory until backward.

    CPU tensors are kept as they are (there is nowhere cheaper to put them).
    """
    # Autograd keeps the pack hook as long as what it saved, so the hook must not hold the tensor itself.
    target = (tensor.data_ptr(), tensor.shape)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: _pack(t, target), _unpack)


def _pack(saved: torch.Tensor, target: tuple[int, torch.Size]):
    if not saved.is_cuda or (saved.data_ptr(), saved.shape) != target:
        return saved
    device = saved.device
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    host = torch.empty(saved.shape, dtype=saved.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(device))  # the tensor is complete before it is copied
    with torch.cuda.stream(stream):
        host.copy_(saved, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    saved.record_stream(stream)  # the allocator must not reuse its memory before the copy has read it
    return _Offloaded(host, device, copied)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    torch.cuda.current_stream(packed.device).wait_event(packed.copied)
    return packed.host.to(packed.device, non_blocking=True)


class _Offloaded:
    __slots__ = ("host", "device", "copied")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: torch.cuda.Event) -> None:
        self.host, self.device, self.copied = host, device, copied
