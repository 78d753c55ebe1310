"""Tests of the exact-gradient oracle and the measured orders of accuracy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import exact_experiment
from lab.studies.gradient_accuracy import plot, print_table
from sparsemixer_jax import exact as oracle
from sparsemixer_jax.routers import router_probs, selection_probs


def _probs_fn(z):
    return router_probs(z, 0.1, "none")


@pytest.fixture(scope="module")
def problems():
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(0), 3)
        return [oracle.random_problem(k, num_experts=6, dim=5) for k in keys]


def test_exact_gradient_terms_sum_to_autodiff_of_the_loss(problems):
    with jax.enable_x64(True):
        for problem in problems:
            exact = oracle.exact_gradient(problem, _probs_fn)
            autodiff = jax.grad(
                lambda z, p=problem: oracle.exact_gradient(
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
        exact = oracle.exact_gradient(problem, _probs_fn)
        table = exact_experiment.estimator_table(problem, _probs_fn)
        # Plain backprop with D ~ pi is unbiased for nabla_1.
        plain = oracle.router_expected_gradient(
            problem, _probs_fn, estimator="euler", backward_scale=1.0
        )
        np.testing.assert_allclose(plain, exact.nabla1, rtol=1e-12)
        # The mix with a coin that never lands on mid-point is SparseMixer-1st.
        never = oracle.router_expected_gradient(problem, _probs_fn, midpoint_prob=0.0)
        np.testing.assert_allclose(never, table["euler"], rtol=1e-12)
        # Forward Euler's nabla_0 estimate has the same value as nabla_1 (Section 3.2).
        np.testing.assert_allclose(table["euler"], 2 * exact.nabla1, rtol=1e-12)


def test_orders_of_accuracy_on_nabla0(problems):
    """The paper's claim: forward Euler is first order, the mid-point rule second order."""
    scales = np.logspace(-1, -3, 5)
    with jax.enable_x64(True):
        for problem in problems:
            sweep = exact_experiment.accuracy_sweep(problem, scales, _probs_fn)
            euler = oracle.loglog_slope(scales, sweep["euler"]["relerr_nabla0"])
            midpoint = oracle.loglog_slope(scales, sweep["midpoint"]["relerr_nabla0"])
            assert 0.9 < euler < 1.1, euler
            assert 1.85 < midpoint < 2.15, midpoint
            # Dropping nabla_0 is not an approximation of it at any order.
            np.testing.assert_allclose(sweep["switch"]["relerr_nabla0"], 1.0)


# z + b keeps 3-4 of the 6 experts under the 0.5 mask, with q far from pi.
BIAS = jnp.array([-0.1, 0.15, 0.0, 0.7, 0.0, 0.3])


def _biased(bias):
    """The gates' ``pi`` and the sampling distribution ``q`` under the mask at 0.5."""
    return (lambda z: selection_probs(z, bias, 0.5)[1],
            lambda z: selection_probs(z, bias, 0.5)[0])


def test_selection_bias_oracle_is_the_gradient_of_its_loss_and_reduces_to_the_plain_one(problems):
    gates, sampling = _biased(BIAS)
    zero_gates, zero_sampling = _biased(jnp.zeros(6))

    @jax.jit
    def check(problem):
        exact = oracle.exact_gradient(problem, gates, sampling)
        autodiff = jax.grad(lambda z: oracle.exact_gradient(
            problem._replace(logits=z), gates, sampling).loss)(problem.logits)
        # b = 0: q = pi, and each estimator's expectation is the released router's.
        pairs = [(oracle.selection_bias_expected_gradient(
            problem, zero_gates, zero_sampling, estimator=estimator, single_path=single),
            oracle.router_expected_gradient(problem, lambda z: router_probs(z, 0.5),
                                            estimator=estimator))
            for estimator in ("mix", "euler", "midpoint") for single in (False, True)]
        return exact.full, autodiff, pairs

    with jax.enable_x64(True):
        for problem in problems:
            full, autodiff, pairs = check(problem)
            np.testing.assert_allclose(full, autodiff, rtol=1e-10, atol=1e-12)
            for two_path, plain in pairs:
                np.testing.assert_allclose(two_path, plain, rtol=1e-12, atol=1e-14)


