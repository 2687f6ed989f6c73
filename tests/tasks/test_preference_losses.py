"""The preference losses against TRL 1.16's own loss code on identical per-token log-probabilities.

TRL's trainers are not constructed (that needs a dataset pipeline and a model per trainer); their loss methods
are called on a stand-in ``self`` holding exactly the attributes they read, with a stand-in model whose output
carries the per-token log-probabilities. Losses, the logged rewards and the gradients with respect to those
log-probabilities are compared, which pins the loss, its reduction and every metric TRL logs.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from entrenar.tasks.preference import losses

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_kto = pytest.importorskip("trl.trainer.kto_trainer")
trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")

P, T = 3, 9  # pairs, tokens per row
_ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)


def _token_logps(rows: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities [rows, T - 1] (a leaf) and the completion mask [rows, T] (prompts of several
    lengths, completions of several lengths, right padding)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, T, dtype=torch.long)
    for r in range(rows):
        start = 2 + r % 3
        mask[r, start:start + 2 + (r * 5) % 5] = 1
    logps = (-torch.rand(rows, T - 1, generator=g, dtype=dtype) * 3).requires_grad_()
    return logps, mask


def _ours_sums(logps: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shifted = mask[:, 1:].to(logps.dtype)
    return (logps * shifted).sum(1), shifted.sum(1)


def _fake_model(logps: torch.Tensor, mask: torch.Tensor):
    """What TRL's fused LM head returns: per-token log-probabilities, 0 where the label is -100."""
    def model(**kwargs):
        n, t = kwargs["input_ids"].shape
        zeros = torch.zeros(n, t - 1, dtype=logps.dtype)
        return SimpleNamespace(log_probs=logps * mask[:, 1:], entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    model.training = True
    return model


def _trl_dpo(loss_type: str, beta: float, logps: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor,
             label_smoothing: float = 0.0):
    model = _fake_model(logps, mask)
    self = SimpleNamespace(model=model, accelerator=_ACCELERATOR, aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
                           _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    rows = logps.shape[0]
    inputs = {"input_ids": torch.zeros(rows, T, dtype=torch.long), "attention_mask": torch.ones(rows, T),
              "completion_mask": mask, "ref_chosen_logps": ref[: rows // 2], "ref_rejected_logps": ref[rows // 2:]}
    loss = trl_dpo.DPOTrainer._compute_loss(self, model, inputs, False)
    return loss, {k: v[-1] for k, v in self._metrics["train"].items()}


def _ours_metrics(chosen_rewards, rejected_rewards, chosen, rejected):
    return {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}


def _check(ours_loss, ours_logps, trl_loss, trl_logps, ours_metrics, trl_metrics):
    torch.testing.assert_close(ours_loss, trl_loss.to(ours_loss.dtype))
    (ours_grad,) = torch.autograd.grad(ours_loss, ours_logps)
    (trl_grad,) = torch.autograd.grad(trl_loss, trl_logps)
    torch.testing.assert_close(ours_grad, trl_grad)
    for key, value in ours_metrics.items():
        assert trl_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key  # TRL takes accuracies in fp32


@pytest.mark.parametrize("label_smoothing", [0.0])
def test_dpo_equals_trl_dpo_sigmoid(label_smoothing):
    logps, mask = _token_logps(2 * P)
    ref = -torch.rand(2 * P, dtype=torch.float64) * 10
    trl_loss, trl_metrics = _trl_dpo("sigmoid", 0.1, logps, mask, ref)
    ours_logps = logps.detach().clone().requires_grad_()
    sums, _ = _ours_sums(ours_logps, mask)
    per_pair, cr, rr = losses.dpo(sums[:P], sums[P:], ref[:P], ref[P:], 0.1, label_smoothing)
    _check(per_pair.sum() / P, ours_logps, trl_loss, logps, _ours_metrics(cr, rr, sums[:P], sums[P:]), trl_metrics)


def test_conservative_dpo_equals_the_cdpo_form_of_trl_cpo():
    """TRL 1.16's DPO sigmoid ignores label_smoothing; its CPOTrainer's sigmoid keeps the cDPO form, which with the
    policy-minus-reference log-ratios is conservative DPO."""
    g = torch.Generator().manual_seed(1)
    chosen, rejected = -torch.rand(P, generator=g, dtype=torch.float64) * 9, -torch.rand(P, generator=g) * 9
    ref_c, ref_r = -torch.rand(P, generator=g, dtype=torch.float64) * 9, -torch.rand(P, generator=g) * 9
    self = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=0.2, label_smoothing=0.15, accelerator=_ACCELERATOR)
    theirs, _, _ = trl_cpo.CPOTrainer.cpo_loss(self, chosen - ref_c, rejected.double() - ref_r.double())
    ours, _, _ = losses.dpo(chosen, rejected.double(), ref_c, ref_r.double(), 0.2, 0.15)
    torch.testing.assert_close(ours, theirs)


def test_ipo_equals_trl_dpo_ipo():
    logps, mask = _token_logps(2 * P, seed=2)
    ref = -torch.rand(2 * P, dtype=torch.float64) * 10
    trl_loss, trl_metrics = _trl_dpo("ipo", 0.3, logps, mask, ref)
    ours_logps = logps.detach().clone().requires_grad_()
    sums, counts = _ours_sums(ours_logps, mask)
    # TRL normalises by the unshifted completion mask's count: the same tokens here (none at the row start).
    per_pair, cr, rr = losses.ipo(sums[:P], sums[P:], ref[:P], ref[P:], counts[:P], counts[P:], 0.3)
    _check(per_pair.sum() / P, ours_logps, trl_loss, logps, _ours_metrics(cr, rr, sums[:P], sums[P:]), trl_metrics)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_simpo(label_smoothing):
    logps, mask = _token_logps(2 * P, seed=3)
    sums, counts = _ours_sums(logps, mask)
    avg = sums / counts
    self = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=label_smoothing,
                           accelerator=_ACCELERATOR)
    theirs, tc, tr = trl_cpo.CPOTrainer.cpo_loss(self, avg[:P], avg[P:])
    trl_loss = theirs.mean() + 0.0 * 0  # cpo_alpha = 0: no NLL term
    ours_logps = logps.detach().clone().requires_grad_()
    osums, ocounts = _ours_sums(ours_logps, mask)
    oavg = osums / ocounts
    per_pair, cr, rr = losses.simpo(oavg[:P], oavg[P:], 2.0, 0.5, label_smoothing)
    torch.testing.assert_close(cr, tc)
    torch.testing.assert_close(rr, tr)
    _check(per_pair.sum() / P, ours_logps, trl_loss, logps, {}, {})


def test_orpo_equals_trl_orpo_with_equal_chosen_lengths():
    logps, mask = _token_logps(2 * P, seed=4, dtype=torch.float32)  # TRL's odds ratio runs in fp32
    mask[:P] = mask[0]  # chosen completions of one length: TRL's batch token mean is then the per-pair mean
    sums, counts = _ours_sums(logps, mask)
    avg = sums / counts
    self = SimpleNamespace(beta=0.25, accelerator=_ACCELERATOR)
    theirs, tc, tr, _, _ = trl_orpo.ORPOTrainer.odds_ratio_loss(self, avg[:P], avg[P:])
    nll = -(sums[:P].sum() / counts[:P].sum())  # TRL: cross-entropy mean over the batch's chosen tokens
    trl_loss = nll - theirs.mean()
    ours_logps = logps.detach().clone().requires_grad_()
    osums, ocounts = _ours_sums(ours_logps, mask)
    oavg = osums / ocounts
    per_pair, cr, rr = losses.orpo(oavg[:P], oavg[P:], -oavg[:P], 0.25)
    torch.testing.assert_close(cr, tc)
    torch.testing.assert_close(rr, tr)
    _check(per_pair.sum() / P, ours_logps, trl_loss, logps, {}, {})


def test_orpo_log1mexp_is_trls():
    x = -torch.logspace(-8, 2, 200, dtype=torch.float64)
    torch.testing.assert_close(losses._log1mexp(x), trl_orpo.log1mexp(x))


def test_kto_equals_trl_kto():
    n = 5
    logps, mask = _token_logps(n, seed=5)
    desirable = torch.tensor([True, False, True, True, False])
    ref = -torch.rand(n, dtype=torch.float64) * 6
    kl_logps, ref_kl = -torch.rand(n, dtype=torch.float64) * 6, -torch.rand(n, dtype=torch.float64) * 6
    kl_logps[0] += 4  # a positive mean log-ratio: the clamp at 0 does not hide the reference point
    model = _fake_model(logps, mask)
    self = SimpleNamespace(model=model, accelerator=_ACCELERATOR, aux_loss_enabled=False, precompute_ref_logps=True,
                           calculate_KL=True, loss_type="kto", beta=0.1, desirable_weight=1.3,
                           undesirable_weight=0.7, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1, _compute_kl_logps=lambda model, batch: kl_logps)
    inputs = {"input_ids": torch.zeros(n, T, dtype=torch.long), "attention_mask": torch.ones(n, T),
              "completion_mask": mask, "label": desirable, "ref_logps": ref, "ref_KL_logps": ref_kl}
    trl_loss = trl_kto.KTOTrainer._compute_loss(self, model, inputs, False)
    metrics = {k: v[-1] for k, v in self._metrics["train"].items()}
    ours_logps = logps.detach().clone().requires_grad_()
    sums, _ = _ours_sums(ours_logps, mask)
    z = losses.kto_reference_point(kl_logps, ref_kl)
    assert float(z) == pytest.approx(metrics["kl"]) and float(z) > 0
    per_example, cr, rr = losses.kto(sums, ref, desirable, z, 0.1, 1.3, 0.7)
    ours = {"rewards/chosen": cr.mean().item(), "rewards/rejected": rr.mean().item(),
            "rewards/margins": cr.mean().item() - rr.mean().item(),
            "logps/chosen": sums[desirable].mean().item(), "logps/rejected": sums[~desirable].mean().item()}
    _check(per_example.sum() / n, ours_logps, trl_loss, logps, ours, metrics)
