"""SparseMixer under sigmoid scores (docs/routing.md): the sampling distribution, the router
against the exact-gradient oracle (Monte Carlo, with a power check), jit / vmap / bf16 logits,
the evaluation forward and the config. The orders of accuracy: tests/test_exact_gradient.py
(the accuracy experiment under sigmoid scores)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import exact as oracle
from sparsemixer_jax import routers

SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor
JITTER = 0.3
# Five experts; with the bias the selection scores s + b are [.67, .66, .65, .48, .12]: the best
# moves from expert 1 (the largest logit) to expert 0, and the reference mask at
# jitter_eps = 0.3 (kept: within 60% of the best) leaves expert 4 out of every draw.
LOGITS = jnp.array([0.2, 0.9, 0.6, -0.1, -2.0])
BIAS = jnp.array([0.12, -0.05, 0.0, 0.0, 0.0])
MC_SAMPLES = 40_000
Z_SE = 4.5  # per component; 5 components: a false alarm has chance below 4e-5


def _problem():
    problem = oracle.random_problem(jax.random.key(7), num_experts=5, dim=3)
    return problem._replace(logits=LOGITS, expert_outputs=2.0 * problem.expert_outputs)


def _sampling(z):
    return routers.sigmoid_sample_probs(z, BIAS, JITTER)


def test_sampling_distribution_is_the_normalised_selection_scores():
    s = jax.nn.sigmoid(LOGITS)
    # b = 0, no mask: the normalised scores the balance loss reads.
    np.testing.assert_allclose(routers.sigmoid_sample_probs(LOGITS, None, 0.0, "none"),
                               s / jnp.sum(s), rtol=1e-6)
    x = s + BIAS
    q = np.asarray(_sampling(LOGITS))
    keep = np.asarray(routers.routing_mask(x, JITTER))
    np.testing.assert_allclose(q, np.where(keep, x, 0) / np.sum(np.where(keep, x, 0)), rtol=1e-6)
    assert np.argmax(q) == np.argmax(np.asarray(x)) == 0 and np.argmax(np.asarray(LOGITS)) == 1
    # A non-positive score is never drawn; with none positive the best takes all the mass;
    # -inf (excluded) stays out.
    low = routers.sigmoid_sample_probs(LOGITS, jnp.array([0.0, 0.0, -0.7, 0.0, 0.0]), 0.0,
                                       "none")
    assert float(low[2]) == 0.0 and float(jnp.sum(low)) == pytest.approx(1.0)
    none = routers.sigmoid_sample_probs(LOGITS, -jnp.ones(5), 0.0, "none")
    np.testing.assert_array_equal(none, jax.nn.one_hot(1, 5))
    gone = routers.sigmoid_sample_probs(LOGITS.at[1].set(-jnp.inf), None, 0.0, "none")
    assert float(gone[1]) == 0.0 and np.all(np.asarray(gone)[[0, 2, 3, 4]] > 0)


def _mc_gradients(problem, top_k, estimator):
    config = routers.RouterConfig({"mix": "sparsemixer", "v2star": "sparsemixer_v2star"}[
        estimator], top_k=top_k, jitter_eps=JITTER, score="sigmoid",
        routed_scaling_factor=SCALE, bias_update_rate=0.01).check("", 5)
    route = routers.router_fn(config)

    def total(z_batch):
        out = route(z_batch, jax.random.key(11), True, BIAS)
        gate = out.gate.reshape(MC_SAMPLES, top_k)
        expert = out.expert.reshape(MC_SAMPLES, top_k)
        y = jnp.einsum("tk,tkd->td", gate, problem.expert_outputs[expert])
        return jnp.sum(jax.vmap(problem.downstream)(y))

    z_batch = jnp.broadcast_to(problem.logits, (MC_SAMPLES, 5))
    grads = np.asarray(jax.jit(jax.grad(total))(z_batch), np.float64)
    return grads.mean(0), grads.std(0, ddof=1) / np.sqrt(MC_SAMPLES)


@pytest.mark.parametrize("top_k, estimator, wrong", [
    (1, "mix", "single_path"), (2, "v2star", "per_step")])
def test_monte_carlo_gradient_matches_the_exact_expectation(top_k, estimator, wrong):
    """Mean of 40k router gradients against the enumerated expectation
    (oracle.sigmoid_expected_gradient), within 4.5 standard errors per component; a wrong
    variant's expectation (the released single path: zero at top-1; each gate's share along
    its own step only at top-2) lies more than 9 standard errors away on some component, so
    the test can tell them apart."""
    problem = _problem()
    mean, se = _mc_gradients(problem, top_k, estimator)

    @jax.jit
    def expectations(problem):
        return tuple(oracle.sigmoid_expected_gradient(
            problem, _sampling, top_k, estimator=estimator, scale=SCALE, variant=v)
            for v in ("two_path", wrong))

    expected, off = (np.asarray(g) for g in expectations(problem))
    live = se > 0
    assert live.sum() >= 4
    z_scores = np.abs(mean - expected)[live] / se[live]
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}, SE {se}"
    assert np.max(np.abs(off - expected)[live] / se[live]) > 2 * Z_SE


_route = routers.router_fn(routers.RouterConfig(
    "sparsemixer_v2star", top_k=2, jitter_eps=JITTER, score="sigmoid",
    routed_scaling_factor=SCALE, bias_update_rate=0.01).check("", 5))
COTANGENT = jnp.array([[0.7, -1.3], [0.2, 0.5], [-0.9, 1.1]])
TOKENS = jnp.stack([LOGITS, LOGITS[::-1], 0.5 * LOGITS + 0.3])


def _loss(z, key):
    out = _route(z, key, True, BIAS)
    return jnp.sum(out.gate * COTANGENT), out


_grad_and_route = jax.jit(jax.grad(_loss, has_aux=True))


def test_router_under_jit_vmap_and_bf16_logits_and_its_evaluation_forward():
    keys = jax.random.split(jax.random.key(4), 3)
    grad, out = _grad_and_route(TOKENS, keys[0])
    # Gates: c s_D / sum of the chosen s, or a third of it on Heun's reduced branch.
    s = jax.nn.sigmoid(TOKENS)
    chosen = jnp.take_along_axis(s, out.expert, -1)
    ratio = np.asarray(out.gate / (SCALE * chosen / jnp.sum(chosen, -1, keepdims=True)))
    assert np.all(np.isclose(ratio, 1.0, rtol=1e-6) | np.isclose(ratio, 1 / 3, rtol=1e-6))
    np.testing.assert_array_equal(out.scores, s)
    np.testing.assert_allclose(out.probs, s / jnp.sum(s, -1, keepdims=True), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.abs(np.asarray(grad)).max(-1) > 0)
    batched = jax.vmap(_grad_and_route, in_axes=(None, 0))(TOKENS, keys)
    for i, key in enumerate(keys):
        alone = _grad_and_route(TOKENS, key)
        np.testing.assert_array_equal(batched[1].expert[i], alone[1].expert)
        chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], batched), alone,
                                    rtol=1e-6, atol=1e-7)
    low = TOKENS.astype(jnp.bfloat16)
    low_grad, low_out = _grad_and_route(low, keys[0])
    chex.assert_trees_all_equal(low_out, _grad_and_route(low.astype(jnp.float32), keys[0])[1])
    assert low_grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(low_grad, float)))
    # Evaluation: the type's deterministic forward, TopK(s + b) with Switch's sigmoid gates.
    evaluated = _route(TOKENS, None, False, BIAS)
    switch = routers.switch_route(TOKENS, None, top_k=2, training=False, score="sigmoid",
                                  routed_scaling_factor=SCALE, selection_bias=BIAS)
    np.testing.assert_array_equal(evaluated.expert, switch.expert)
    np.testing.assert_allclose(evaluated.gate, switch.gate, rtol=1e-6)
    # Under jit to float32 rounding (XLA may fuse the renormalisation differently: 1 ulp seen).
    chex.assert_trees_all_close(evaluated, jax.jit(lambda z: _route(z, None, False, BIAS))(TOKENS),
                                rtol=1e-6, atol=0)


def test_top1_gate_is_the_scale_and_the_router_learns_through_the_selection():
    """At top-1 the renormalised gate is always c (nabla_1 = 0); the router's gradient is the
    selection term's estimate alone, nonzero off the argmax."""
    route = routers.router_fn(routers.RouterConfig(
        "sparsemixer", jitter_eps=JITTER, score="sigmoid", routed_scaling_factor=SCALE
    ).check("", 5))

    def loss(z):
        out = route(z, jax.random.key(0), True)
        return jnp.sum(out.gate * jnp.arange(64.0)), out

    grad, out = jax.jit(jax.grad(loss, has_aux=True))(jnp.broadcast_to(LOGITS, (64, 5)))
    assert set(np.unique(np.asarray(out.gate)).tolist()) == {SCALE, SCALE / 2}
    assert float(jnp.max(jnp.abs(grad))) > 0


