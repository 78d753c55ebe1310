"""Tests of the routers: shapes, dtypes, masks, sampling, and the gradient estimators.

Statistical tests use a fixed seed and a bound of 4.5 standard errors per component
(two-sided false-alarm rate below 1e-5 per component for a correct implementation).
"""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import exact as oracle
from sparsemixer_jax.routers import (
    ROUTERS,
    RouterOutput,
    get_router,
    router_probs,
    routing_keys,
    routing_mask,
    scaled_gate,
    selection_probs,
    sparsemixer_route,
    switch_route,
)

Z_SE = 4.5
KEY = jax.random.key(0)
_STATIC = (
    "top_k", "jitter_eps", "training", "mask", "estimator", "midpoint_prob", "backward_scale"
)
# Jitted once per option set: eager op-by-op dispatch would dominate the suite's run time.
route = jax.jit(sparsemixer_route, static_argnames=_STATIC)
switch = jax.jit(switch_route, static_argnames=("top_k", "jitter_eps", "training"))


def gate_grad(z, key, **options):
    """d sum(gate) / d logits."""
    return _gate_grad(z, key, **options)


@jax.jit
def _probs_jacobian(z):
    return jax.vmap(jax.jacobian(lambda zi: router_probs(zi, 0.1)))(z)  # [T, N, N]


_gate_grad = jax.jit(
    jax.grad(lambda z, key, **o: jnp.sum(sparsemixer_route(z, key, **o).gate)),
    static_argnames=_STATIC,
)


def _logits(shape, scale=1.0, seed=1):
    return scale * jax.random.normal(jax.random.key(seed), shape)


# ---------------------------------------------------------------- shapes, dtypes, transforms


class ShapeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_sparsemixer_shapes(self):
        for shape in [(6,), (5, 6), (2, 3, 6)]:
            for training in (True, False):
                route = self.variant(
                    lambda z, k, t=training: sparsemixer_route(z, k, training=t)
                )
                out = route(_logits(shape), KEY)
                chex.assert_shape(out.expert, shape[:-1])
                chex.assert_shape(out.gate, shape[:-1])
                chex.assert_shape(out.probs, shape)
                chex.assert_type([out.expert, out.gate, out.probs], [jnp.int32, float, float])
                np.testing.assert_allclose(out.probs.sum(-1), 1.0, rtol=1e-6)
                chex.assert_tree_all_finite((out.gate, out.probs))

    @chex.variants(with_jit=True, without_jit=True)
    def test_switch_shapes(self):
        for shape in [(6,), (5, 6), (2, 3, 6)]:
            out = self.variant(lambda z, k: switch_route(z, k))(_logits(shape), KEY)
            chex.assert_shape([out.expert, out.gate], shape[:-1])
            chex.assert_shape(out.probs, shape)
            assert out.expert.dtype == jnp.int32

    @chex.variants(with_jit=True, without_jit=True)
    def test_grad_is_finite_and_zero_on_masked_experts(self):
        z = _logits((4, 7), scale=3.0)

        def loss(z):
            return jnp.sum(sparsemixer_route(z, KEY).gate)

        grad = self.variant(jax.grad(loss))(z)
        chex.assert_tree_all_finite(grad)
        keep = routing_mask(z, 0.1)
        assert not bool(jnp.all(keep)), "test needs some masked experts"
        np.testing.assert_array_equal(np.asarray(grad)[~np.asarray(keep)], 0.0)

    def test_vmap_matches_per_row_calls(self):
        z = _logits((5, 6))
        keys = jax.random.split(KEY, 5)
        batched = jax.vmap(lambda zi, ki: sparsemixer_route(zi, ki))(z, keys)
        grads = jax.vmap(_gate_grad)(z, keys)
        for i in range(5):
            row = route(z[i], keys[i])
            assert int(batched.expert[i]) == int(row.expert)
            np.testing.assert_allclose(batched.gate[i], row.gate, rtol=1e-6)
            np.testing.assert_allclose(grads[i], gate_grad(z[i], keys[i]), rtol=1e-6, atol=1e-7)


