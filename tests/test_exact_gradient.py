"""Tests of the exact-gradient oracle and the measured orders of accuracy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import exact_gradient
from sparsemixer_jax.routing import router_probs
from sparsemixer_jax.studies.gradient_accuracy import plot, print_table


def _probs_fn(z):
    return router_probs(z, 0.1, "none")


@pytest.fixture(scope="module")
def problems():
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(0), 3)
        return [exact_gradient.random_problem(k, num_experts=6, dim=5) for k in keys]


def test_exact_gradient_terms_sum_to_autodiff_of_the_loss(problems):
    with jax.enable_x64(True):
        for problem in problems:
            exact = exact_gradient.exact_gradient(problem, _probs_fn)
            autodiff = jax.grad(
                lambda z, p=problem: exact_gradient.exact_gradient(
                    p._replace(logits=z), _probs_fn).loss
            )(problem.logits)
            np.testing.assert_allclose(exact.full, autodiff, rtol=1e-10, atol=1e-12)
            # nabla_0 by a different route: finite differences of L with g's argument frozen.
            probs = _probs_fn(problem.logits)
            frozen = jax.vmap(problem.downstream)(probs[:, None] * problem.expert_outputs)
            nabla0 = jax.grad(lambda z, v=frozen: jnp.sum(_probs_fn(z) * v))(problem.logits)
            np.testing.assert_allclose(exact.nabla0, nabla0, rtol=1e-10, atol=1e-12)


def test_estimator_identities(problems):
    with jax.enable_x64(True):
        problem = problems[0]
        exact = exact_gradient.exact_gradient(problem, _probs_fn)
        table = exact_gradient.estimator_table(problem, _probs_fn)
        # Plain backprop with D ~ pi is unbiased for nabla_1.
        plain = exact_gradient.router_expected_gradient(
            problem, _probs_fn, estimator="euler", backward_scale=1.0
        )
        np.testing.assert_allclose(plain, exact.nabla1, rtol=1e-12)
        # The mix with a coin that never lands on mid-point is SparseMixer-1st.
        never = exact_gradient.router_expected_gradient(problem, _probs_fn, midpoint_prob=0.0)
        np.testing.assert_allclose(never, table["euler"], rtol=1e-12)
        # Forward Euler's nabla_0 estimate has the same value as nabla_1 (Section 3.2).
        np.testing.assert_allclose(table["euler"], 2 * exact.nabla1, rtol=1e-12)


def test_orders_of_accuracy_on_nabla0(problems):
    """The paper's claim: forward Euler is first order, the mid-point rule second order."""
    scales = np.logspace(-1, -3, 5)
    with jax.enable_x64(True):
        for problem in problems:
            sweep = exact_gradient.accuracy_sweep(problem, scales, _probs_fn)
            euler = exact_gradient.loglog_slope(scales, sweep["euler"]["relerr_nabla0"])
            midpoint = exact_gradient.loglog_slope(scales, sweep["midpoint"]["relerr_nabla0"])
            assert 0.9 < euler < 1.1, euler
            assert 1.85 < midpoint < 2.15, midpoint
            # Dropping nabla_0 is not an approximation of it at any order.
            np.testing.assert_allclose(sweep["switch"]["relerr_nabla0"], 1.0)


def test_loglog_slope_recovers_a_power_law():
    scales = np.logspace(0, -3, 7)
    assert abs(exact_gradient.loglog_slope(scales, 3.0 * scales**1.5) - 1.5) < 1e-9


