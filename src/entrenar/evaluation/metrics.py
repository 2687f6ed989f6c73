"""Classification and regression metrics on numpy arrays, as scikit-learn defines them.

Every function takes plain arrays (integer class ids, probabilities, 0/1
label matrices or real targets) and returns floats or arrays; the tests check
each against scikit-learn. Calibration uses ``ECE_BINS`` equal-width bins of
the top-class confidence over [0, 1], each bin (lo, hi] (the first also takes 0).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ECE_BINS = 15


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts [true, predicted]."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (np.asarray(y_true), np.asarray(y_pred)), 1)
    return matrix


def _safe_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b is 0 (scikit-learn's zero_division=0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def per_class(matrix: np.ndarray) -> dict[str, np.ndarray]:
    """Precision, recall, F1 and support of each class from a confusion matrix."""
    tp = np.diag(matrix).astype(np.float64)
    predicted, support = matrix.sum(0), matrix.sum(1)
    precision, recall = _safe_divide(tp, predicted), _safe_divide(tp, support)
    f1 = _safe_divide(2 * tp, predicted + support)
    return {"precision": precision, "recall": recall, "f1": f1, "support": support}


def mcc(matrix: np.ndarray) -> float:
    """Matthews correlation coefficient, multiclass (Gorodkin's R_K, as scikit-learn)."""
    m = matrix.astype(np.float64)
    t, p = m.sum(1), m.sum(0)
    c, s = np.trace(m), m.sum()
    denominator = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denominator) if denominator > 0 else 0.0


def cohen_kappa(matrix: np.ndarray) -> float:
    m = matrix.astype(np.float64)
    n = m.sum()
    observed = np.trace(m) / n
    expected = (m.sum(0) @ m.sum(1)) / (n * n)
    return float((observed - expected) / (1 - expected)) if expected != 1 else 0.0


def top_k_accuracy(y_true: np.ndarray, probs: np.ndarray, k: int) -> float:
    """Share of rows whose true class is among the k most probable (ties broken by class order)."""
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return float((top == np.asarray(y_true)[:, None]).any(1).mean())


def calibration_bins(y_true: np.ndarray, probs: np.ndarray, bins: int = ECE_BINS) -> dict[str, np.ndarray]:
    """Per bin of top-class confidence: count, mean confidence, accuracy."""
    confidence = probs.max(1)
    correct = (probs.argmax(1) == np.asarray(y_true)).astype(np.float64)
    index = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)  # (lo, hi]
    count = np.bincount(index, minlength=bins).astype(np.float64)
    return {
        "count": count,
        "confidence": _safe_divide(np.bincount(index, confidence, bins), count),
        "accuracy": _safe_divide(np.bincount(index, correct, bins), count),
    }


def ece_mce(y_true: np.ndarray, probs: np.ndarray, bins: int = ECE_BINS) -> tuple[float, float]:
    """Expected (count-weighted mean) and maximum calibration gap |accuracy - confidence| over the bins."""
    b = calibration_bins(y_true, probs, bins)
    gap = np.abs(b["accuracy"] - b["confidence"])
    used = b["count"] > 0
    return float((gap * b["count"]).sum() / b["count"].sum()), float(gap[used].max())


def brier(y_true: np.ndarray, probs: np.ndarray) -> float:
    """Mean over rows of sum over classes of (p - one_hot)^2 (scikit-learn's multiclass Brier score)."""
    one_hot = np.eye(probs.shape[1])[np.asarray(y_true)]
    return float(((probs - one_hot) ** 2).sum(1).mean())


def log_loss(y_true: np.ndarray, probs: np.ndarray) -> float:
    """Mean negative log probability of the true class (probabilities clipped at float64 eps, as scikit-learn)."""
    p = np.clip(probs[np.arange(len(probs)), np.asarray(y_true)], np.finfo(np.float64).eps, 1.0)
    return float(-np.log(p).mean())


def single_label(y_true: np.ndarray, probs: np.ndarray) -> dict:
    """Every single-label metric of the report (probabilities [N, C])."""
    y_true = np.asarray(y_true)
    c = probs.shape[1]
    y_pred = probs.argmax(1)
    matrix = confusion_matrix(y_true, y_pred, c)
    pc = per_class(matrix)
    support = pc["support"]
    ece, mce = ece_mce(y_true, probs)
    out = {
        "accuracy": float((y_true == y_pred).mean()),
        "macro_f1": float(pc["f1"].mean()),
        "weighted_f1": float((pc["f1"] * support).sum() / support.sum()),
        "mcc": mcc(matrix),
        "kappa": cohen_kappa(matrix),
        "ece": ece,
        "mce": mce,
        "brier": brier(y_true, probs),
        "log_loss": log_loss(y_true, probs),
        "per_class": {k: v.tolist() for k, v in pc.items()},
        "confusion": matrix.tolist(),
    }
    for k in (2, 3, 5):
        if k < c:
            out[f"top{k}_accuracy"] = top_k_accuracy(y_true, probs, k)
    return out


