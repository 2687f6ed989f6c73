"""A preference batch scored: per-pair (KTO: per-example) losses from its sequence log-probabilities, and TRL's
metrics of them added to the step's sums.

The log-probabilities come from :func:`~entrenar.tasks.preference.logprobs.sequence_logprobs` (the policy's) and
the reference (:mod:`.reference`); the losses are :mod:`.losses`'. A batch in the fixed layout CUDA graphs replay
(``pair_mask``) weighs every pair, a padded one by zero, and selects none (no shape that depends on the data).
"""

from __future__ import annotations

import torch

from entrenar.config.sections import TaskSection
from entrenar.tasks.base import Batch
from entrenar.tasks.preference import losses as L
from entrenar.tasks.preference.metrics import MetricSums


def batch_losses(task: TaskSection, batch: Batch, logps: torch.Tensor, tokens: torch.Tensor,
                 ref: tuple[torch.Tensor, torch.Tensor] | None, sums: MetricSums) -> torch.Tensor:
    """The per-pair (per-example) losses of ``task.loss`` for a batch whose sequences have the summed completion
    log-probabilities ``logps`` over ``tokens`` tokens (``ref``: the reference's (sums, tokens); None for a
    reference-free loss), their metrics added to ``sums``."""
    w = batch.get("pair_mask")  # the fixed layout (CUDA graphs): 1 for a real pair, 0 for a padded one
    if w is not None:
        w = w.to(logps.device)
        keep = (torch.cat([w, w]) if task.loss == "kto" else w[:, None].expand(-1, 2).reshape(-1)) > 0
        # a padded pair's sequences are empty: finite stand-ins keep its (zero-weighted) loss finite
        logps, tokens = torch.where(keep, logps, -1.0), torch.where(keep, tokens, 1.0)
        if ref is not None:
            ref = (torch.where(keep, ref[0], -1.0), ref[1])
    if task.loss == "kto":
        return _kto(task, batch, logps, ref, sums, w)
    chosen, rejected = logps[0::2], logps[1::2]
    if task.loss == "dpo":
        assert ref is not None
        per_pair, cr, rr = L.dpo(chosen, rejected, ref[0][0::2], ref[0][1::2], task.beta, task.label_smoothing)
    elif task.loss == "ipo":
        assert ref is not None
        per_pair, cr, rr = L.ipo(chosen, rejected, ref[0][0::2], ref[0][1::2], tokens[0::2], tokens[1::2],
                                 task.beta)
    else:
        avg = logps / tokens.clamp(min=1)
        chosen, rejected = avg[0::2], avg[1::2]  # TRL logs these averages as logps/ for SimPO and ORPO
        if task.loss == "simpo":
            per_pair, cr, rr = L.simpo(chosen, rejected, task.beta, task.simpo_gamma, task.label_smoothing)
        else:
            per_pair, cr, rr = L.orpo(chosen, rejected, -chosen, task.beta)
            sums.add("nll_loss", -chosen, w)
    sums.add("rewards/chosen", cr, w)
    sums.add("rewards/rejected", rr, w)
    sums.add("rewards/accuracies", (cr > rr).float(), w)
    sums.add("rewards/margins", cr - rr, w)
    sums.add("logps/chosen", chosen, w)
    sums.add("logps/rejected", rejected, w)
    return per_pair if w is None else per_pair * w


def _kto(task: TaskSection, batch: Batch, logps: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor] | None,
         sums: MetricSums, w: torch.Tensor | None = None) -> torch.Tensor:
    """KTO's per-example losses: the batch's n examples, then their mismatched sequences (prompt k with completion
    k-1), which estimate the reference point z."""
    assert ref is not None
    desirable = batch["desirable"].to(logps.device).bool()
    n = int(batch["kl_offset"])
    if w is not None:  # the fixed layout: every example weighed, none selected (no data-dependent shape)
        z = ((logps[n:].detach() - ref[0][n:]) * w).sum().div(w.sum()).detach().clamp(min=0)
        logps = logps[:n]
        per_example, rewards = L.kto_losses(logps, ref[0][:n], desirable, z, task.beta, task.desirable_weight,
                                            task.undesirable_weight)
        good, bad = desirable.float() * w, (~desirable).float() * w
        sums.add("kl", z)
        sums.add("rewards/chosen", rewards, good)
        sums.add("rewards/rejected", rewards, bad)
        sums.add("logps/chosen", logps, good)
        sums.add("logps/rejected", logps, bad)
        return per_example * w
    z = L.kto_reference_point(logps[n:].detach(), ref[0][n:])
    logps = logps[:n]
    per_example, cr, rr = L.kto(logps, ref[0][:n], desirable, z, task.beta, task.desirable_weight,
                                task.undesirable_weight)
    sums.add("kl", z)
    sums.add("rewards/chosen", cr)
    sums.add("rewards/rejected", rr)
    sums.add("logps/chosen", logps[desirable])
    sums.add("logps/rejected", logps[~desirable])
    return per_example


__all__ = ["batch_losses"]