def test_selection_bias_orders_of_accuracy(problems):
    """Under a selection bias the two-path estimate of nabla_0 by the mid-point rule is second
    order and the router's mix first order (Euler on the argmax); the released single-path
    backward keeps an error of the size of the gradient at every scale."""
    gates, sampling = _biased(BIAS)
    scales = np.logspace(-1, -3, 5)

    @jax.jit
    def errors(problem):
        exact = oracle.exact_gradient(problem, gates, sampling)
        pi = gates(problem.logits)
        half = oracle.directional_slopes(problem, pi, 0.5)
        midpoint = jax.jacobian(sampling)(problem.logits).T @ (pi * half)
        return jnp.stack([oracle.relative_error(midpoint, exact.nabla0)] + [
            oracle.relative_error(oracle.selection_bias_expected_gradient(
                problem, gates, sampling, single_path=single), exact.full)
            for single in (False, True)])

    with jax.enable_x64(True):
        for problem in problems:
            midpoint, mix, single_path = np.stack(
                [errors(problem.scaled(s)) for s in scales], axis=1)
            assert 1.85 < oracle.loglog_slope(scales, midpoint) < 2.5
            assert 0.9 < oracle.loglog_slope(scales, mix) < 1.5
            assert abs(oracle.loglog_slope(scales, single_path)) < 0.1
            assert single_path[-1] > 0.05


def test_topk_selection_bias_oracle_at_k1_and_at_zero_bias(problems):
    """The top-k two-path oracle: at k = 1 it is the top-1 closed form (v2 and v2star: Heun's
    rule off the argmax, with exact nabla_1 for v2star only); at b = 0 and k = 2 it is the
    released router's expectation (v2, v2star)."""
    gates, sampling = _biased(BIAS)

    @jax.jit
    def check(problem):
        pairs = [(oracle.topk_selection_bias_expected_gradient(
            problem, gates, sampling, 1, estimator=e),
            oracle.selection_bias_expected_gradient(problem, gates, sampling, estimator=e))
            for e in ("mix", "euler", "midpoint")]
        pi, q = gates(problem.logits), sampling(problem.logits)
        gate_jac, sample_jac = jax.jacobian(gates)(problem.logits), jax.jacobian(sampling)(
            problem.logits)
        full = oracle.directional_slopes(problem, pi, 1.0)
        third = oracle.directional_slopes(problem, pi, 1.0 / 3.0)
        heun = jnp.where(jnp.arange(6) == jnp.argmax(q), full, 0.25 * full + 0.75 * third)
        selection = sample_jac.T @ (pi * heun)
        pairs += [(oracle.topk_selection_bias_expected_gradient(
            problem, gates, sampling, 1, estimator="v2"), selection),
            (oracle.topk_selection_bias_expected_gradient(
                problem, gates, sampling, 1, estimator="v2star"),
             gate_jac.T @ (q * full) + selection)]
        # b = 0 at k = 2 on the first four experts (fewer tuples to compile).
        small = problem._replace(logits=problem.logits[:4],
                                 expert_outputs=problem.expert_outputs[:4])
        pairs += [(oracle.topk_selection_bias_expected_gradient(
            small, zero_gates, zero_sampling, 2, estimator=e),
            oracle.topk_expected_gradient(small, lambda z: router_probs(z, 0.5), 2,
                                          estimator=e))
            for e in ("v2", "v2star")]
        return pairs

    zero_gates, zero_sampling = _biased(jnp.zeros(4))
    with jax.enable_x64(True):
        for two_path, expected in check(problems[0]):
            np.testing.assert_allclose(two_path, expected, rtol=1e-12, atol=1e-14)