def test_experiment_writes_results(tmp_path):
    out = tmp_path / "results.json"
    png = tmp_path / "plot.png"
    settings = exact_gradient.SweepSettings(num_problems=2, num_scales=5, min_scale=1e-2,
                                            num_experts=4, dim=4, top_k=[2])
    results = exact_gradient.accuracy_experiment(settings)
    print_table(results)
    out.write_text(json.dumps(results, indent=1))
    plot(results, str(png))
    results = json.loads(out.read_text())
    assert set(results["estimators"]) == {
        "switch", "euler", "midpoint", "sparsemixer_2nd", "sparsemixer", "sparsemixer_paper"
    }
    for entry in results["estimators"].values():
        assert len(entry["relerr_full"]) == 5
        assert np.isfinite(entry["slope_full"])
    assert set(results["topk"]) == {"2"}
    for table in results["topk"].values():
        assert set(table) == set(exact_gradient.TOPK_ESTIMATORS)
        for entry in table.values():
            assert len(entry["norm_ratio"]) == len(entry["cos"]) == len(entry["relerr"]) == 5
    assert png.stat().st_size > 10_000


def test_experiment_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min-scale"):
        exact_gradient.SweepSettings(min_scale=2)
    with pytest.raises(ValueError, match="top-k"):
        exact_gradient.SweepSettings(num_experts=4, top_k=[5])


# ---------------------------------------------------------------- top-k oracle


def test_topk_oracle_at_k1_equals_the_top1_oracle(problems):
    with jax.enable_x64(True):
        problem = problems[1]
        @jax.jit
        def both(problem):
            estimators = ("mix", "euler", "midpoint")
            return (
                exact_gradient.exact_gradient(problem, _probs_fn),
                exact_gradient.exact_topk_gradient(problem, _probs_fn, 1),
                [exact_gradient.router_expected_gradient(problem, _probs_fn, estimator=e)
                 for e in estimators],
                [exact_gradient.topk_expected_gradient(problem, _probs_fn, 1, estimator=e)
                 for e in estimators],
            )

        top1, topk, expected1, expectedk = both(problem)
        for a, b in zip(list(top1) + expected1, list(topk) + expectedk, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_topk_exact_gradient_by_hand_on_two_experts():
    """N = k = 2: every token gets both experts, ``y = pi_i f_i + 1 * f_j`` for the order
    (i, j) drawn with probability pi_i. The loss and its gradient written out by hand."""
    with jax.enable_x64(True):
        problem = exact_gradient.random_problem(jax.random.key(5), num_experts=2, dim=3)
        exact = jax.jit(lambda p: exact_gradient.exact_topk_gradient(p, _probs_fn, 2))(problem)

        def by_hand(z):
            p = jax.nn.softmax(z)
            f = problem.expert_outputs
            return (p[0] * problem.downstream(p[0] * f[0] + f[1])
                    + p[1] * problem.downstream(p[1] * f[1] + f[0]))

        np.testing.assert_allclose(exact.loss, by_hand(problem.logits), rtol=1e-12)
        np.testing.assert_allclose(exact.full, jax.grad(by_hand)(problem.logits), rtol=1e-10,
                                   atol=1e-12)


def test_grin_appendix_a_norm_ratios(problems):
    """GRIN App. A: as expert outputs shrink, v2's expected router gradient tends to half the
    exact one (nabla_1 is missing and nabla_0 -> nabla_1), the corrected v2star to all of it."""
    with jax.enable_x64(True):
        sweep = exact_gradient.topk_accuracy_sweep(problems[0], [1e-3], _probs_fn, 1)
        np.testing.assert_allclose(sweep["v2"]["norm_ratio"], 0.5, atol=2e-3)
        np.testing.assert_allclose(sweep["v2star"]["norm_ratio"], 1.0, atol=2e-3)
        np.testing.assert_allclose(sweep["backprop"]["norm_ratio"], 0.5, atol=2e-3)
        assert sweep["v2star"]["cos"][0] > 0.9999
        # Top-2: the choice of the first expert moves the second's distribution; no estimator
        # here sees that term, so a bias stays at every scale.
        top2 = exact_gradient.topk_accuracy_sweep(problems[0], [1e-2, 1e-3], _probs_fn, 2)
        assert min(top2["v2star"]["relerr"]) > 1e-2
        np.testing.assert_allclose(top2["v2"]["relerr"][0], top2["v2"]["relerr"][1], rtol=0.05)
