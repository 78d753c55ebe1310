"""GLUE metrics against scikit-learn and SciPy on fixed inputs, degenerate cases included."""

import numpy as np
import pytest
import scipy.stats

from sparsemixer_jax.metrics import glue_metrics

metrics = pytest.importorskip("sklearn.metrics")

# Fixed label/prediction pairs: balanced, skewed, perfect, inverted, constant predictions,
# three classes, and a seeded random draw with ties.
_RNG = np.random.default_rng(0)
CLASSIFICATION = {
    "mixed": ([1, 0, 1, 1, 0, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 1, 1, 0, 1, 0]),
    "skewed": ([1, 1, 1, 1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 1, 1, 1, 1, 1, 1]),
    "perfect": ([0, 1, 1, 0], [0, 1, 1, 0]),
    "inverted": ([0, 1, 1, 0], [1, 0, 0, 1]),
    "constant_prediction": ([1, 1, 1, 1, 1], [0, 1, 0, 1, 1]),
    "no_positive": ([0, 0, 0, 0], [0, 0, 1, 0]),
    "three_classes": ([0, 2, 1, 1, 2, 0, 2, 1], [0, 1, 1, 2, 2, 0, 2, 0]),
    "random": (_RNG.integers(0, 2, 200), _RNG.integers(0, 2, 200)),
}


@pytest.mark.parametrize("case", sorted(CLASSIFICATION))
def test_accuracy_matthews_match_sklearn(case):
    predictions, labels = map(np.asarray, CLASSIFICATION[case])
    assert glue_metrics.accuracy(predictions, labels) == pytest.approx(
        metrics.accuracy_score(labels, predictions), abs=1e-12
    )
    assert glue_metrics.matthews(predictions, labels) == pytest.approx(
        metrics.matthews_corrcoef(labels, predictions), abs=1e-12
    )


@pytest.mark.parametrize("case", sorted(CLASSIFICATION))
def test_f1_matches_sklearn(case):
    predictions, labels = map(np.asarray, CLASSIFICATION[case])
    expected = metrics.f1_score(labels, predictions, pos_label=1, average="binary"
                                if case != "three_classes" else None, zero_division=0.0)
    if case == "three_classes":  # the F1 of class 1 of a three-class problem
        expected = expected[1]
    assert glue_metrics.f1(predictions, labels) == pytest.approx(expected, abs=1e-12)


def test_hand_computed_values():
    # mixed: tp=4, tn=3, fp=2, fn=1 -> accuracy 0.7, F1 8/11, MCC (12-2)/sqrt(6*5*5*4).
    predictions, labels = CLASSIFICATION["mixed"]
    assert glue_metrics.accuracy(predictions, labels) == pytest.approx(0.7)
    assert glue_metrics.f1(predictions, labels) == pytest.approx(8 / 11)
    assert glue_metrics.matthews(predictions, labels) == pytest.approx(10 / np.sqrt(6 * 5 * 5 * 4))


REGRESSION = {
    "linear": ([0.1, 0.5, 1.2, 2.0, 4.9], [0.0, 1.0, 1.5, 2.5, 5.0]),
    "ties": ([1.0, 1.0, 2.0, 3.0, 3.0, 3.0], [0.5, 1.0, 1.0, 4.0, 2.0, 4.0]),
    "anti": ([5.0, 4.0, 3.0, 2.0], [0.0, 1.5, 2.0, 4.0]),
    "random": (_RNG.normal(size=300), _RNG.normal(size=300) + np.linspace(0, 1, 300)),
}


@pytest.mark.parametrize("case", sorted(REGRESSION))
def test_correlations_match_scipy(case):
    predictions, labels = map(np.asarray, REGRESSION[case])
    assert glue_metrics.pearson(predictions, labels) == pytest.approx(
        scipy.stats.pearsonr(labels, predictions)[0], abs=1e-12
    )
    assert glue_metrics.spearman(predictions, labels) == pytest.approx(
        scipy.stats.spearmanr(labels, predictions)[0], abs=1e-12
    )
    # Spearman is Pearson of average ranks (the definition, independent of scipy.stats.spearmanr).
    ranks = [scipy.stats.rankdata(x) for x in (predictions, labels)]
    assert glue_metrics.spearman(predictions, labels) == pytest.approx(
        np.corrcoef(*ranks)[0, 1], abs=1e-12
    )


def test_constant_regression_prediction_is_nan():
    assert np.isnan(glue_metrics.pearson([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]))
    assert np.isnan(glue_metrics.spearman([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]))


def test_bad_shapes_and_unknown_metric_are_named():
    with pytest.raises(ValueError, match="equal, non-empty"):
        glue_metrics.accuracy([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="equal, non-empty"):
        glue_metrics.matthews([], [])
    with pytest.raises(ValueError, match="unknown metric"):
        glue_metrics.compute(["acc"], [1], [1])
    assert glue_metrics.compute(["accuracy", "f1"], [1, 0], [1, 1]) == {
        "accuracy": 0.5, "f1": pytest.approx(2 / 3)}
