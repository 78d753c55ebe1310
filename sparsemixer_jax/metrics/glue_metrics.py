"""GLUE dev metrics: accuracy, F1, Matthews correlation, Pearson and Spearman correlation.

Values are fractions (accuracy 0.85, not 85). The classification metrics are a few lines on the
confusion matrix, written here in NumPy rather than taken from scikit-learn so that the library
does not need it at run time; ``tests/test_glue_metrics.py`` checks each against scikit-learn.
The correlations are SciPy's (``scipy.stats``, already a dependency of JAX), as GLUE's own scoring
and the common fine-tuning scripts compute them.

Degenerate inputs follow scikit-learn: F1 is 0 when there is no true or predicted positive, and
the Matthews correlation is 0 when a row or column of the confusion matrix is empty (a constant
prediction). A correlation with a constant input is undefined and returned as NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.stats


def _labels(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or predictions.ndim != 1 or not len(labels):
        raise ValueError(
            f"predictions {predictions.shape} and labels {labels.shape} must be equal, non-empty "
            "1-D arrays"
        )
    return predictions, labels


def accuracy(predictions, labels) -> float:
    """Fraction of ``predictions`` (class ids ``[N]``) equal to ``labels`` (``[N]``)."""
    predictions, labels = _labels(predictions, labels)
    return float(np.mean(predictions == labels))


def f1(predictions, labels, positive: int = 1) -> float:
    """F1 of the ``positive`` class: ``2 tp / (2 tp + fp + fn)``."""
    predictions, labels = _labels(predictions, labels)
    tp = np.sum((predictions == positive) & (labels == positive))
    wrong = np.sum((predictions != labels) & ((predictions == positive) | (labels == positive)))
    return float(2 * tp / (2 * tp + wrong)) if tp else 0.0


def matthews(predictions, labels) -> float:
    """Matthews correlation coefficient, multi-class form (Gorodkin 2004) over the confusion
    matrix ``C``: ``(c s - p.t) / sqrt((s^2 - p.p)(s^2 - t.t))`` with ``c`` the correct count,
    ``s`` the sample count, ``p`` and ``t`` the predicted and true class counts."""
    predictions, labels = _labels(predictions, labels)
    classes, index = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    true, pred = index[: len(labels)], index[len(labels) :]
    t = np.bincount(true, minlength=len(classes)).astype(np.float64)
    p = np.bincount(pred, minlength=len(classes)).astype(np.float64)
    c, s = float(np.sum(true == pred)), float(len(labels))
    denominator = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - p @ t) / denominator) if denominator > 0 else 0.0


def _scores(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = _labels(predictions, labels)
    return predictions.astype(np.float64), labels.astype(np.float64)


def pearson(predictions, labels) -> float:
    """Pearson correlation of float ``predictions [N]`` and ``labels [N]`` (NaN if either is
    constant)."""
    predictions, labels = _scores(predictions, labels)
    if np.ptp(predictions) == 0 or np.ptp(labels) == 0:
        return float("nan")
    return float(scipy.stats.pearsonr(predictions, labels).statistic)


def spearman(predictions, labels) -> float:
    """Spearman rank correlation (ties get their average rank; NaN if either is constant)."""
    predictions, labels = _scores(predictions, labels)
    if np.ptp(predictions) == 0 or np.ptp(labels) == 0:
        return float("nan")
    return float(scipy.stats.spearmanr(predictions, labels).statistic)


METRICS: dict[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}


def compute(names, predictions, labels) -> dict[str, float]:
    """``{name: METRICS[name](predictions, labels)}`` for each of ``names``."""
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; known: {sorted(METRICS)}")
    return {n: METRICS[n](predictions, labels) for n in names}