def test_bfloat16_logits_route_in_float32():
    z32 = _logits((8, 6)).astype(jnp.bfloat16).astype(jnp.float32)
    z16 = z32.astype(jnp.bfloat16)
    out16 = route(z16, KEY)
    out32 = route(z32, KEY)
    assert out16.gate.dtype == jnp.float32 and out16.probs.dtype == jnp.float32
    np.testing.assert_array_equal(out16.expert, out32.expert)
    np.testing.assert_allclose(out16.probs, out32.probs, rtol=1e-6)
    grad16 = gate_grad(z16, KEY)
    assert grad16.dtype == jnp.bfloat16
    grad32 = gate_grad(z32, KEY)
    np.testing.assert_allclose(grad16.astype(jnp.float32), grad32, rtol=1e-2, atol=1e-2)
    sw = switch(z16, KEY)
    assert sw.gate.dtype == jnp.float32


# ---------------------------------------------------------------- masks


def test_mask_rules_on_hand_computed_logits():
    # gap 0.2 at z=0.8: reference tests 0.2 / max(0.8, 1.0) > 0.2 (no, kept);
    # the paper tests 0.2 > 0.1 * (1.0 + 0.8) = 0.18 (yes, masked).
    z = jnp.array([1.0, 0.8, 0.0])
    np.testing.assert_array_equal(routing_mask(z, 0.1, "reference"), [True, True, False])
    np.testing.assert_array_equal(routing_mask(z, 0.1, "paper"), [True, False, False])
    np.testing.assert_array_equal(routing_mask(z, 0.1, "none"), [True, True, True])
    # Negative maximum: reference scale is max(|z_i|, max z) = |z_i|.
    z = jnp.array([-1.0, -1.15, -1.3])  # gaps 0.15/1.15 = 0.13 (kept), 0.3/1.3 = 0.23 (masked)
    np.testing.assert_array_equal(routing_mask(z, 0.1, "reference"), [True, True, False])
    with pytest.raises(ValueError, match="unknown mask rule"):
        routing_mask(z, 0.1, "bogus")


def test_probs_are_softmax_over_unmasked_logits():
    z = jnp.array([2.0, 1.9, 0.5, 1.7])
    keep = np.asarray(routing_mask(z, 0.1))
    expected = np.where(keep, np.exp(z), 0.0)
    expected /= expected.sum()
    np.testing.assert_allclose(router_probs(z, 0.1), expected, rtol=1e-6)


# ---------------------------------------------------------------- sampling


def test_sampling_frequencies_match_probs_and_masked_never_sampled():
    num = 40_000
    z = jnp.array([1.0, 0.9, 0.85, 0.3, -0.5, 0.95])
    probs = np.asarray(router_probs(z, 0.1))
    assert (probs == 0).sum() == 2, "test needs masked experts"
    out = route(jnp.broadcast_to(z, (num, 6)), KEY)
    counts = np.bincount(np.asarray(out.expert), minlength=6)
    assert np.all(counts[probs == 0] == 0), counts
    freq = counts / num
    se = np.sqrt(probs * (1 - probs) / num)
    live = probs > 0
    assert np.all(np.abs(freq - probs)[live] < Z_SE * se[live]), (freq, probs, se)


def test_coin_frequency_and_gate_values():
    num = 40_000
    z = jnp.broadcast_to(jnp.array([1.0, 0.95, 0.9]), (num, 3))
    for p in (0.5, 0.25, 1.0):
        out = route(z, KEY, midpoint_prob=p)
        prob_at = np.take_along_axis(np.asarray(out.probs), np.asarray(out.expert)[:, None], -1)
        ratio = np.asarray(out.gate) / prob_at[:, 0]
        assert set(np.round(np.unique(ratio), 6)) <= {0.5, 1.0}
        top = np.asarray(out.expert) == 0
        assert np.all(ratio[top] == 1.0), "the argmax always takes the Euler branch"
        halved = (ratio[~top] == 0.5).mean()
        se = np.sqrt(p * (1 - p) / (~top).sum())
        assert abs(halved - p) <= max(Z_SE * se, 1e-12), (p, halved, se)
    for estimator, factor in (("euler", 1.0), ("midpoint", 0.5)):
        out = route(z, KEY, estimator=estimator)
        chosen = np.take_along_axis(np.asarray(out.probs), np.asarray(out.expert)[:, None], -1)
        np.testing.assert_allclose(out.gate, factor * chosen[:, 0], rtol=1e-6)


