"""Which attention computes a layer's scores: the one dispatch shared by every attention module.

:class:`entrenar.models.transformer.Attention` (the Llama family and the families that are its flags) and
:class:`entrenar.models.mla.LatentAttention` (DeepSeek-V3) make their queries, keys and values their own way, then
both call :func:`attention`: a padding-free or packed row (:class:`~entrenar.models.padding_free.Documents`) goes
document by document (FlashAttention's variable-length kernel, SDPA or the CPU's explicit products), gpt-oss's sinks
and Gemma's soft-capped scores go through explicit products (no SDPA kernel takes them), everything else through SDPA
under the model's mask (None: causal).
"""

from __future__ import annotations

import torch

from entrenar.models.attention_sinks import sink_attention
from entrenar.models.cpu_attention import capped_attention
from entrenar.models.padding_free import Documents, documents_attention, sdpa


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Documents | None,
    window: int | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q ``[B, Hq, T, D]`` over k, v ``[B, Hk, S, D]`` (``Hq`` a multiple of ``Hk``; v's head size may
    differ, as MLA's) -> ``[B, T, Hq x Dv]``, the heads joined as ``o_proj`` reads them.

    ``mask``: a boolean ``[B or 1, 1, T, S]`` (True: attend), None for causal attention (``S == T``), or
    :class:`~entrenar.models.padding_free.Documents`; ``window``: the layer's sliding window (the mask already
    holds it, except for documents and sinks' causal case); ``scale`` None is ``D ** -0.5``; ``softcap``: Gemma's
    cap on the scores; ``sinks`` ``[Hq]``: gpt-oss's per-head sink logits (their scale is always ``D ** -0.5``).
    """
    b, t = q.shape[0], q.shape[2]
    if isinstance(mask, Documents):  # a padding-free row
        y = documents_attention(q, k, v, mask, window, scale=scale, softcap=softcap, sinks=sinks)
        return y.reshape(b, t, -1)
    if sinks is not None:  # no SDPA kernel takes sinks: the products, as transformers' eager path
        y = sink_attention(q, k, v, sinks, mask, window)
    elif softcap is not None:  # SDPA cannot cap the scores: explicit products
        y = capped_attention(q, k, v, mask, scale, softcap)
    else:
        y = sdpa(q, k, v, mask, scale)
    return y.transpose(1, 2).reshape(b, t, -1)
