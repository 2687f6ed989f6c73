"""Attention with sinks (gpt-oss): a learned logit per head that every query's softmax counts in its denominator.

``softmax([q k^T / sqrt(d), sink])`` with the sink's column dropped: the weights over the keys sum to less than one,
the rest going to no value at all. No SDPA or FlashAttention kernel of this PyTorch takes sinks, so this is the
products as transformers' eager path computes them (scores and softmax in fp32), used by the padded path, the
KV-cache path and, document by document, the padding-free path.
"""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], k and v [B, Hk, S, D], sinks [Hq] -> [B, Hq, T, D].

    ``mask`` (bool, broadcast to [B, 1, T, S]; True where a query may attend) or, when None, causal attention with
    the last query at the last key, limited to ``window`` latest positions (itself included) if given.
    """
    b, hq, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    if hq != hk:
        k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * d**-0.5
    if mask is None:
        q_pos = torch.arange(s - t, s, device=q.device)[:, None]
        k_pos = torch.arange(s, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (q_pos - k_pos < window)
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().view(1, hq, 1, 1).expand(b, hq, t, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