def test_backward_sends_scaled_gate_cotangent_to_the_chosen_probability():
    z = _logits((6, 5))
    jac = _probs_jacobian(z)
    for estimator, scale in (("mix", 2.0), ("midpoint", 1.0)):
        out = route(z, KEY, estimator=estimator, backward_scale=scale)
        grad = gate_grad(z, KEY, estimator=estimator, backward_scale=scale)
        expected = scale * jac[jnp.arange(6), out.expert]
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_eval_is_deterministic_argmax():
    z = _logits((4, 6, 5))
    a = route(z, jax.random.key(1), training=False)
    b = route(z, None, training=False)
    np.testing.assert_array_equal(a.expert, jnp.argmax(z, -1))
    np.testing.assert_array_equal(a.expert, b.expert)
    np.testing.assert_array_equal(a.gate, jnp.max(a.probs, -1))
    sw = switch(z, None, training=False)
    np.testing.assert_array_equal(sw.expert, jnp.argmax(z, -1))
    np.testing.assert_allclose(sw.probs, jax.nn.softmax(z), rtol=1e-6)


def test_training_without_key_is_a_clear_error():
    with pytest.raises(ValueError, match="PRNG key"):
        sparsemixer_route(_logits((3,)), None)
    with pytest.raises(ValueError, match="PRNG key"):
        switch_route(_logits((3,)), None)
    with pytest.raises(ValueError, match="estimator"):
        sparsemixer_route(_logits((3,)), KEY, estimator="rk4")
    with pytest.raises(ValueError, match="midpoint_prob"):
        sparsemixer_route(_logits((3,)), KEY, midpoint_prob=1.5)


# One name per distinct routing function and options (DenseMixer's and Default MoE's routing is
# Switch's; what they add lives in the MoE layer, tests/test_unchosen_experts.py).
DISTINCT_ROUTERS = ["switch"] + [n for n in sorted(ROUTERS) if ROUTERS[n][0] is not switch_route]


@pytest.mark.parametrize(
    "logits",
    [jnp.zeros((4, 5)), jnp.full((4, 5), 3.0), 1e4 * _logits((4, 5)), _logits((4, 1))],
    ids=["all-zero", "all-equal", "magnitude-1e4", "single-expert"],
)
@pytest.mark.parametrize("name", DISTINCT_ROUTERS)
def test_degenerate_logits_give_finite_outputs_and_grads(logits, name):
    router = get_router(name)

    @jax.jit
    def route_and_grad(z):
        def loss(z):
            out = router(z, KEY, True)
            return jnp.sum(out.gate) + jnp.sum(out.probs**2), out

        return jax.grad(loss, has_aux=True)(z)

    grad, out = route_and_grad(logits)
    chex.assert_tree_all_finite((out.gate, out.probs, grad))
    assert np.all((np.asarray(out.expert) >= 0) & (np.asarray(out.expert) < logits.shape[-1]))


# ---------------------------------------------------------------- switch baseline


def test_switch_jitter_and_plain_gradient():
    z = _logits((3, 4))
    eps = 0.1
    out = switch(z, KEY, jitter_eps=eps)
    noise = jax.random.uniform(KEY, z.shape, minval=1 - eps, maxval=1 + eps)
    np.testing.assert_allclose(out.probs, jax.nn.softmax(z * noise), rtol=1e-6)
    grad = jax.grad(lambda z: switch_route(z, KEY, jitter_eps=eps).gate.sum())(z)
    jac = jax.vmap(jax.jacobian(lambda zi, ui: jax.nn.softmax(zi * ui)))(z, noise)
    np.testing.assert_allclose(grad, jac[jnp.arange(3), out.expert], rtol=1e-5, atol=1e-7)
    no_jitter = switch(z, KEY, jitter_eps=0.0)
    np.testing.assert_allclose(no_jitter.probs, jax.nn.softmax(z), rtol=1e-6)


# ---------------------------------------------------------------- Monte Carlo vs exact oracle

MC_SAMPLES = 40_000


@pytest.fixture(scope="module")
def mc_problem():
    # Reference mask keeps experts 0-2 and masks 3-4 (gaps 0.7 and 1.5 > 0.2).
    problem = oracle.random_problem(jax.random.key(3), num_experts=5, dim=3)
    return problem._replace(
        logits=jnp.array([1.0, 0.9, 0.85, 0.3, -0.5]), expert_outputs=2 * problem.expert_outputs
    )


