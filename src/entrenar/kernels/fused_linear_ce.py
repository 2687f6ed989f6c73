"""Output projection fused with token-summed cross-entropy: full-vocabulary logits are never held.

Tokens are taken ``chunk_size`` at a time. For each chunk the logits are one
bf16 matrix product; one Triton program per row then computes the row's
log-sum-exp in a streaming pass and overwrites the logits with
``d loss / d logits = softmax - onehot(target)`` (zero on ignored rows) in a
second pass, and two more matrix products turn that into the chunk's
gradients of the hidden states and the weight. All of this happens in
forward; backward only scales the stored gradients by the incoming scalar.

Without Triton (CPU) the same loop runs with the row pass in PyTorch.
The specification is :func:`entrenar.models.loss.chunked_cross_entropy`
(itself checked against :func:`entrenar.models.loss.token_cross_entropy`):
same contract, same rounding points (bf16 logits, fp32 softmax, bf16
gradient of the logits, fp32 accumulation of the weight gradient).

Final-logit soft-capping (Gemma: ``c * tanh(logits / c)``) runs around the row pass, on the Triton path as on
the CPU one: each chunk's logits are capped (tanh in fp32, rounded back to the chunk's dtype) before it, and the
gradient it writes is multiplied by ``1 - tanh ** 2`` after it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from entrenar.kernels._common import autocast_inputs, use_triton
from entrenar.models.loss import IGNORE_INDEX, GradsInForward, chunked_cross_entropy

_BLOCK_V = 4096
# Tokens per chunk of the fused output-projection loss, as training runs it: a 128k vocabulary's bf16 logits chunk
# is then 0.25 GiB, at the speed of 4096-token chunks (docs/PERFORMANCE.md, fifth call set).
FUSED_LOSS_CHUNK = 1024
# Logits one chunk may hold (0.25 GiB in bf16): larger vocabularies take fewer tokens a chunk.
FUSED_LOSS_LOGITS = 2**27


def fused_loss_chunk(vocab_size: int) -> int:
    """Tokens per chunk of the fused loss for a vocabulary: :data:`FUSED_LOSS_CHUNK`, or fewer (a multiple of 128,
    at least 128) where its logits would pass :data:`FUSED_LOSS_LOGITS`: Gemma's 262k vocabulary takes 512, whose
    chunk would otherwise outweigh a checkpointed layer's activations."""
    return max(128, min(FUSED_LOSS_CHUNK, FUSED_LOSS_LOGITS // max(vocab_size, 1) // 128 * 128))


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_rows(LOGITS, TARGETS, LOSS, stride_row, n_vocab, ignore_index,
                           BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ptr = LOGITS + row * stride_row
        target = tl.load(TARGETS + row)
        valid = target != ignore_index
        # Pass 1: streaming max and sum of exponentials (online softmax).
        m = float("-inf")
        s = 0.0
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(ptr + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        safe_target = tl.where(valid, target, 0)
        target_logit = tl.load(ptr + safe_target).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
        if WRITE_GRAD:
            # Pass 2: softmax - onehot(target), written over the logits.
            scale = tl.where(valid, 1.0, 0.0)
            for start in range(0, n_vocab, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < n_vocab
                x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
                tl.store(ptr + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=mask)

    return SimpleNamespace(cross_entropy_rows=cross_entropy_rows)


def _rows_triton(
    logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, write_grad: bool
) -> torch.Tensor:
    """Per-row losses into ``loss_rows``; returns d loss / d logits, written over ``logits``."""
    _kernels().cross_entropy_rows[(logits.shape[0],)](
        logits, targets, loss_rows, logits.stride(0), logits.shape[1], IGNORE_INDEX,
        BLOCK_V=_BLOCK_V, WRITE_GRAD=write_grad, num_warps=16,
    )
    return logits


def _rows_torch(
    logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, write_grad: bool
) -> torch.Tensor:
    """The same in PyTorch, for CPUs: one fused ``log_softmax`` pass where ``logsumexp`` takes several.

    fp32 logits are overwritten in place: a fresh [chunk, V] block costs more in page faults on a CPU than the
    pass itself (65 ms of a 1.1 s SmolLM2-shape step on the 2-core machine, docs/PERFORMANCE.md).
    """
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    if logits.dtype == torch.float32:
        log_probs = torch.log_softmax(logits, dim=-1, out=logits)
    else:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
    loss_rows.copy_(-log_probs.gather(1, safe).squeeze(1) * valid)
    if not write_grad:
        return logits
    grad = log_probs.exp_()  # softmax, in the log-probabilities' memory
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    ignored = ~valid
    if ignored.any():
        grad[ignored] = 0.0
    return grad.to(logits.dtype)


def _loss_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, need_hidden: bool,
    need_weight: bool, rows=_rows_triton, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n = hidden.shape[0]
    loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = None
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        logits = h @ weight.T  # [chunk, V] in the model dtype
        capped = None  # tanh(logits / c) in fp32: one more [chunk, V] block, the only one the cap adds
        if softcap is not None:
            capped = logits.to(torch.float32, copy=True).div_(softcap).tanh_()
            logits.copy_(capped).mul_(softcap)
        grad_logits = rows(
            logits, targets[start : start + chunk_size], loss_rows[start : start + chunk_size],
            need_hidden or need_weight,
        )
        if capped is not None and (need_hidden or need_weight):
            grad_logits.mul_(capped.square_().neg_().add_(1))  # computed in fp32, stored in the chunk's dtype
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
        if need_weight:
            # fp32 accumulation across chunks, as the specification does.
            chunk_grad = grad_logits.T @ h
            grad_weight = chunk_grad.float() if grad_weight is None else grad_weight.add_(chunk_grad)
    return loss_rows.sum(), grad_hidden, grad_weight


@torch.compiler.disable  # a Python loop over chunks with in-place kernels: runs eagerly inside a compiled step
def _fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, rows,
           softcap: float | None = None):
    # Shift by giving the last position of each row the ignored target: no copy of the hidden states.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    n_tokens = (targets != IGNORE_INDEX).sum()
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        loss_and_grads = functools.partial(_loss_and_grads, rows=rows, softcap=softcap)
        return GradsInForward.apply(flat, weight, targets, chunk_size, loss_and_grads), n_tokens
    loss_sum, _, _ = _loss_and_grads(flat, weight, targets, chunk_size, False, False, rows, softcap)
    return loss_sum, n_tokens


def fused_linear_cross_entropy(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
    logits_scaling: float = 1.0, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cross_entropy(hidden @ lm_head_weight.T / logits_scaling, labels)`` as ``(loss_sum, n_tokens)``, fused;
    ``softcap``: of the logits (after ``logits_scaling``) soft-capped first (Gemma's ``final_logit_softcapping``).

    ``hidden`` [B, T, H], ``lm_head_weight`` [V, H], ``labels`` [B, T] unshifted
    with -100 for no loss. Memory holds one [chunk_size, V] block of logits
    in the model dtype. On the GPU each chunk's softmax runs in the Triton
    kernel; elsewhere in one ``log_softmax`` pass. Arguments the fused path
    does not take (mixed dtypes, wrong shapes) go to
    :func:`entrenar.models.loss.chunked_cross_entropy`, which computes the same
    or names the problem. ``logits_scaling`` (Granite's) divides the logits: the hidden states are divided
    before the projection, the same product.
    """
    if logits_scaling != 1.0:
        hidden = hidden / logits_scaling
    (hidden, lm_head_weight), autocast_off = autocast_inputs(hidden, lm_head_weight)
    with autocast_off:
        return _fused_or_chunked(hidden, lm_head_weight, labels, chunk_size, softcap)


def _fused_or_chunked(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    ok = (
        hidden.ndim == 3 and labels.shape == hidden.shape[:2] and lm_head_weight.ndim == 2
        and lm_head_weight.shape[1] == hidden.shape[-1] and hidden.dtype == lm_head_weight.dtype
        and isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0
    )
    if not ok:
        return chunked_cross_entropy(hidden, lm_head_weight, labels, chunk_size, softcap=softcap)
    rows = _rows_triton if use_triton(hidden, lm_head_weight) else _rows_torch
    return _fused(hidden, lm_head_weight, labels, chunk_size, rows, softcap)
