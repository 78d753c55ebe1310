"""Tests of the exact-gradient oracle and the measured orders of accuracy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import gradient_accuracy
from sparsemixer_jax import analysis
from sparsemixer_jax.routing import router_probs


def _probs_fn(z):
    return router_probs(z, 0.1, "none")


@pytest.fixture(scope="module")
def problems():
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(0), 3)
        return [analysis.random_problem(k, num_experts=6, dim=5) for k in keys]


def test_exact_gradient_terms_sum_to_autodiff_of_the_loss(problems):
    with jax.enable_x64(True):
        for problem in problems:
            exact = analysis.exact_gradient(problem, _probs_fn)
            autodiff = jax.grad(
                lambda z, p=problem: analysis.exact_gradient(p._replace(logits=z), _probs_fn).loss
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
        exact = analysis.exact_gradient(problem, _probs_fn)
        table = analysis.estimator_table(problem, _probs_fn)
        # Plain backprop with D ~ pi is unbiased for nabla_1.
        plain = analysis.router_expected_gradient(
            problem, _probs_fn, estimator="euler", backward_scale=1.0
        )
        np.testing.assert_allclose(plain, exact.nabla1, rtol=1e-12)
        # The mix with a coin that never lands on mid-point is SparseMixer-1st.
        never = analysis.router_expected_gradient(problem, _probs_fn, midpoint_prob=0.0)
        np.testing.assert_allclose(never, table["euler"], rtol=1e-12)
        # Forward Euler's nabla_0 estimate has the same value as nabla_1 (Section 3.2).
        np.testing.assert_allclose(table["euler"], 2 * exact.nabla1, rtol=1e-12)


def test_orders_of_accuracy_on_nabla0(problems):
    """The paper's claim: forward Euler is first order, the mid-point rule second order."""
    scales = np.logspace(-1, -3, 5)
    with jax.enable_x64(True):
        for problem in problems:
            sweep = analysis.accuracy_sweep(problem, scales, _probs_fn)
            euler = analysis.loglog_slope(scales, sweep["euler"]["relerr_nabla0"])
            midpoint = analysis.loglog_slope(scales, sweep["midpoint"]["relerr_nabla0"])
            assert 0.9 < euler < 1.1, euler
            assert 1.85 < midpoint < 2.15, midpoint
            # Dropping nabla_0 is not an approximation of it at any order.
            np.testing.assert_allclose(sweep["switch"]["relerr_nabla0"], 1.0)


def test_loglog_slope_recovers_a_power_law():
    scales = np.logspace(0, -3, 7)
    assert abs(analysis.loglog_slope(scales, 3.0 * scales**1.5) - 1.5) < 1e-9


def test_experiment_writes_results(tmp_path):
    out = tmp_path / "results.json"
    plot = tmp_path / "plot.png"
    gradient_accuracy.main(
        ["--out", str(out), "--plot", str(plot), "--num-problems", "2", "--num-scales", "5",
         "--min-scale", "1e-2", "--num-experts", "4", "--dim", "4"]
    )
    results = json.loads(out.read_text())
    assert set(results["estimators"]) == {
        "switch", "euler", "midpoint", "sparsemixer_2nd", "sparsemixer", "sparsemixer_paper"
    }
    for entry in results["estimators"].values():
        assert len(entry["relerr_full"]) == 5
        assert np.isfinite(entry["slope_full"])
    assert plot.stat().st_size > 10_000


def test_experiment_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        gradient_accuracy.parse_args(["--min-scale", "2"])