def _mc_gradients(problem, route=sparsemixer_route, samples=MC_SAMPLES, **options):
    """Per-sample router gradients ``[T, N]`` of ``g(gate * f_D)`` with independent samples."""

    def total(z_batch):
        out = route(z_batch, jax.random.key(11), **options)
        y = out.gate[:, None] * problem.expert_outputs[out.expert]
        return jnp.sum(jax.vmap(problem.downstream)(y))

    z_batch = jnp.broadcast_to(problem.logits, (samples, problem.logits.shape[0]))
    return np.asarray(jax.jit(jax.grad(total))(z_batch), dtype=np.float64)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"estimator": "euler"},
        {"estimator": "midpoint"},
        {"midpoint_prob": 1.0},
        {"mask": "none"},
        {"mask": "paper", "backward_scale": 1.0},
    ],
    ids=["mix", "euler", "midpoint", "paper-coin", "no-mask", "paper-mask-scale1"],
)
def test_monte_carlo_gradient_matches_exact_expectation(mc_problem, options):
    grads = _mc_gradients(mc_problem, **options)
    mean = grads.mean(0)
    se = grads.std(0, ddof=1) / np.sqrt(MC_SAMPLES)
    mask = options.get("mask", "reference")
    oracle_options = {k: v for k, v in options.items() if k != "mask"}

    def probs_fn(z):
        return router_probs(z, 0.1, mask)

    expected = np.asarray(
        oracle.router_expected_gradient(mc_problem, probs_fn, **oracle_options)
    )
    live = se > 0
    np.testing.assert_array_equal(mean[~live], expected[~live])  # masked experts: exactly 0
    z_scores = np.abs(mean - expected)[live] / se[live]
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}, SE {se}"


def test_monte_carlo_test_can_tell_estimators_apart(mc_problem):
    """Mix and Euler expectations differ by many standard errors: the test above has power."""

    def probs_fn(z):
        return router_probs(z, 0.1)

    grads = _mc_gradients(mc_problem)
    se = grads.std(0, ddof=1) / np.sqrt(MC_SAMPLES)
    mix = oracle.router_expected_gradient(mc_problem, probs_fn)
    euler = oracle.router_expected_gradient(mc_problem, probs_fn, estimator="euler")
    assert np.max(np.abs(np.asarray(mix - euler)) / np.maximum(se, 1e-30)) > 2 * Z_SE


# ---------------------------------------------------------------- top-1 with a selection bias

# z + b = [0.9, 1.05, 0.85, 1.0, -0.5]: experts 0-3 eligible (4 masked), q far from pi
# (q_3 = 0.26, pi_3 = 0.15), the argmax of z + b is expert 1 while pi's is expert 0.
BIAS = jnp.array([-0.1, 0.15, 0.0, 0.7, 0.0])


def _gates_of_biased(z):
    return selection_probs(z, BIAS, 0.1)[1]


def _sampling_of_biased(z):
    return selection_probs(z, BIAS, 0.1)[0]


def _released_backward_under_bias(logits, key, selection_bias):
    """Deliberately wrong: D ~ q, but the released single gate backward (scale 2 along
    grad pi_D, the "mix" coin), as if q were pi."""
    q, pi = selection_probs(logits, selection_bias, 0.1)
    sample_key, coin_key = routing_keys(key, 1)[0]
    expert = jax.random.categorical(sample_key, jnp.log(jax.lax.stop_gradient(q)), axis=-1)
    top = jnp.argmax(logits + selection_bias, axis=-1)
    reduced = jax.random.bernoulli(coin_key, 0.5, expert.shape) & (expert != top)
    gate = scaled_gate(_take(pi, expert), jnp.where(reduced, 0.5, 1.0), 2.0)
    return RouterOutput(expert=expert, gate=gate, probs=pi)


def _z_scores(grads, expected):
    """|MC mean - expected| / SE on the live components; masked ones must be exactly 0."""
    mean, se = grads.mean(0), grads.std(0, ddof=1) / np.sqrt(grads.shape[0])
    live = se > 0
    np.testing.assert_array_equal(mean[~live], np.asarray(expected)[~live])
    return np.abs(mean - np.asarray(expected))[live] / se[live]


def test_selection_bias_refusals_are_one_line():
    z = _logits((3, 5))
    for options, message in (({"selection_bias": jnp.zeros(4)},
                              r"selection_bias must have shape \[N\] = \(5,\), got \(4,\)"),
                             ({"selection_bias": BIAS, "backward_scale": 1.0},
                              r"backward_scale=1.0 does not compose with selection_bias")):
        with pytest.raises(ValueError, match=message) as err:
            sparsemixer_route(z, KEY, **options)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("estimator", ["mix", "euler", "midpoint"])