def test_groups_are_chosen_on_the_biased_scores():
    """Five groups of one expert, two kept: every draw, in training and evaluation, is one of
    the two best of s + b (experts 0 and 1; the best logit alone would keep 1 and 2)."""
    @jax.jit
    def draws_and_choice(z):
        return tuple(routers.sparsemixer_route(
            z, jax.random.key(2), training=is_training, score="sigmoid", selection_bias=BIAS,
            num_groups=5, top_groups=2, jitter_eps=1.0).expert for is_training in (True, False))

    drawn, chosen = draws_and_choice(jnp.broadcast_to(LOGITS, (64, 5)))
    assert set(np.unique(np.asarray(drawn)).tolist()) == {0, 1}
    np.testing.assert_array_equal(chosen, 0)


@pytest.mark.parametrize("options, message", [
    (dict(name="densemixer_blog", top_k=2),
     "score='sigmoid' does not compose with router 'densemixer_blog'"),
    (dict(name="switch", top_k=1), "score='sigmoid' needs top_k >= 2 with router 'switch'"),
])
def test_remaining_refusals_are_one_line(options, message):
    with pytest.raises(ValueError, match=message) as err:
        routers.check_router(score="sigmoid", **options)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"backward_scale=2\.0 does not compose with "
                                         r"score='sigmoid'"):
        routers.sparsemixer_route(LOGITS, jax.random.key(0), score="sigmoid",
                                  backward_scale=2.0)
    with pytest.raises(ValueError, match=r"routed_scaling_factor=2\.0 has no effect"):
        routers.sparsemixer_route(LOGITS, jax.random.key(0), routed_scaling_factor=2.0)


def test_config_accepts_every_sparsemixer_router_under_sigmoid_scores():
    for name in ("sparsemixer", "sparsemixer_1st", "sparsemixer_2nd", "sparsemixer_paper",
                 "sparsemixer_nomask", "sparsemixer_v2", "sparsemixer_v2star"):
        for top_k in (1, 2):
            routers.check_router(name, top_k=top_k, score="sigmoid", bias_update_rate=0.01,
                                 num_experts=4)