def test_loglog_slope_recovers_a_power_law():
    scales = np.logspace(0, -3, 7)
    assert abs(oracle.loglog_slope(scales, 3.0 * scales**1.5) - 1.5) < 1e-9


def test_experiment_writes_results(tmp_path):
    out = tmp_path / "results.json"
    png = tmp_path / "plot.png"
    settings = exact_experiment.SweepSettings(num_problems=2, num_scales=5, min_scale=1e-2,
                                            num_experts=4, dim=4, top_k=[2])
    results = exact_experiment.accuracy_experiment(settings)
    print_table(results)
    out.write_text(json.dumps(results, indent=1))
    plot(results, str(png))
    results = json.loads(out.read_text())
    assert set(results["estimators"]) == {
        "switch", "euler", "midpoint", "sparsemixer_2nd", "sparsemixer", "sparsemixer_paper",
        "densemixer", "densemixer_blog", "default_moe", "default_moe_st", "default_moe_oracle",
        "default_moe_st_oracle",
    }
    assert results["settings"]["default_noise"] == 0.5
    for entry in results["estimators"].values():
        assert len(entry["relerr_full"]) == 5
        assert np.isfinite(entry["slope_full"])
    assert set(results["topk"]) == {"2"}
    for table in results["topk"].values():
        assert set(table) == set(exact_experiment.TOPK_TABLE)
        # Noisy defaults move Default MoE away from its oracle row; the oracle
        # straight-through row is DenseMixer's.
        assert table["default_moe_st"]["cos"] != table["default_moe_st_oracle"]["cos"]
        np.testing.assert_allclose(table["default_moe_st_oracle"]["relerr"],
                                   table["densemixer"]["relerr"], rtol=1e-10)
        for entry in table.values():
            assert len(entry["norm_ratio"]) == len(entry["cos"]) == len(entry["relerr"]) == 5
    assert png.stat().st_size > 10_000


def test_experiment_sweeps_a_selection_bias():
    settings = exact_experiment.SweepSettings(num_problems=1, num_scales=3, min_scale=1e-2,
                                            num_experts=4, dim=4, top_k=[],
                                            selection_bias=0.5)
    results = exact_experiment.accuracy_experiment(settings)
    rows = results["estimators"]
    assert set(rows) == {"switch", "euler", "midpoint", "sparsemixer_2nd", "sparsemixer",
                         "sparsemixer_paper", "sparsemixer_single_path"}
    # From s = 0.1 to 0.01 the two-path mix's error shrinks about tenfold (first order); the
    # released single path's stays (2% here), over ten times the mix's at s = 0.01.
    single, mix = rows["sparsemixer_single_path"]["relerr_full"], rows["sparsemixer"]["relerr_full"]
    assert mix[-1] < 0.2 * mix[-2] and single[-1] > 0.5 * single[-2]
    assert single[-1] > 10 * mix[-1]


def test_experiment_sweeps_sigmoid_scores_with_their_orders():
    """--score sigmoid: the top-1 and top-2 tables (float64, one problem of 3 experts, a bias,
    c = 2.5, s = 1e-1 .. 1e-3). The mid-point rule on the set (exact nabla_1 + mid-point
    along grad log P(D)) has slope ~2 on nabla_0 at both k, forward Euler and the router's mix
    ~1; at top-2 each gate's share along its own step only keeps an error above 1%, and at
    top-1 the released single path (zero: the gate is constant) is 100% off."""
    settings = exact_experiment.SweepSettings(num_problems=1, num_scales=3, min_scale=1e-3,
                                            num_experts=3, dim=3, top_k=[2], score="sigmoid",
                                            selection_bias=0.1, routed_scaling_factor=2.5)
    results = exact_experiment.accuracy_experiment(settings)
    tables = {"1": results["estimators"], **results["sigmoid_topk"]}
    assert set(tables) == {"1", "2"}
    for k, rows in tables.items():
        slope = {name: row["slope_nabla0"] for name, row in rows.items()}
        assert 1.85 < slope["midpoint"] < 2.3, (k, slope)
        assert 0.85 < slope["euler"] < 1.3 and 0.85 < slope["sparsemixer"] < 1.4, (k, slope)
    assert tables["2"]["sparsemixer_per_step"]["relerr_nabla0"][-1] > 0.01
    assert tables["1"]["sparsemixer_single_path"]["relerr_full"][-1] == pytest.approx(1.0)
    print_table(results)  # the two tables (the plot draws them as in the committed figure)