def test_selection_bias_monte_carlo_gradient_matches_exact_expectation(mc_problem, estimator):
    """Mean of 40k router gradients with D ~ q = softmax(z + b) (masked), gate pi_D, against
    the two-path estimator's enumerated expectation (exact nabla_1 along grad pi, the rule's
    nabla_0 along grad q), within 4.5 standard errors per component."""
    grads = _mc_gradients(mc_problem, estimator=estimator, selection_bias=BIAS)
    expected = oracle.selection_bias_expected_gradient(
        mc_problem, _gates_of_biased, _sampling_of_biased, estimator=estimator)
    z_scores = _z_scores(grads, expected)
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}"


#: Samples of the power check below: at 40k the mid-point and Euler expectations of the biased
#: problem differ by 3.7 standard errors at most, too little to tell them apart; at 2^20 by
#: about 19 (SE shrinks as 1/sqrt(T)), twice the 9 the check asks for. About 5 s on 2 CPU cores.
MC_POWER_SAMPLES = 2**20


def test_selection_bias_monte_carlo_tells_the_midpoint_rule_from_euler(mc_problem):
    """Power of the biased top-1 test for the default estimator ("mix"): off the argmax it
    estimates ``nabla_0`` by the mid-point rule, ``u(1/2)`` (the reduced branch, forward weight
    1/2). With enough samples the exact mid-point and Euler (``u(1)``) expectations differ by
    more than ``2 Z_SE`` standard errors on some component, and the Monte Carlo mean lies within
    ``Z_SE`` of the mid-point's: an Euler quadrature misses it by more than ``Z_SE``, so does an
    even mix of the two (half the gap, more than ``Z_SE``), and so does another reduced forward
    weight ``w`` (``u(w)`` in place of ``u(1/2)``)."""
    grads = _mc_gradients(mc_problem, samples=MC_POWER_SAMPLES, selection_bias=BIAS)
    se = grads.std(0, ddof=1) / np.sqrt(grads.shape[0])
    midpoint, euler = (np.asarray(oracle.selection_bias_expected_gradient(
        mc_problem, _gates_of_biased, _sampling_of_biased, estimator=e)) for e in ("mix", "euler"))
    live = se > 0
    gap = np.abs(midpoint - euler)[live] / se[live]
    assert np.max(gap) > 2 * Z_SE, f"mid-point - Euler in standard errors: {gap}"
    z_scores = _z_scores(grads, midpoint)
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}"


def test_selection_bias_test_fails_the_released_single_path_backward(mc_problem):
    """Power: the released backward under the same bias misses the two-path expectation by far
    more than 4.5 standard errors; it matches its own, biased, expectation instead."""
    grads = _mc_gradients(mc_problem, route=_released_backward_under_bias, selection_bias=BIAS)
    two_path, single_path = (oracle.selection_bias_expected_gradient(
        mc_problem, _gates_of_biased, _sampling_of_biased, single_path=single)
        for single in (False, True))
    assert np.max(_z_scores(grads, two_path)) > 2 * Z_SE
    z_scores = _z_scores(grads, single_path)
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}"


# ---------------------------------------------------------------- top-1, written out


def _take(values, index):
    return jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0]


def _written_out_top1_route(logits, key, *, jitter_eps=0.1, training=True, mask="reference",
                            estimator="mix", midpoint_prob=0.5, backward_scale=2.0):
    """Top-1 SparseMixer written out step by step (as microsoft/SparseMixer's forward): the
    router with ``top_k=1`` must reproduce it bit for bit."""
    probs = router_probs(logits, jitter_eps, mask)
    top = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    if not training:
        return top, _take(probs, top), probs
    sample_key, coin_key = jax.random.split(key)
    masked_logits = jnp.log(jax.lax.stop_gradient(probs))
    expert = jax.random.categorical(sample_key, masked_logits, axis=-1).astype(jnp.int32)
    if estimator == "euler":
        use_midpoint = jnp.zeros(expert.shape, dtype=bool)
    elif estimator == "midpoint":
        use_midpoint = jnp.ones(expert.shape, dtype=bool)
    else:
        coin = jax.random.bernoulli(coin_key, midpoint_prob, expert.shape)
        use_midpoint = coin & (expert != top)
    forward_scale = jnp.where(use_midpoint, 0.5, 1.0).astype(probs.dtype)
    gate = scaled_gate(_take(probs, expert), forward_scale, float(backward_scale))
    return expert, gate, probs