def multi_label(y_true: np.ndarray, probs: np.ndarray, thresholds: np.ndarray) -> dict:
    """Multi-label metrics of 0/1 targets [N, L] against probabilities cut at per-label thresholds."""
    y_true = np.asarray(y_true).astype(bool)
    y_pred = probs >= np.asarray(thresholds)[None, :]
    tp = (y_true & y_pred).sum(0).astype(np.float64)
    fp, fn = (~y_true & y_pred).sum(0), (y_true & ~y_pred).sum(0)
    f1 = _safe_divide(2 * tp, 2 * tp + fp + fn)
    micro = float(_safe_divide(2 * tp.sum(), 2 * tp.sum() + fp.sum() + fn.sum()))
    return {
        "micro_f1": micro,
        "macro_f1": float(f1.mean()),
        "subset_accuracy": float((y_true == y_pred).all(1).mean()),
        "hamming_loss": float((y_true != y_pred).mean()),
        "per_label_f1": f1.tolist(),
        "support": y_true.sum(0).tolist(),
    }


def tune_thresholds(y_true: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per label, the threshold (among the probabilities seen, and 0.5) that maximises that label's F1."""
    y_true = np.asarray(y_true).astype(bool)
    best = np.full(probs.shape[1], 0.5)
    for j in range(probs.shape[1]):
        scores = []
        for t in np.unique(np.concatenate([probs[:, j], [0.5]])):
            pred = probs[:, j] >= t
            tp = float((pred & y_true[:, j]).sum())
            denominator = float(pred.sum() + y_true[:, j].sum())
            scores.append((2 * tp / denominator if denominator else 0.0, -abs(t - 0.5), t))
        best[j] = max(scores)[2]
    return best


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their ranks), as scipy.stats.rankdata."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    values, inverse = np.unique(x, return_inverse=True)
    sums = np.bincount(inverse, ranks)
    counts = np.bincount(inverse)
    return (sums / counts)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = _ranks(np.asarray(a)), _ranks(np.asarray(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else 0.0


def regression(y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    """RMSE, MAE, R^2 and Spearman's rho; with several targets, each averaged over targets uniformly."""
    y_true = np.asarray(y_true, dtype=np.float64).reshape(len(y_true), -1)
    y_pred = np.asarray(y_pred, dtype=np.float64).reshape(len(y_pred), -1)
    error = y_pred - y_true
    total = ((y_true - y_true.mean(0)) ** 2).sum(0)
    r2 = np.where(total > 0, 1 - (error**2).sum(0) / np.where(total > 0, total, 1), 0.0)
    return {
        "rmse": float(np.sqrt((error**2).mean(0)).mean()),
        "mae": float(np.abs(error).mean()),
        "r2": float(r2.mean()),
        "spearman": float(np.mean([spearman(y_true[:, j], y_pred[:, j]) for j in range(y_true.shape[1])])),
    }


def bootstrap_ci(
    metric: Callable[[np.ndarray], float], n: int, samples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``metric(indices)`` over ``samples`` resamples of n rows (seeded)."""
    rng = np.random.default_rng(seed)
    values = np.array([metric(rng.integers(0, n, n)) for _ in range(samples)])
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits / temperature
    z = z - z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def sigmoid(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits / temperature))


def fit_temperature(logits: np.ndarray, y_true: np.ndarray) -> float:
    """The temperature T > 0 minimising the log loss of softmax(logits / T) (Guo et al., 2017).

    The loss is convex in 1/T, so a bounded golden-section search on log T finds it; the argmax, and so
    the accuracy, does not change with T.
    """
    y_true = np.asarray(y_true)

    def nll(log_t: float) -> float:
        return log_loss(y_true, softmax(logits.astype(np.float64), float(np.exp(log_t))))

    lo, hi = np.log(0.05), np.log(20.0)
    ratio = (np.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(80):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(b)
    return float(np.exp((lo + hi) / 2))
