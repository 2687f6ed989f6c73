"""Classification and regression metrics against scikit-learn (and formulas by hand) on random predictions."""

from __future__ import annotations

import numpy as np
import pytest

from entrenar.evaluation import metrics as M
from entrenar.evaluation.report import build_report, write_report

sk = pytest.importorskip("sklearn.metrics")


def random_case(seed: int, n: int = 300, c: int = 4):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)) * 2
    y = rng.integers(0, c, n)
    logits[np.arange(n), y] += 1.5  # better than chance, not perfect
    return y, M.softmax(logits), logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_label_metrics_equal_scikit_learn(seed):
    y, probs, _ = random_case(seed)
    pred = probs.argmax(1)
    got = M.single_label(y, probs)
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(y, pred))
    assert got["macro_f1"] == pytest.approx(sk.f1_score(y, pred, average="macro"))
    assert got["weighted_f1"] == pytest.approx(sk.f1_score(y, pred, average="weighted"))
    assert got["mcc"] == pytest.approx(sk.matthews_corrcoef(y, pred))
    assert got["kappa"] == pytest.approx(sk.cohen_kappa_score(y, pred))
    assert got["log_loss"] == pytest.approx(sk.log_loss(y, probs, labels=range(4)))
    assert got["top2_accuracy"] == pytest.approx(sk.top_k_accuracy_score(y, probs, k=2, labels=range(4)))
    assert got["top3_accuracy"] == pytest.approx(sk.top_k_accuracy_score(y, probs, k=3, labels=range(4)))
    np.testing.assert_array_equal(got["confusion"], sk.confusion_matrix(y, pred, labels=range(4)))
    p, r, f, s = sk.precision_recall_fscore_support(y, pred, labels=range(4), zero_division=0)
    for key, ref in (("precision", p), ("recall", r), ("f1", f), ("support", s)):
        np.testing.assert_allclose(got["per_class"][key], ref)
    # Brier: sum over classes of squared error, mean over rows (scikit-learn's multiclass form, scale_by_half off).
    one_hot = np.eye(4)[y]
    assert got["brier"] == pytest.approx(((probs - one_hot) ** 2).sum(1).mean())
    try:
        assert got["brier"] == pytest.approx(sk.brier_score_loss(y, probs, labels=range(4), scale_by_half=False))
    except TypeError:  # scikit-learn before 1.7: binary only
        assert M.brier(y % 2, np.stack([1 - probs[:, 0], probs[:, 0]], 1)) == pytest.approx(
            2 * sk.brier_score_loss(y % 2, probs[:, 0]))


def test_missing_class_and_zero_division_follow_scikit_learn():
    y = np.array([0, 0, 1, 1, 2])
    probs = np.eye(4)[[0, 1, 1, 1, 0]] * 0.7 + 0.075
    pred = probs.argmax(1)
    got = M.single_label(y, probs)
    assert got["macro_f1"] == pytest.approx(sk.f1_score(y, pred, labels=range(4), average="macro", zero_division=0))
    assert got["mcc"] == pytest.approx(sk.matthews_corrcoef(y, pred))


def test_ece_and_mce_by_hand():
    # 15 bins (lo, hi]: confidences 0.95 (bin 14, 2 rows: 1 right), 0.5 (bin 7, 2 rows: both right).
    probs = np.array([[0.95, 0.05], [0.95, 0.05], [0.5, 0.5], [0.5, 0.5]])
    y = np.array([0, 1, 0, 0])
    ece, mce = M.ece_mce(y, probs)
    assert ece == pytest.approx((2 * abs(0.5 - 0.95) + 2 * abs(1.0 - 0.5)) / 4)
    assert mce == pytest.approx(0.5)
    assert np.ceil(0.5 * 15) - 1 == 7 and M.calibration_bins(y, probs)["count"][7] == 2


def test_multi_label_metrics_equal_scikit_learn():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, (200, 5))
    probs = np.clip(y * 0.4 + rng.uniform(0, 0.6, y.shape), 0, 1)
    th = np.array([0.3, 0.4, 0.5, 0.6, 0.7])
    pred = (probs >= th).astype(int)
    got = M.multi_label(y, probs, th)
    assert got["micro_f1"] == pytest.approx(sk.f1_score(y, pred, average="micro"))
    assert got["macro_f1"] == pytest.approx(sk.f1_score(y, pred, average="macro"))
    assert got["subset_accuracy"] == pytest.approx(sk.accuracy_score(y, pred))
    assert got["hamming_loss"] == pytest.approx(sk.hamming_loss(y, pred))
    np.testing.assert_allclose(got["per_label_f1"], sk.f1_score(y, pred, average=None))
    tuned = M.tune_thresholds(y, probs)
    assert M.multi_label(y, probs, tuned)["macro_f1"] >= got["macro_f1"]


@pytest.mark.parametrize("targets", [1, 3])
def test_regression_metrics_equal_scikit_learn(targets):
    rng = np.random.default_rng(targets)
    y = rng.normal(size=(100, targets))
    pred = y + rng.normal(size=y.shape) * 0.5
    pred[:5] = pred[5]  # ties for the ranks
    got = M.regression(y, pred)
    rmse = np.mean([np.sqrt(sk.mean_squared_error(y[:, j], pred[:, j])) for j in range(targets)])
    assert got["rmse"] == pytest.approx(rmse)
    assert got["mae"] == pytest.approx(sk.mean_absolute_error(y, pred))
    assert got["r2"] == pytest.approx(sk.r2_score(y, pred))
    from scipy.stats import spearmanr  # scikit-learn depends on scipy

    rho = np.mean([spearmanr(y[:, j], pred[:, j]).statistic for j in range(targets)])
    assert got["spearman"] == pytest.approx(rho)


def test_temperature_scaling_minimises_log_loss_and_keeps_accuracy():
    y, _, logits = random_case(3)
    overconfident = logits * 4
    t = M.fit_temperature(overconfident, y)
    assert t > 1
    best = M.log_loss(y, M.softmax(overconfident, t))
    for other in (t * 0.9, t * 1.1):
        assert best < M.log_loss(y, M.softmax(overconfident, other))
    assert (M.softmax(overconfident, t).argmax(1) == overconfident.argmax(1)).all()
    assert M.ece_mce(y, M.softmax(overconfident, t))[0] < M.ece_mce(y, M.softmax(overconfident))[0]


def test_bootstrap_is_seeded_and_covers_the_estimate():
    y, probs, _ = random_case(4)
    pred = probs.argmax(1)
    fn = lambda i: float((pred[i] == y[i]).mean())  # noqa: E731
    lo, hi = M.bootstrap_ci(fn, len(y), 500, seed=7)
    assert (lo, hi) == M.bootstrap_ci(fn, len(y), 500, seed=7)
    assert lo < fn(np.arange(len(y))) < hi


def test_report_files(tmp_path):
    y, _, logits = random_case(5)
    report = build_report("single_label", logits * 3, y, ["a", "b", "c", "d"], {"temperature": 2.0}, source="test")
    paths = write_report(report, tmp_path)
    assert {p.name for p in paths} == {"report.json", "report.md", "confusion_matrix.png", "reliability.png"}
    assert report["metrics"]["accuracy"] == report["uncalibrated"]["accuracy"]
    assert "15 equal-width" in (tmp_path / "report.md").read_text()
    assert set(report["headline"]) == {"accuracy", "macro_f1", "ece"}