@pytest.mark.parametrize(
    "options",
    [{}, {"estimator": "euler"}, {"estimator": "midpoint"}, {"midpoint_prob": 1.0},
     {"mask": "paper", "backward_scale": 1.0}, {"mask": "none"}, {"training": False}],
    ids=["mix", "euler", "midpoint", "paper-coin", "paper-mask", "no-mask", "eval"],
)
def test_top1_is_bit_for_bit_the_written_out_router(options):
    z = _logits((64, 5), scale=0.5, seed=4).astype(jnp.bfloat16)  # bf16: the cast path too

    def both(z, key):
        def new(z):
            out = sparsemixer_route(z, key, top_k=1, **options)
            return jnp.sum(out.gate * jnp.arange(64)), out

        def old(z):
            expert, gate, probs = _written_out_top1_route(z, key, **options)
            return jnp.sum(gate * jnp.arange(64)), (expert, gate, probs)

        return jax.grad(new, has_aux=True)(z), jax.grad(old, has_aux=True)(z)

    (g_new, out), (g_old, (expert, gate, probs)) = jax.jit(both)(z, KEY)
    for a, b in ((out.expert, expert), (out.gate, gate), (out.probs, probs), (g_new, g_old)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert out.gate.shape == (64,)


# ---------------------------------------------------------------- top-k


@pytest.fixture(scope="module")
def top2_samples():
    """40k training draws of top-2 routing on one token (module-scoped: one compilation)."""
    z = jnp.array([1.0, 0.9, 0.85, 0.95, -0.5])  # expert 4 masked at every step
    out = route(jnp.broadcast_to(z, (MC_SAMPLES, 5)), KEY, top_k=2)
    return z, jax.device_get(out)


def test_top2_distinct_experts_and_masked_never_sampled(top2_samples):
    z, out = top2_samples
    expert = np.asarray(out.expert)
    assert expert.shape == (MC_SAMPLES, 2) and out.gate.shape == (MC_SAMPLES, 2)
    assert np.all(expert[:, 0] != expert[:, 1]), "the second expert equals the first"
    assert not np.any(expert == 4), "a masked expert was sampled"
    # -inf excludes an expert in every step, also when it would otherwise be eligible.
    z_inf = jnp.broadcast_to(z.at[1].set(-jnp.inf), (4096, 5))
    out_inf = route(z_inf, KEY, top_k=3)
    assert not np.any(np.asarray(out_inf.expert) == 1)
    rows = np.sort(np.asarray(out_inf.expert), axis=-1)
    assert np.all(np.diff(rows, axis=-1) > 0)


def test_top2_second_expert_frequencies_match_conditional_probs(top2_samples):
    """P(D2 = j) = sum_i pi_i pi^(i)_j, with pi^(i) the masked softmax without expert i."""
    z, out = top2_samples
    first = np.asarray(router_probs(z, 0.1), np.float64)
    second = np.zeros(5)
    for i in range(5):
        cond = np.asarray(router_probs(z.at[i].set(-jnp.inf), 0.1), np.float64)
        second += first[i] * cond
    for slot, probs in ((0, first), (1, second)):
        freq = np.bincount(np.asarray(out.expert)[:, slot], minlength=5) / MC_SAMPLES
        se = np.sqrt(probs * (1 - probs) / MC_SAMPLES)
        live = probs > 0
        assert np.all(np.abs(freq - probs)[live] < Z_SE * se[live]), (slot, freq, probs, se)
        assert np.all(freq[~live] == 0)
    # The gate of slot 2 is the conditional probability of its expert (not renormalised).
    e1, e2 = np.asarray(out.expert).T
    cond = np.stack([np.asarray(router_probs(z.at[i].set(-jnp.inf), 0.1)) for i in range(5)])
    ratio = np.asarray(out.gate)[:, 1] / cond[e1, e2]
    assert set(np.round(np.unique(ratio), 6)) <= {0.5, 1.0}


@pytest.mark.parametrize(("estimator", "weight", "prob"), [("v2", 1 / 3, 0.75),
                                                           ("v2star", 1 / 3, 0.375)])
def test_v2_coin_and_weights(estimator, weight, prob):
    """GRIN's coin: off the argmax, weight 1/3 with probability 0.75 (v2) or 3/8 (v2star)."""
    num = MC_SAMPLES
    z = jnp.broadcast_to(jnp.array([1.0, 0.95, 0.9]), (num, 3))
    out = route(z, KEY, top_k=2, estimator=estimator)
    expert, gate = np.asarray(out.expert), np.asarray(out.gate)
    for slot in range(2):
        if slot == 0:
            probs = np.broadcast_to(np.asarray(out.probs), (num, 3))
            top = np.zeros(num, int)
        else:
            cond = np.stack([np.asarray(router_probs(z[0].at[i].set(-jnp.inf), 0.1))
                             for i in range(3)])
            probs = cond[expert[:, 0]]
            top = np.argmax(probs, -1)
        chosen = np.take_along_axis(probs, expert[:, slot, None], -1)[:, 0]
        ratio = gate[:, slot] / chosen
        assert np.all(np.isclose(ratio, weight, rtol=1e-6) | (ratio == 1.0))
        on_top = expert[:, slot] == top
        assert np.all(ratio[on_top] == 1.0), "the argmax always takes the full weight"
        reduced = np.isclose(ratio[~on_top], weight).mean()
        se = np.sqrt(prob * (1 - prob) / (~on_top).sum())
        assert abs(reduced - prob) < Z_SE * se, (slot, reduced, prob, se)


def test_topk_eval_is_deterministic_sorted_topk():
    z = _logits((4, 6, 5), seed=2)
    for k in (2, 3, 5):
        a = route(z, jax.random.key(1), top_k=k, training=False)
        b = route(z, None, top_k=k, training=False)
        np.testing.assert_array_equal(a.expert, jax.lax.top_k(z, k)[1])
        np.testing.assert_array_equal(a.expert, b.expert)
        np.testing.assert_array_equal(a.gate, b.gate)
        # Gate t: probability of the t-th best logit among the experts not yet chosen.
        z_np, expert = np.asarray(z), np.asarray(a.expert)
        for t in range(k):
            remaining = z_np.copy()
            np.put_along_axis(remaining, expert[..., :t], -np.inf, -1) if t else None
            cond = np.asarray(router_probs(jnp.asarray(remaining), 0.1))
            want = np.take_along_axis(cond, expert[..., t, None], -1)[..., 0]
            np.testing.assert_allclose(a.gate[..., t], want, rtol=1e-6)
    sw = switch(z, None, top_k=2, training=False)
    np.testing.assert_array_equal(sw.expert, jax.lax.top_k(z, 2)[1])
    np.testing.assert_allclose(sw.gate, jax.lax.top_k(jax.nn.softmax(z), 2)[0], rtol=1e-6)


def test_topk_bfloat16_logits():
    z32 = _logits((8, 6)).astype(jnp.bfloat16).astype(jnp.float32)
    z16 = z32.astype(jnp.bfloat16)
    out16, out32 = route(z16, KEY, top_k=2), route(z32, KEY, top_k=2)
    assert out16.gate.dtype == jnp.float32 and out16.probs.dtype == jnp.float32
    np.testing.assert_array_equal(out16.expert, out32.expert)
    np.testing.assert_allclose(out16.gate, out32.gate, rtol=1e-6)
    grad16 = gate_grad(z16, KEY, top_k=2, estimator="v2star")
    grad32 = gate_grad(z32, KEY, top_k=2, estimator="v2star")
    assert grad16.dtype == jnp.bfloat16
    np.testing.assert_allclose(grad16.astype(jnp.float32), grad32, rtol=1e-2, atol=1e-2)


def test_top_k_equal_to_num_experts_routes_to_every_expert():
    z = _logits((16, 3), scale=3.0)
    out = route(z, KEY, top_k=3, estimator="v2star")
    np.testing.assert_array_equal(np.sort(np.asarray(out.expert), -1), np.tile([0, 1, 2], (16, 1)))
    np.testing.assert_array_equal(out.gate[:, -1], 1.0)  # the last expert is left alone
    chex.assert_tree_all_finite(gate_grad(z, KEY, top_k=3, estimator="v2star"))
    with pytest.raises(ValueError, match=r"top_k=4 is larger than num_experts=3"):
        sparsemixer_route(z, KEY, top_k=4)
    with pytest.raises(ValueError, match=r"top_k=4 is larger than num_experts=3"):
        switch_route(z, KEY, top_k=4)


def test_topk_gradient_is_scaled_conditional_jacobian():
    """d sum(gate)/dz = s * sum_t d pi^(t)_{D_t} / dz, the coin never entering the backward."""
    z = _logits((6, 5))
    out = route(z, KEY, top_k=2, estimator="v2")
    grad = gate_grad(z, KEY, top_k=2, estimator="v2")
    e1 = np.asarray(out.expert)[:, 0]

    def conditional(zi, i):
        return router_probs(jnp.where(jnp.arange(5) == i, -jnp.inf, zi), 0.1)

    want = np.zeros((6, 5))
    for r in range(6):
        jac1 = jax.jacobian(lambda zi: router_probs(zi, 0.1))(z[r])
        jac2 = jax.jacobian(conditional)(z[r], e1[r])
        want[r] = jac1[out.expert[r, 0]] + jac2[out.expert[r, 1]]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- top-k Monte Carlo vs oracle


@pytest.mark.parametrize("estimator", ["v2", "v2star", "mix"])
def test_top2_monte_carlo_gradient_matches_exact_expectation(mc_problem, estimator):
    """Mean of 40k top-2 router gradients vs the enumerated expectation
    (oracle.topk_expected_gradient), within 4.5 standard errors per component."""
    problem = mc_problem._replace(logits=jnp.array([1.0, 0.9, 0.85, 0.95, -0.5]))

    def total(z_batch):
        out = sparsemixer_route(z_batch, jax.random.key(11), top_k=2, estimator=estimator)
        y = jnp.einsum("tk,tkd->td", out.gate, problem.expert_outputs[out.expert])
        return jnp.sum(jax.vmap(problem.downstream)(y))

    z_batch = jnp.broadcast_to(problem.logits, (MC_SAMPLES, 5))
    grads = np.asarray(jax.jit(jax.grad(total))(z_batch), np.float64)
    mean = grads.mean(0)
    se = grads.std(0, ddof=1) / np.sqrt(MC_SAMPLES)

    def probs_fn(z):
        return router_probs(z, 0.1)

    other = "v2" if estimator != "v2" else "v2star"

    @jax.jit
    def expected_gradients(problem):
        return [oracle.topk_expected_gradient(problem, probs_fn, 2, estimator=e)
                for e in (estimator, other)]

    expected, alternative = (np.asarray(g) for g in expected_gradients(problem))
    live = se > 0
    np.testing.assert_array_equal(mean[~live], expected[~live])
    z_scores = np.abs(mean - expected)[live] / se[live]
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}, SE {se}"
    # Power: v2 and v2star expectations differ by far more than the noise.
    assert np.max(np.abs(alternative - expected)[live] / se[live]) > 2 * Z_SE


