"""The preference losses, per pair (or per example for KTO), from sequence log-probabilities.

Each function takes per-sequence log-probabilities of the completion tokens (summed, or averaged over the
completion's tokens where the loss is length-normalised) and returns ``(losses, chosen_rewards,
rejected_rewards)``, one value per pair; the task sums ``losses`` and the training step divides by the step's pairs,
so gradient accumulation gives one large batch's mean, as TRL's ``losses.mean()`` over a batch. The rewards are
what TRL logs as ``rewards/chosen`` and ``rewards/rejected`` (detached).

Semantics follow TRL 1.16 (``trl/trainer/dpo_trainer.py``, ``trl/experimental/cpo``, ``trl/experimental/orpo``,
``trl/trainer/kto_trainer.py``); where they differ it is said at the function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Losses = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (losses, chosen_rewards, rejected_rewards), per pair


def dpo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        beta: float, label_smoothing: float = 0.0) -> Losses:
    """DPO (Rafailov et al., 2023), the sigmoid loss ``-log sigmoid(beta * (chosen_logratio - rejected_logratio))``
    on summed log-probabilities; ``label_smoothing`` eps > 0 is conservative DPO (cDPO, Mitchell 2023): the label is
    flipped with probability eps, ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)``.

    Differs from TRL 1.16: its ``loss_type="sigmoid"`` ignores ``label_smoothing`` (TRL moved smoothing to its
    ``robust`` and ``exo_pair`` losses); this is the cDPO form TRL's sigmoid loss had before, and CPOTrainer's
    sigmoid still has. With ``label_smoothing`` 0 (the default) the two are the same."""
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    delta = beta * (chosen_logratios - rejected_logratios)
    losses = -F.logsigmoid(delta) * (1 - label_smoothing) - F.logsigmoid(-delta) * label_smoothing
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def ipo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, beta: float) -> Losses:
    """IPO (Azar et al., 2023, eq. 17): ``(h - 1 / (2 beta))**2`` with ``h`` the difference of the log-ratios, each
    averaged over its completion's tokens, as TRL 1.16 (which confirmed the normalisation with the authors); the
    rewards are ``beta`` times the summed log-ratios, as TRL logs them."""
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    h = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
    losses = (h - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def simpo(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float, gamma: float,
          label_smoothing: float = 0.0) -> Losses:
    """SimPO (Meng et al., 2024): reference-free, on log-probabilities averaged over the completion's tokens,
    ``-log sigmoid(beta * (chosen_avg - rejected_avg) - gamma)`` (with CPO's label smoothing), exactly TRL's
    CPOTrainer with ``loss_type="simpo"`` and ``cpo_alpha=0``; rewards are ``beta`` times the averages."""
    logits = (chosen_avg - rejected_avg) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (Maechler 2012), as TRL's ``log1mexp``."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, chosen_nll: torch.Tensor, beta: float) -> Losses:
    """ORPO (Hong et al., 2024): ``nll - beta * log sigmoid(log odds(chosen) - log odds(rejected))``, reference-free,
    with log-probabilities averaged over the completion's tokens (``odds(p) = p / (1 - p)``), rewards ``beta`` times
    the averages, as TRL's ORPOTrainer (``beta`` is the paper's lambda).

    ``chosen_nll`` is the SFT term per pair: the chosen completion's mean token negative log-likelihood (the paper's
    per-example average). TRL takes one token mean over the whole micro-batch's chosen tokens instead, which weights
    pairs by their length and depends on how pairs are grouped into micro-batches; the two agree when the chosen
    completions of a batch have the same length."""
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
    losses = chosen_nll - beta * F.logsigmoid(log_odds)
    return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()


def kto(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
        desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Losses:
    """KTO (Ethayarajh et al., 2024, eq. 7) per example: ``w_d (1 - sigmoid(beta (r - z)))`` for a desirable one,
    ``w_u (1 - sigmoid(beta (z - r)))`` for an undesirable one, ``r`` its log-ratio to the reference and ``z`` the
    reference point: the detached, clamped-at-0 mean log-ratio of mismatched (prompt, completion) pairs of the
    micro-batch (:func:`kto_reference_point`), as TRL's KTOTrainer. Returns (losses, rewards of the desirable
    examples, rewards of the undesirable ones)."""
    losses, rewards = kto_losses(logps, ref_logps, desirable, kl, beta, desirable_weight, undesirable_weight)
    return losses, rewards[desirable], rewards[~desirable]


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kto`'s losses and every example's reward, without selecting by ``desirable`` (a shape that depends
    on the data, which a CUDA graph cannot replay)."""
    logratios = logps - ref_logps
    z = kl.detach()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - logratios))))
    return losses, beta * logratios.detach()


def kto_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's ``z``: the mean log-ratio of the mismatched pairs, detached and clamped at 0 (TRL's estimate over one
    micro-batch; in a distributed run TRL averages it over the ranks, here each rank keeps its own)."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


LOSSES = ("dpo", "ipo", "simpo", "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")  # no reference model
LENGTH_NORMALISED = ("simpo", "orpo")  # log-probabilities averaged over the completion's tokens

__all__ = ["LENGTH_NORMALISED", "LOSSES", "REFERENCE_FREE", "Losses", "dpo", "ipo", "kto", "kto_losses",
           "kto_reference_point", "orpo", "simpo"]
