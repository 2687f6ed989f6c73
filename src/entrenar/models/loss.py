"""Token-summed cross-entropy for causal language models.

Labels arrive unshifted (aligned with ``input_ids``); position ``t`` predicts
label ``t + 1``. ``IGNORE_INDEX`` (-100) marks tokens without loss (prompt,
padding, the first token of a packed document).

Losses are *sums* with their token count, never per-batch means. The training
loop divides each micro-batch's ``loss_sum`` by the number of target tokens of
the whole optimizer step (``entrenar.data.num_target_tokens`` summed over its
micro-batches, known before any forward pass), so gradient accumulation gives every target
token the same weight, exactly as one large batch would.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from entrenar.data.tokenize import IGNORE_INDEX


def _check_shapes(what: str, scores: torch.Tensor, labels: torch.Tensor) -> None:
    if labels.ndim != 2 or scores.ndim != 3 or scores.shape[:2] != labels.shape:
        raise ValueError(
            f"{what} must be [B, T, *] with labels [B, T]; got {tuple(scores.shape)} and {tuple(labels.shape)}"
        )


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of ``logits`` [B, T, V] against ``labels`` [B, T].

    Returns ``(loss_sum, n_tokens)``: a float32 scalar (the logits are upcast
    so the sum is taken in fp32 whatever the model dtype) and the number of
    target tokens as a 0-dim int64 tensor on the same device (no host sync).
    """
    _check_shapes("logits", logits, labels)
    targets = labels[:, 1:].reshape(-1)
    scores = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    loss_sum = F.cross_entropy(scores, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (targets != IGNORE_INDEX).sum()


def _chunk_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    need_hidden: bool,
    need_weight: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Loss sum over ``hidden`` [N, H] and, if asked, its gradients, one chunk of logits at a time.

    d(loss_sum)/d(logits) = softmax(logits) - onehot(target) on target rows and
    0 on ignored ones, so each chunk's gradients are known as soon as its
    logits are; the chunk's logits are then freed. With ``softcap`` (Gemma's final-logit soft-capping) the
    loss reads ``c * tanh(logits / c)``, and the gradient is multiplied by ``1 - tanh(logits / c) ** 2``.
    """
    n = hidden.shape[0]
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    # fp32 accumulator across chunks: the weight is usually bf16 and the sum runs over all tokens.
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        t = targets[start : start + chunk_size]
        valid = t != IGNORE_INDEX
        safe_t = torch.where(valid, t, 0).unsqueeze(1)
        logits = (h @ weight.T).float()
        capped = None
        if softcap is not None:
            capped = torch.tanh(logits / softcap)
            logits = capped * softcap
        lse = torch.logsumexp(logits, dim=-1)
        loss_sum += ((lse - logits.gather(1, safe_t).squeeze(1)) * valid).sum()
        if not (need_hidden or need_weight):
            continue
        grad_logits = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, reusing the logits' memory
        grad_logits.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=grad_logits.dtype))
        grad_logits.mul_(valid.unsqueeze(1))
        if capped is not None:
            grad_logits.mul_(1 - capped.square_())
        grad_logits = grad_logits.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden[start : start + chunk_size] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += (grad_logits.T @ h).float()
    return loss_sum, grad_hidden, grad_weight


class GradsInForward(torch.autograd.Function):
    """loss_sum = CE(hidden @ weight.T, targets), its gradients computed during forward chunk by chunk.

    ``loss_and_grads(hidden, weight, targets, chunk_size, need_hidden, need_weight)`` returns
    ``(loss_sum, grad_hidden, grad_weight)``; only those gradients ([N, H] and [V, H]) are kept for
    backward, never [N, V] logits, and backward scales them by the incoming scalar. Shared by
    :func:`chunked_cross_entropy` and the fused kernel (:mod:`entrenar.kernels.fused_linear_ce`).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                loss_and_grads):
        loss_sum, grad_hidden, grad_weight = loss_and_grads(
            hidden, weight, targets, chunk_size, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096,
    logits_scaling: float = 1.0, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cross_entropy(soft_cap(hidden @ lm_head_weight.T / logits_scaling, softcap), labels)`` without full
    logits (``softcap`` None: the logits as they are; divided first, then capped).

    ``hidden`` [B, T, H] are the final normed hidden states, ``lm_head_weight``
    is [V, H]. Logits are formed ``chunk_size`` tokens at a time, in forward and
    in backward, so memory holds at most [chunk_size, V] logits (in fp32) plus
    the gradients. Same return contract as :func:`token_cross_entropy`. This is
    the PyTorch reference for the fused kernel. ``logits_scaling`` (Granite's) divides the logits, as
    ``hidden / logits_scaling`` does before the projection.
    """
    _check_shapes("hidden", hidden, labels)
    if logits_scaling != 1.0:
        hidden = hidden / logits_scaling
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden.shape[-1]}] to match hidden, got {tuple(lm_head_weight.shape)}"
        )
    targets = labels[:, 1:].reshape(-1)
    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    n_tokens = (targets != IGNORE_INDEX).sum()
    loss_and_grads = functools.partial(_chunk_loss_and_grads, softcap=softcap)
    if torch.is_grad_enabled() and (flat.requires_grad or lm_head_weight.requires_grad):
        return GradsInForward.apply(flat, lm_head_weight, targets, chunk_size, loss_and_grads), n_tokens
    loss_sum, _, _ = loss_and_grads(flat, lm_head_weight, targets, chunk_size, False, False)
    return loss_sum, n_tokens


def token_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(label)`` of each row of ``hidden`` [N, H] under the head ``weight`` [V, H], as fp32 [N]; 0 where the
    label is ``IGNORE_INDEX``. Labels are next-token targets, already shifted.

    The specification of :func:`entrenar.kernels.token_logprobs.token_logprobs` (``log_softmax`` and ``gather`` over
    the full ``[N, V]`` logits; the kernel never holds them)."""
    valid = labels != IGNORE_INDEX
    logits = (hidden @ weight.T).float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    return picked * valid