def test_experiment_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min-scale"):
        exact_experiment.SweepSettings(min_scale=2)
    with pytest.raises(ValueError, match="top-k"):
        exact_experiment.SweepSettings(num_experts=4, top_k=[5])
    with pytest.raises(ValueError, match="default-noise"):
        exact_experiment.SweepSettings(default_noise=-0.1)
    with pytest.raises(ValueError, match="selection-bias"):
        exact_experiment.SweepSettings(selection_bias=0.5, num_groups=2)
    with pytest.raises(ValueError, match="--score sigmoid"):
        exact_experiment.SweepSettings(routed_scaling_factor=2.5)


# ---------------------------------------------------------------- top-k oracle


def test_topk_oracle_at_k1_equals_the_top1_oracle(problems):
    with jax.enable_x64(True):
        problem = problems[1]
        @jax.jit
        def both(problem):
            estimators = ("mix", "euler", "midpoint")
            return (
                oracle.exact_gradient(problem, _probs_fn),
                oracle.exact_topk_gradient(problem, _probs_fn, 1),
                [oracle.router_expected_gradient(problem, _probs_fn, estimator=e)
                 for e in estimators],
                [oracle.topk_expected_gradient(problem, _probs_fn, 1, estimator=e)
                 for e in estimators],
            )

        top1, topk, expected1, expectedk = both(problem)
        for a, b in zip(list(top1) + expected1, list(topk) + expectedk, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_topk_exact_gradient_by_hand_on_two_experts():
    """N = k = 2: every token gets both experts, ``y = pi_i f_i + 1 * f_j`` for the order
    (i, j) drawn with probability pi_i. The loss and its gradient written out by hand."""
    with jax.enable_x64(True):
        problem = oracle.random_problem(jax.random.key(5), num_experts=2, dim=3)
        exact = jax.jit(lambda p: oracle.exact_topk_gradient(p, _probs_fn, 2))(problem)

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
        sweep = exact_experiment.topk_accuracy_sweep(problems[0], [1e-3], _probs_fn, 1)
        np.testing.assert_allclose(sweep["v2"]["norm_ratio"], 0.5, atol=2e-3)
        np.testing.assert_allclose(sweep["v2star"]["norm_ratio"], 1.0, atol=2e-3)
        np.testing.assert_allclose(sweep["backprop"]["norm_ratio"], 0.5, atol=2e-3)
        assert sweep["v2star"]["cos"][0] > 0.9999
        # Top-2: the choice of the first expert moves the second's distribution; no estimator
        # here sees that term, so a bias stays at every scale.
        top2 = exact_experiment.topk_accuracy_sweep(problems[0], [1e-2, 1e-3], _probs_fn, 2)
        assert min(top2["v2star"]["relerr"]) > 1e-2
        np.testing.assert_allclose(top2["v2"]["relerr"][0], top2["v2"]["relerr"][1], rtol=0.05)


# ------------------------------------- DenseMixer and Default MoE: unchosen experts' gradient

DENSE_TOP1 = {
    "densemixer": lambda p, probs_fn, v: oracle.densemixer_gradient(p, probs_fn),
    "densemixer_blog": lambda p, probs_fn, v: oracle.densemixer_blog_gradient(p, probs_fn),
    "default_moe": oracle.default_moe_gradient,
    "default_moe_st": oracle.default_moe_st_gradient,
}


def _three_expert_problem():
    """Three experts, plain softmax router, noisy defaults; numpy copies for the hand loops."""
    problem = oracle.random_problem(jax.random.key(11), num_experts=3, dim=4)
    defaults = oracle.noisy_defaults(problem.expert_outputs, jax.random.key(12), 0.5)
    z, f, a, b, v = (np.asarray(x, np.float64) for x in (
        problem.logits, problem.expert_outputs, problem.weight, problem.bias, defaults))
    return problem, defaults, z, f, a, b, v


def _hand_softmax(z, keep):
    e = np.where(keep, np.exp(z - z.max()), 0.0)
    return e / e.sum()


def _hand_softmax_jacobian(p):
    """``d p_i / d z_m = p_i (delta_im - p_m)``; removed experts have ``p = 0``."""
    return np.diag(p) - np.outer(p, p)


def _hand_token_backward(name, gy, f, v, pi, chosen):
    """The per-token coefficient ``[N]`` on ``dpi_j`` (first-step ``pi``) an estimator adds
    beyond the ordinary gate gradient, written from the methods' descriptions."""
    extra = np.zeros(len(pi))
    for j in range(len(pi)):
        if name == "densemixer" and j not in chosen:
            extra[j] = gy @ f[j]
        elif name == "densemixer_blog":
            extra[j] = pi[j] * (gy @ f[j])
        elif name in ("default_moe", "default_moe_st") and j not in chosen:
            extra[j] = gy @ v[j]
    return extra


@pytest.mark.parametrize("name", list(DENSE_TOP1))
def test_dense_estimators_top1_by_hand_on_three_experts(name):
    """Each top-1 expectation against explicit loops over D with g'(y) = A^T cos(A y + b)."""
    with jax.enable_x64(True):
        problem, defaults, z, f, a, b, v = _three_expert_problem()
        got = DENSE_TOP1[name](problem, jax.nn.softmax, defaults)
        pi = _hand_softmax(z, np.ones(3, bool))
        jac = _hand_softmax_jacobian(pi)
        grad = np.zeros(3)
        for d in range(3):
            y = pi[d] * f[d]
            if name == "default_moe":
                y = y + sum(pi[i] * v[i] for i in range(3) if i != d)
            gy = a.T @ np.cos(a @ y + b)
            coef = _hand_token_backward(name, gy, f, v, pi, (d,))
            coef[d] += gy @ f[d]  # the ordinary gate gradient of the chosen expert
            grad += pi[d] * (jac.T @ coef)
        np.testing.assert_allclose(got, grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", oracle.DENSE_ESTIMATORS)
def test_dense_estimators_top2_by_hand_on_three_experts(name):
    """Top-2 sequential sampling: explicit loops over the six ordered pairs; the second gate is
    ``pi_b / (1 - pi_a)`` with its softmax Jacobian over the experts left."""
    with jax.enable_x64(True):
        problem, defaults, z, f, a, b, v = _three_expert_problem()
        got = oracle.topk_dense_expected_gradient(
            problem, jax.nn.softmax, 2, name, defaults)
        pi = _hand_softmax(z, np.ones(3, bool))
        jac = _hand_softmax_jacobian(pi)
        grad = np.zeros(3)
        for first in range(3):
            for second in range(3):
                if second == first:
                    continue
                pi2 = _hand_softmax(z, np.arange(3) != first)
                gates = (pi[first], pi2[second])
                y = gates[0] * f[first] + gates[1] * f[second]
                if name == "default_moe":
                    y = y + sum(pi[j] * v[j] for j in range(3) if j not in (first, second))
                gy = a.T @ np.cos(a @ y + b)
                backward = (gy @ f[first]) * jac[first] + (gy @ f[second]) * (
                    _hand_softmax_jacobian(pi2)[second])
                coef = _hand_token_backward(name, gy, f, v, pi, (first, second))
                grad += gates[0] * gates[1] * (backward + jac.T @ coef)
        np.testing.assert_allclose(got, grad, rtol=1e-12, atol=1e-14)


def test_dense_estimators_topk_at_k1_equal_the_top1_formulas(problems):
    with jax.enable_x64(True):
        problem = problems[2]
        defaults = oracle.noisy_defaults(problem.expert_outputs, jax.random.key(3), 0.5)
        for name, top1 in DENSE_TOP1.items():
            topk = oracle.topk_dense_expected_gradient(
                problem, _probs_fn, 1, name, defaults)
            np.testing.assert_allclose(topk, top1(problem, _probs_fn, defaults), rtol=1e-12,
                                       atol=1e-14, err_msg=name)
        with pytest.raises(ValueError, match="unknown estimator"):
            oracle.topk_dense_expected_gradient(problem, _probs_fn, 1, "mix")


def test_oracle_default_moe_st_is_densemixer(problems):
    """With defaults equal to the expert outputs, straight-through Default MoE sends exactly
    DenseMixer's gradient (top-1 and top-2); noisy defaults do not."""
    with jax.enable_x64(True):
        problem = problems[0]
        f = problem.expert_outputs
        np.testing.assert_array_equal(oracle.noisy_defaults(f, jax.random.key(1), 0.0), f)
        np.testing.assert_allclose(
            oracle.default_moe_st_gradient(problem, _probs_fn, f),
            oracle.densemixer_gradient(problem, _probs_fn), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(
            oracle.topk_dense_expected_gradient(problem, _probs_fn, 2, "default_moe_st"),
            oracle.topk_dense_expected_gradient(problem, _probs_fn, 2, "densemixer"),
            rtol=1e-12, atol=1e-15)
        noisy = oracle.noisy_defaults(f, jax.random.key(1), 0.5)
        assert not np.allclose(oracle.default_moe_st_gradient(problem, _probs_fn, noisy),
                               oracle.densemixer_gradient(problem, _probs_fn), rtol=1e-3)
        # The defaults scale with the outputs, as the sweeps assume.
        np.testing.assert_allclose(oracle.noisy_defaults(1e-3 * f, jax.random.key(1), 0.5),
                                   1e-3 * noisy, rtol=1e-12)


def test_densemixer_blog_tends_to_the_exact_gradient_and_the_code_does_not(problems):
    """As s -> 0 the exact coefficient is ~ 2 pi_j a_j with a_j = g'(0) . f_j (nabla_0 and
    nabla_1 each give pi_j a_j), the blog's rule gives pi_j a_j + pi_j a_j, the released code
    a_j: the blog's norm ratio tends to 1, the code's to |J^T a| / |2 J^T (pi a)|."""
    with jax.enable_x64(True):
        for problem in problems:
            small = problem.scaled(1e-4)
            exact = oracle.exact_gradient(small, _probs_fn).full
            blog = oracle.densemixer_blog_gradient(small, _probs_fn)
            code = oracle.densemixer_gradient(small, _probs_fn)
            norm = np.linalg.norm
            assert abs(norm(blog) / norm(exact) - 1) < 1e-3
            assert oracle.cosine_similarity(blog, exact) > 0.99999
            probs, jac = _probs_fn(small.logits), jax.jacobian(_probs_fn)(small.logits)
            slopes = small.expert_outputs @ jax.grad(small.downstream)(jnp.zeros(5))  # a_j
            limit = norm(jac.T @ slopes) / norm(jac.T @ (2 * probs * slopes))
            np.testing.assert_allclose(norm(code) / norm(exact), limit, rtol=1e-3)
            assert abs(limit - 1) > 0.05, limit
            assert oracle.cosine_similarity(code, exact) < 0.99
