"""Attention over a padding-free batch: every document of the batch end to end in one row, no padding.

A padded batch ``[B, T]`` computes every position of every row, padding
included, and packed rows need a dense ``[T, T]`` document mask that keeps
SDPA off its fast kernels. A padding-free batch is one row ``[1, N]`` of just
the real tokens, with ``cu_seqlens`` (int32, ``[D + 1]``) marking where each
of its ``D`` documents starts: document ``i`` spans
``cu_seqlens[i]:cu_seqlens[i + 1]`` and attends causally to itself only.

Packed rows ``[B, T]`` can be handed over the same way, with ``cu_seqlens``
over their ``B x T`` tokens end to end (see
:func:`entrenar.data.batching.packed_documents`), in place of a document mask.

On CUDA this runs FlashAttention's variable-length kernel
(:func:`torch.nn.attention.varlen.varlen_attn`; FlashAttention-4's on Hopper where ``Documents.kernel`` is
``"fa4"``: :mod:`entrenar.models.fa4`); elsewhere, or where that
kernel cannot take the shapes, each document goes through SDPA on its own,
which computes the same thing and skips the blocks across documents that a
mask would only hide. On a CPU in bf16, documents up to 1,024 tokens run as
explicit products instead (:mod:`entrenar.models.cpu_attention`).

Rows that are each one whole document (long-context training: one document as long as the row) skip the
variable-length kernel: they are plain causal rows, which SDPA computes through cuDNN's attention on CUDA where this
torch has it (about 1.5x FlashAttention-2's forward and backward on Hopper: docs/PERFORMANCE_HISTORY.md).

A segment may also attend keys other than its own tokens (:class:`Documents`' ``kv_index``): a preference pair
laid out ``[prompt, chosen, rejected]`` computes its prompt once, and the rejected tokens read the prompt's keys
and values gathered again in front of their own, queries aligned bottom-right (the last query sees the last key),
as FlashAttention's kernel aligns a causal mask whenever a segment has fewer queries than keys.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from entrenar.models.attention_sinks import flash_sink_attention, sink_attention
from entrenar.models.cpu_attention import (
    EXPLICIT_LAYER_BUDGET,
    capped_attention,
    explicit_causal_attention,
    explicit_fits,
)
from entrenar.models.fa4 import fa4_takes, fa4_varlen

_varlen_attn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.9
    _varlen_attn = None

_VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else set()
# FlashAttention takes fewer key/value heads than query heads as they are (GQA). Newer wrappers ask for
# enable_gqa=True; older ones pass the heads through unchecked, unless their source refuses unequal counts.
_VARLEN_REFUSES_GQA = _varlen_attn is not None and "enable_gqa" not in _VARLEN_PARAMS and \
    "same number of heads" in inspect.getsource(_varlen_attn)
SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float | None = None) -> torch.Tensor:
    """PyTorch's SDPA of q ``[..., Hq, T, D]`` over k, v ``[..., Hk, S, D]`` under ``mask`` (bool, True: attend), or
    causal when it is None; ``scale`` None is ``D ** -0.5``. Fewer key/value heads than query heads go to the kernel
    as they are where this torch's SDPA takes ``enable_gqa``, repeated otherwise."""
    groups = q.shape[-3] // k.shape[-3]
    extra: dict[str, Any] = {}
    if groups > 1 and SDPA_HAS_GQA:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    if scale is not None:
        extra["scale"] = scale
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **extra)


# Whole causal rows on CUDA: cuDNN's kernel first, where this torch can put it first; FlashAttention and the
# memory-efficient kernel where cuDNN declines the shapes.
_ROW_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_CAN_PRIORITISE = "set_priority" in inspect.signature(sdpa_kernel).parameters
WHOLE_ROW_DEVICES = frozenset({"cuda"})  # elsewhere whole rows go document by document as any other row


def whole_rows(documents: Documents, rows: int, length: int) -> bool:
    """Whether every segment of ``documents`` is one whole row of ``rows`` x ``length`` tokens: ``rows`` segments,
    none longer than a row, spanning all ``rows x length`` tokens (as every padding-free layout does), are the
    rows. Read from the host: ``cu_seqlens``' size and ``max_len``, no device sync."""
    return (documents.kv_index is None and documents.shards is None
            and documents.cu_seqlens.numel() == rows + 1 and documents.max_len == length)


def causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of whole rows q ``[B, Hq, T, D]`` over k, v ``[B, Hk, T, D]`` -> ``[B, Hq, T, Dv]``: SDPA,
    with cuDNN's kernel first on CUDA (not while a CUDA graph captures or torch.compile traces, nor under
    deterministic algorithms: SDPA's own choice there)."""
    if not (q.is_cuda and _CAN_PRIORITISE) or _capturing(q) or torch.compiler.is_compiling() or \
            torch.are_deterministic_algorithms_enabled():
        return sdpa(q, k, v, None, scale)
    with sdpa_kernel(_ROW_BACKENDS, set_priority=True):
        return sdpa(q, k, v, None, scale)


class SequenceShards(Protocol):
    """A row split over processes (context parallelism, :mod:`entrenar.distributed.context_parallel`): runs
    ``attention(q, k, v, sinks)`` over the whole row from this process's slice of q, k, v ``[B, H, N / cp, D]``,
    and gives back the slice's output ``[B, N / cp, Hq, Dv]``."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               attention: Callable[..., torch.Tensor]) -> torch.Tensor: ...


# The split a context-parallel step model runs its forward under (set from outside the model by
# :func:`sharded_sequence`); each Documents made meanwhile keeps it, so a layer recomputed in backward (activation
# checkpointing) attends the same way outside the forward.
_SHARDS: ContextVar[SequenceShards | None] = ContextVar("entrenar_sequence_shards", default=None)


@contextlib.contextmanager
def sharded_sequence(shards: SequenceShards) -> Iterator[None]:
    """Padding-free rows made within this block are slices of a row split by ``shards``."""
    token = _SHARDS.set(shards)
    try:
        yield
    finally:
        _SHARDS.reset(token)


@dataclass(frozen=True)
class Documents:
    """Where the documents of a padding-free row start and end (what the layers get instead of a mask)."""

    cu_seqlens: torch.Tensor  # int32 [D + 1], on the model's device: 0, len0, len0 + len1, ..., N
    max_len: int  # the longest document, a Python int (the kernel's launch grid depends on it)
    # Segments whose keys/values are not their own tokens (shared-prompt preference pairs): segment i attends the
    # rows kv_index[cu_seqlens_k[i]:cu_seqlens_k[i + 1]] of the row's keys/values, causally with its queries
    # aligned to the last of them; None: each segment attends itself.
    kv_index: torch.Tensor | None = None  # int64 [K], indices into the row's N tokens
    cu_seqlens_k: torch.Tensor | None = None  # int32 [D + 1] over the K gathered keys
    max_len_k: int = 0  # the longest key segment
    # Context parallelism: the tokens are this process's slice of the row that cu_seqlens spans; None: all of it.
    shards: SequenceShards | None = field(default_factory=_SHARDS.get)
    # Which variable-length kernel runs the segments on CUDA: "fa2" (torch's varlen_attn) or "fa4"
    # (FlashAttention-4, :mod:`entrenar.models.fa4`, where it takes the call; FA2's elsewhere).
    kernel: str = "fa2"
    # What bounds() and key_bounds() read, kept: every layer of a forward (and its checkpointed reruns) shares one
    # Documents, so the host reads the row's layout once rather than once a layer. An __init__ field, because
    # FSDP2's forward-input cast rebuilds dataclasses with dataclasses.replace over every field (the copy shares it).
    _read: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def bounds(self) -> list[int]:
        """``cu_seqlens`` as Python ints (a device sync on the GPU, once per Documents: only the per-document path
        needs it)."""
        if "q" not in self._read:
            self._read["q"] = self.cu_seqlens.tolist()
        return self._read["q"]

    def keys(self) -> tuple[torch.Tensor, int]:
        """(``cu_seqlens`` of the segments' keys, the longest key segment): the gathered keys' with ``kv_index``,
        else the queries' own."""
        if self.cu_seqlens_k is None:
            return self.cu_seqlens, self.max_len
        return self.cu_seqlens_k, self.max_len_k

    def key_bounds(self) -> list[int]:
        """Where each segment's keys start and end in the gathered keys (its own tokens without ``kv_index``)."""
        if self.cu_seqlens_k is None:
            return self.bounds()
        if "k" not in self._read:
            self._read["k"] = self.cu_seqlens_k.tolist()
        return self._read["k"]


def documents_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, window: int | None = None,
    scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each document: q ``[B, Hq, T, D]``, k/v ``[B, Hk, T, D]`` -> ``[B, T, Hq, D]``.

    The rows are read end to end (a padding-free batch is one row; packed rows
    keep their ``[B, T]`` shape and ``documents`` spans all ``B x T`` tokens).
    ``window`` (sliding-window models) limits each query to the ``window``
    latest positions, itself included, as the padded path's mask does. ``scale`` (None: ``1/sqrt(D)``) and
    ``softcap`` (Gemma's soft-capped scores, which only the per-document path computes) as
    :class:`entrenar.models.transformer.Attention` reads them. ``sinks`` (gpt-oss, [Hq]): on CUDA the
    variable-length kernel's output rescaled by its log-sum-exp
    (:func:`~entrenar.models.attention_sinks.flash_sink_attention`); elsewhere each document through
    :func:`~entrenar.models.attention_sinks.sink_attention` (under a CUDA graph without that kernel: every row
    under its segments' mask). ``documents.shards`` (context parallelism): q, k, v are this process's slice of
    the row, and the attention over the whole row runs through its exchange.
    """
    if documents.shards is not None:
        whole = replace(documents, shards=None)
        return documents.shards.attend(q, k, v, sinks, lambda q, k, v, sinks: documents_attention(
            q, k, v, whole, window, scale=scale, softcap=softcap, sinks=sinks))
    b, t = q.shape[0], q.shape[2]
    if (q.device.type in WHOLE_ROW_DEVICES and sinks is None and softcap is None and (window is None or window >= t)
            and whole_rows(documents, b, t)):
        return causal_rows(q, k, v, scale).transpose(1, 2)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[3]) for x in (q, k, v))  # [N, H, D]
    if documents.kv_index is not None:  # each segment's keys/values, the shared ones gathered again
        k, v = k.index_select(0, documents.kv_index), v.index_select(0, documents.kv_index)
    out_shape = (b, t, q.shape[1], v.shape[-1])  # values may be narrower than queries (MLA's v_head_dim)
    if sinks is not None:
        if _varlen_fits(q, k, documents, window) and _VARLEN_OPS is not None:
            return flash_sink_attention(q, k, v, sinks, _VarlenKernel.of(q, k, documents, window, scale)
                                        ).view(out_shape)
        if documents.kv_index is None and _capturing(q):
            return _sinks_by_document_mask(q, k, v, documents, b, window, sinks).view(out_shape)
        return _per_document_sinks(q, k, v, documents, window, sinks).view(out_shape)
    if softcap is None and _varlen_fits(q, k, documents, window, v.shape[-1]) and \
            (scale is None or "scale" in _VARLEN_PARAMS):
        if v.shape[-1] != q.shape[-1]:
            # FlashAttention's kernel takes one head size for q, k and v: zero columns added to the values add
            # zero columns to the output, which are cut off again.
            return _varlen(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), documents,
                           window, scale)[..., :v.shape[-1]].reshape(out_shape)
        return _varlen(q, k, v, documents, window, scale).view(out_shape)
    return _per_document(q, k, v, documents, window, scale, softcap).view(out_shape)


# On a CPU each document attends in its own calls, whose fixed cost (about 0.4 ms a document and layer, forward
# and backward) a document's products must outweigh: per-document attention and padding-free batches are taken
# when hidden size x mean example length reaches this. Measured: the quickstart (128 x 12 tokens) ran 2x slower
# by document; the SmolLM2 chat recipe (576 x 59) 2.9x faster, with padding-free rows; bench_e2e's CPU case
# (576 x 215) 1.3x.
CPU_DOCUMENTS_MIN_WORK = 8192


def rows_by_document(head_dim: int, device: torch.device, dtype: torch.dtype, window: int | None = None,
                     compiled: bool = False, document_work: float | None = None) -> bool:
    """Whether packed rows should attend document by document (``cu_seqlens``) rather than under a dense
    document mask: on CUDA where the variable-length kernel takes them (bf16/fp16); on a CPU unless the model
    is compiled or its documents are small (``document_work``: hidden size x mean example length, below
    :data:`CPU_DOCUMENTS_MIN_WORK`): each document's own causal attention skips the blocks across documents
    that a mask computes and hides, but in a Python loop over documents, which a compiled graph would break on."""
    if device.type == "cpu":
        return not compiled and (document_work is None or document_work >= CPU_DOCUMENTS_MIN_WORK)
    return dtype in (torch.bfloat16, torch.float16) and varlen_available(head_dim, device, window)


def varlen_available(head_dim: int, device: torch.device, window: int | None = None) -> bool:
    """Whether the variable-length kernel can run attention for this head size on ``device`` (in bf16/fp16),
    for any document length: a sliding window needs this torch's ``window_size`` argument."""
    return (_varlen_attn is not None and device.type == "cuda" and head_dim % 8 == 0 and head_dim <= 256
            and (window is None or "window_size" in _VARLEN_PARAMS))


def _varlen_fits(q: torch.Tensor, k: torch.Tensor, documents: Documents, window: int | None, v_dim: int = 0) -> bool:
    if _varlen_attn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 256 or q.shape[-1] < v_dim:
        return False
    # Without window_size (older torch) the kernel is only causal: a window that cuts a document needs the fallback.
    return window is None or max(documents.max_len, documents.max_len_k) <= window or \
        "window_size" in _VARLEN_PARAMS


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
            window: int | None, scale: float | None = None) -> torch.Tensor:
    cu, n = documents.cu_seqlens, documents.max_len
    cu_k, n_k = documents.keys()
    if documents.kernel == "fa4" and fa4_takes(q, v.shape[-1]):
        return fa4_varlen(q, k, v, cu, cu_k, n, n_k, window, scale)
    extra: dict[str, Any] = {}  # the keywords this torch's varlen_attn takes
    if scale is not None:
        extra["scale"] = scale
    if "window_size" in _VARLEN_PARAMS:
        # (left, right): keys in [i - left, i]; the model's window counts the query itself.
        extra["window_size"] = (window - 1 if window is not None else -1, 0)
    else:
        extra["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        # Not repeated to the query's head count: a repeat is saved for backward (4x the keys and values of a
        # Llama layer, 1 GiB on the LoRA-1B benchmark step) and its gradient summed back.
        if "enable_gqa" in _VARLEN_PARAMS:
            extra["enable_gqa"] = True
        elif _VARLEN_REFUSES_GQA:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    assert _varlen_attn is not None  # _varlen_fits checked
    # Without return_aux, varlen_attn returns the output alone. A segment with fewer queries than keys is masked
    # bottom-right (FlashAttention's mask.h: key j is seen by query i when j < i + 1 + seqlen_k - seqlen_q).
    return cast(torch.Tensor, _varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu_k, n, n_k,
                                           **extra))


def _op_arguments(op: Any) -> frozenset[str] | None:
    """The argument names of a ``torch.ops`` overload, or None where this torch has no such op."""
    try:
        return frozenset(a.name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None


def _varlen_ops() -> tuple[Any, Any, frozenset[str], frozenset[str]] | None:
    """The custom ops under ``varlen_attn`` (forward with its log-sum-exp, backward with any output handed in) and
    the arguments each takes in this torch, or None where it has not both."""
    if _varlen_attn is None:
        return None
    namespace = getattr(torch.ops, "torch_attn", None)
    forward, backward = (getattr(namespace, name, None) for name in ("_varlen_attn", "_varlen_attn_backward"))
    forward_args, backward_args = _op_arguments(forward), _op_arguments(backward)
    # enable_gqa is optional: the ops hand fewer key/value heads to FlashAttention as they are, which takes them
    # (torch 2.11's ops have no such argument; only the public wrapper of some versions refuses unequal counts).
    needed = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "window_size"}
    if forward_args is None or backward_args is None or not needed <= forward_args or \
            not needed | {"grad_out", "out", "lse", "rng_state"} <= backward_args:
        return None
    return forward, backward, forward_args, backward_args


_VARLEN_OPS = _varlen_ops()


@dataclass(frozen=True)
class _VarlenKernel:
    """FlashAttention's variable-length kernel over one layer's documents, as
    :func:`~entrenar.models.attention_sinks.flash_sink_attention` calls it: q, k, v ``[N, H, D]``, log-sum-exp
    ``[H, N]``."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    scale: float | None
    window: list[int]
    gqa: bool

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, documents: Documents, window: int | None,
           scale: float | None) -> _VarlenKernel:
        cu_k, max_k = documents.keys()
        return cls(documents.cu_seqlens, cu_k, documents.max_len, max_k, scale,
                   [window - 1 if window is not None else -1, 0], q.shape[1] != k.shape[1])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert _VARLEN_OPS is not None  # documents_attention checked
        op, _, arguments, _ = _VARLEN_OPS
        return op(**_named(arguments, query=q.contiguous(), key=k.contiguous(), value=v.contiguous(),
                           **self._layout()))

    def rows(self, lse: torch.Tensor) -> torch.Tensor:
        return lse.t().unsqueeze(-1)  # [H, N] -> [N, H, 1]

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert _VARLEN_OPS is not None
        _, op, _, arguments = _VARLEN_OPS
        return op(**_named(arguments, grad_out=grad, query=q.contiguous(), key=k.contiguous(),
                           value=v.contiguous(), out=out, lse=lse, rng_state=aux, **self._layout()))

    def _layout(self) -> dict[str, Any]:
        return {"cu_seq_q": self.cu_q, "cu_seq_k": self.cu_k, "max_q": self.max_q, "max_k": self.max_k,
                "is_causal": self.window == [-1, 0], "scale": self.scale, "window_size": self.window,
                "enable_gqa": self.gqa}


def _named(arguments: frozenset[str], **values: Any) -> dict[str, Any]:
    """``values`` by name, those this torch's op takes."""
    return {name: value for name, value in values.items() if name in arguments}


def _per_document_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                        window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    bounds, keys = documents.bounds(), documents.key_bounds()
    pieces = []
    for start, end, k_start, k_end in zip(bounds[:-1], bounds[1:], keys[:-1], keys[1:]):
        if end > start:  # sink_attention aligns the last query with the last key, as the shared layout needs
            qi = q[start:end].transpose(0, 1)[None]  # [1, H, n, D]
            ki, vi = (x[k_start:k_end].transpose(0, 1)[None] for x in (k, v))
            pieces.append(sink_attention(qi, ki, vi, sinks, window=window)[0].transpose(0, 1))
    return torch.cat(pieces)


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is capturing the work on ``t``: then nothing may be read back to the host (a copy of
    device memory into unpinned host memory fails the capture), and no launch may depend on device values."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def segment_mask(documents: Documents, rows: int, length: int, window: int | None = None) -> torch.Tensor:
    """Which keys each query attends (bool ``[rows, length, length]``) in rows of ``length`` tokens whose segments
    ``documents.cu_seqlens`` marks over the rows end to end, none crossing a row (as
    :func:`~entrenar.data.batching.packed_documents` and padding-free rows lay them out): its own segment's, up to
    itself and within the ``window`` latest positions. Built on the device from ``cu_seqlens``: no host read."""
    cu = documents.cu_seqlens
    tokens = torch.arange(rows * length, device=cu.device, dtype=cu.dtype)
    segment = torch.searchsorted(cu, tokens, right=True).view(rows, length)  # empty segments hold no token
    position = torch.arange(length, device=cu.device)
    allowed = position[None, :] <= position[:, None]
    if window is not None:
        allowed = allowed & (position[:, None] - position[None, :] < window)
    return allowed & (segment[:, :, None] == segment[:, None, :])


def _sinks_by_document_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, rows: int,
                            window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """:func:`_per_document_sinks` (q, k, v ``[N, H, D]``) as each row's attention with sinks under its segments'
    mask (:func:`segment_mask`): what a CUDA graph can capture, where the per-document loop would read
    ``cu_seqlens`` back to the host and size its products by it. The same outputs up to the order of fp32 sums
    (a masked key adds an exact zero); each query's probabilities span its row's keys, as the memory estimate
    counts them (``entrenar.train.memory``)."""
    n, length = q.shape[0], q.shape[0] // rows
    q, k, v = (x.view(rows, length, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    mask = segment_mask(documents, rows, length, window)[:, None]
    return sink_attention(q, k, v, sinks, mask).transpose(1, 2).reshape(n, q.shape[1], v.shape[-1])


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                  window: int | None, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    bounds, keys = documents.bounds(), documents.key_bounds()
    pieces = []
    kept = 0  # probabilities the explicit path keeps for backward in this layer
    for start, end, k_start, k_end in zip(bounds[:-1], bounds[1:], keys[:-1], keys[1:]):
        if end == start:  # an empty segment (fixed-capacity layouts end with some)
            continue
        qi = q[start:end].transpose(0, 1)  # [H, n, D]
        ki, vi = (x[k_start:k_end].transpose(0, 1) for x in (k, v))  # [H, s, D]
        n, s = end - start, k_end - k_start
        window_mask = bottom_right_mask(n, s, window, q.device)
        if softcap is not None:
            y = capped_attention(qi[None], ki[None], vi[None], window_mask, scale, softcap)[0]
            pieces.append(y.transpose(0, 1))
            continue
        if scale is None and n == s and explicit_fits(qi, ki, vi, n, window) and \
                kept + qi.shape[0] * n * n <= EXPLICIT_LAYER_BUDGET:
            kept += qi.shape[0] * n * n
            pieces.append(explicit_causal_attention(qi, ki, vi).transpose(0, 1))
            continue
        pieces.append(sdpa(qi, ki, vi, window_mask, scale).transpose(0, 1))
    return torch.cat(pieces)


def bottom_right_mask(n: int, s: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of ``s`` keys each of ``n`` queries attends (bool ``[n, s]``), the last query aligned with the last key
    (query i at position ``i + s - n``) and limited to the ``window`` latest positions, itself included; None where
    SDPA's own causal mask is the same (``n == s``, no window that cuts)."""
    if n == s and (window is None or n <= window):
        return None
    q_pos = torch.arange(s - n, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (q_pos - k_pos < window) if window is not None else mask