@pytest.mark.parametrize("estimator", ["v2", "v2star"])
def test_top2_selection_bias_monte_carlo_gradient_matches_exact_expectation(mc_problem,
                                                                            estimator):
    """Mean of 40k top-2 router gradients under the selection bias against the enumerated
    two-path expectation (oracle.topk_selection_bias_expected_gradient), within 4.5 standard
    errors per component; the other estimator's expectation is far off (power)."""

    def total(z_batch):
        out = sparsemixer_route(z_batch, jax.random.key(12), top_k=2, estimator=estimator,
                                selection_bias=BIAS)
        y = jnp.einsum("tk,tkd->td", out.gate, mc_problem.expert_outputs[out.expert])
        return jnp.sum(jax.vmap(mc_problem.downstream)(y))

    z_batch = jnp.broadcast_to(mc_problem.logits, (MC_SAMPLES, 5))
    grads = np.asarray(jax.jit(jax.grad(total))(z_batch), np.float64)
    other = "v2" if estimator != "v2" else "v2star"

    @jax.jit
    def expected_gradients(problem):
        return [oracle.topk_selection_bias_expected_gradient(
            problem, _gates_of_biased, _sampling_of_biased, 2, estimator=e)
            for e in (estimator, other)]

    expected, alternative = expected_gradients(mc_problem)
    z_scores = _z_scores(grads, expected)
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}"
    assert np.max(_z_scores(grads, alternative)) > 2 * Z_SE


# ---------------------------------------------------------------- README


def test_readme_router_snippet_runs_as_written():
    """The first code block of the README's "The router in your own code" runs unchanged."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## The router in your own code", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    names: dict = {}
    exec(compile(snippet, "README.md", "exec"), names)
    tokens, emb = names["tokens"], names["emb"]
    assert names["y"].shape == names["y2"].shape == (tokens, emb)
    assert names["out2"].expert.shape == (tokens, 2)
    assert np.all(np.isfinite(names["y2"])) and np.isfinite(float(names["aux"]))
