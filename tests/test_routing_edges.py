"""The routers where they meet their references' edges, and how to check their gradients.

* SparseMixer's mask test at its threshold, ties in probability, the keys of the top-k steps;
* Switch's renormalised top-k gates;
* what finite differences show against each backward (docs/routing.md, "Checking the router's
  gradients"): exact agreement where the forward is the function the backward differentiates
  (``training=False``; Euler with ``backward_scale=1`` under a fixed key), the ratio
  ``backward_scale / forward weight`` elsewhere, and ``jax.jacfwd`` refused.
"""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

from sparsemixer_jax.routers import (
    get_router,
    router_probs,
    routing_keys,
    routing_mask,
    sparsemixer_route,
    switch_route,
)

KEY = jax.random.key(0)
# A pair of logits within an ulp of the reference mask's threshold at jitter_eps = 0.1.
BOUNDARY = [1.1777266263961792, 0.9421812891960144]


def test_mask_threshold_is_tested_in_the_references_division_form():
    z = np.asarray(BOUNDARY, np.float32)
    gap, scale = z.max() - z, np.maximum(np.abs(z), z.max())
    # The two algebraically equal forms disagree here; the references divide.
    assert not (gap / scale > np.float32(0.2))[1] and (gap > np.float32(0.2) * scale)[1]
    np.testing.assert_array_equal(routing_mask(jnp.asarray(z), 0.1), [True, True])
    probs = router_probs(jnp.asarray(z), 0.1)
    assert float(probs[1]) > 0.4  # expert 1 is eligible, with its softmax share
    # Just past the threshold it is masked: the test is still a threshold.
    np.testing.assert_array_equal(routing_mask(jnp.asarray([1.0, 0.79]), 0.1), [True, False])


def test_zero_logits_keep_every_expert():
    np.testing.assert_array_equal(routing_mask(jnp.zeros((3,)), 0.1), [True, True, True])


def test_probability_ties_are_broken_by_the_logits():
    """Logits 1e-8 apart have equal float32 probabilities; the larger logit is the argmax, as
    in the references (their argmax is of the logits)."""
    z = jnp.tile(jnp.asarray([[0.0, 1e-8]], jnp.float32), (4000, 1))
    probs = router_probs(z, 0.1, "none")
    assert float(probs[0, 0]) == float(probs[0, 1])
    assert int(sparsemixer_route(z[:1], None, training=False, mask="none").expert[0]) == 1
    out = sparsemixer_route(z, KEY, mask="none")
    # The argmax (expert 1) always takes the Euler branch: gate = pi_1; expert 0 is halved
    # about half the time (fair coin), never for expert 1.
    weight = np.asarray(out.gate) / 0.5
    expert = np.asarray(out.expert)
    np.testing.assert_array_equal(weight[expert == 1], 1.0)
    halved = np.mean(weight[expert == 0] == 0.5)
    n0 = int(np.sum(expert == 0))
    assert abs(halved - 0.5) < 4 * np.sqrt(0.25 / n0)  # 4 standard errors
    top2 = sparsemixer_route(z[:1], None, top_k=2, training=False, mask="none")
    np.testing.assert_array_equal(top2.expert[0], [1, 0])


# Logits 2e-8 apart (an ulp or so) whose float32 masked probabilities tie: expert 1 has the
# larger logit, expert 0 the first of the tied probabilities.
TIED = [-0.0399612561, -0.0399612337, -0.2426628917, -1.2282100916]


def _weights_by_expert(z, out, step, jitter_eps):
    """The forward weight ``gate / pi_D`` of top-k step ``step``, and its expert, per token."""
    remaining = np.array(z, np.float32)
    for earlier in range(step):
        remaining[np.arange(len(z)), np.asarray(out.expert)[:, earlier]] = -np.inf
    probs = np.asarray(router_probs(jnp.asarray(remaining), jitter_eps))
    expert = np.asarray(out.expert)[:, step]
    chosen = probs[np.arange(len(z)), expert]
    return np.asarray(out.gate)[:, step] / chosen, expert, probs


@pytest.mark.parametrize("estimator, coin", [("v2", 0.75), ("v2star", 0.375)])
def test_v2_ties_in_probability_go_to_the_first_index_in_training(estimator, coin):
    """GRIN's v2 (Hugging Face ``phimoe``) compares the sampled expert with ``torch.max`` of the
    float32 masked probabilities, whose tie goes to the first index; v2star follows v2. At
    evaluation both take the argmax of the logits."""
    z = np.tile(np.asarray([TIED], np.float32), (4000, 1))
    probs = np.asarray(router_probs(jnp.asarray(z[:1]), 0.01))[0]
    assert probs[0] == probs[1] and z[0, 1] > z[0, 0]  # the premise: a tie, not equal logits
    out = sparsemixer_route(jnp.asarray(z), KEY, top_k=2, jitter_eps=0.01, estimator=estimator)
    weight, expert, _ = _weights_by_expert(z, out, 0, 0.01)
    # Expert 0 is phimoe's argmax: always the full weight. Expert 1 takes the coin: weight
    # 1/3 with probability `coin` (within 4 standard errors).
    np.testing.assert_array_equal(weight[expert == 0], 1.0)
    reduced = np.isclose(weight[expert == 1], 1.0 / 3.0, rtol=1e-6)
    assert np.all(reduced | (weight[expert == 1] == 1.0))
    n1 = int(np.sum(expert == 1))
    assert abs(reduced.mean() - coin) < 4 * np.sqrt(coin * (1 - coin) / n1)
    evaluated = sparsemixer_route(jnp.asarray(z[:1]), None, top_k=2, jitter_eps=0.01,
                                  estimator=estimator, training=False)
    np.testing.assert_array_equal(evaluated.expert[0], [1, 0])


def test_v2_second_step_ties_in_probability_go_to_the_first_index():
    """The second expert's coin compares with the first index of the second step's tied
    probabilities, as ``phimoe`` does for ``masked_gates_top2``."""
    z = np.tile(np.asarray([[TIED[0], TIED[1], -0.035, TIED[3]]], np.float32), (6000, 1))
    out = sparsemixer_route(jnp.asarray(z), KEY, top_k=2, jitter_eps=0.1, estimator="v2")
    first_was_2 = np.asarray(out.expert)[:, 0] == 2
    weight, expert, probs = _weights_by_expert(z[first_was_2], jax.tree.map(
        lambda a: a[first_was_2], out), 1, 0.1)
    assert probs[0, 0] == probs[0, 1] and probs[0, 2] == 0  # the premise: a tie after step 1
    np.testing.assert_array_equal(weight[expert == 0], 1.0)
    reduced = np.isclose(weight[expert == 1], 1.0 / 3.0, rtol=1e-6)
    n1 = int(np.sum(expert == 1))
    assert n1 > 300 and abs(reduced.mean() - 0.75) < 4 * np.sqrt(0.75 * 0.25 / n1)


@pytest.mark.parametrize("estimator", ["mix", "euler"])
def test_top1_estimators_break_probability_ties_by_the_logits_at_top_k(estimator):
    """microsoft/SparseMixer's rule (the argmax of the logits) holds for its estimators at any
    top_k: the larger logit (expert 1) is the argmax, never halved."""
    z = np.tile(np.asarray([TIED], np.float32), (4000, 1))
    out = sparsemixer_route(jnp.asarray(z), KEY, top_k=2, jitter_eps=0.01, estimator=estimator)
    weight, expert, _ = _weights_by_expert(z, out, 0, 0.01)
    np.testing.assert_array_equal(weight[expert == 1], 1.0)
    if estimator == "mix":
        halved = np.isclose(weight[expert == 0], 0.5, rtol=1e-6).mean()
        n0 = int(np.sum(expert == 0))
        assert abs(halved - 0.5) < 4 * np.sqrt(0.25 / n0)


def test_every_topk_step_has_its_own_keys():
    keys = jax.random.key_data(routing_keys(KEY, 3)).reshape(6, -1)
    assert len({tuple(k) for k in np.asarray(keys)}) == 6
    # The first step draws exactly as top-1 does.
    np.testing.assert_array_equal(jax.random.key_data(routing_keys(KEY, 1)[0]),
                                  jax.random.key_data(jax.random.split(KEY)))
    z = jax.random.normal(jax.random.key(1), (64, 6))
    np.testing.assert_array_equal(sparsemixer_route(z, KEY, top_k=2).expert[:, 0],
                                  sparsemixer_route(z, KEY).expert)


@pytest.mark.parametrize("estimator", ["euler", "midpoint"])
def test_midpoint_prob_for_an_estimator_without_a_coin_is_an_error(estimator):
    with pytest.raises(ValueError, match=rf"midpoint_prob=0.3 has no effect with "
                                         rf"estimator='{estimator}'"):
        sparsemixer_route(jnp.zeros((2, 3)), KEY, estimator=estimator, midpoint_prob=0.3)


def test_switch_renormalised_top_k_gates_by_hand():
    z = jnp.asarray([[0.3, 1.2, -0.5, 0.9]])
    p = np.asarray(jax.nn.softmax(z))[0]
    out = switch_route(z, None, top_k=2, training=False, normalize_top_k=True)
    np.testing.assert_array_equal(out.expert[0], [1, 3])
    np.testing.assert_allclose(out.gate[0], p[[1, 3]] / (p[1] + p[3]), rtol=1e-6)
    np.testing.assert_allclose(out.probs[0], p, rtol=1e-6)  # the balance loss reads these
    # d(c . gate)/dz by hand: gate_t = p_t / S, so d gate_t / d p_i = (delta_ti - gate_t) / S
    # for i in {1, 3} and 0 otherwise.
    c = np.array([0.7, -1.3])
    grad = jax.grad(lambda z: jnp.dot(jnp.asarray(c), switch_route(
        z, None, top_k=2, training=False, normalize_top_k=True).gate[0]))(z)
    s, gate = p[1] + p[3], p[[1, 3]] / (p[1] + p[3])
    d_pi = np.zeros(4)
    d_pi[[1, 3]] = (c - np.dot(c, gate)) / s
    np.testing.assert_allclose(grad[0], (np.diag(p) - np.outer(p, p)) @ d_pi, rtol=1e-5,
                               atol=1e-7)
    top1 = get_router("switch", 0.0, 1, normalize_top_k=True)(z, None, False)
    np.testing.assert_array_equal(top1.gate, 1.0)


# ------------------------------------------------------------------ checking the gradients


def _logits64(shape, seed=3):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float64)


def test_eval_routing_passes_check_grads():
    """training=False is an ordinary differentiable function: finite differences agree."""
    with jax.enable_x64(True):
        z = _logits64((8, 5))
        for top_k in (1, 2):
            jax.test_util.check_grads(
                lambda z, k=top_k: sparsemixer_route(z, None, top_k=k, training=False).gate,
                (z,), order=1, modes=["rev"])


def test_euler_with_unit_backward_under_a_fixed_key_passes_check_grads():
    """A fixed key fixes the sampled experts (away from the Gumbel and mask boundaries), and
    Euler with backward_scale=1 is plain backpropagation through the gate: exact."""
    with jax.enable_x64(True):
        z = _logits64((8, 5))
        jax.test_util.check_grads(
            lambda z: sparsemixer_route(z, KEY, estimator="euler", backward_scale=1.0).gate,
            (z,), order=1, modes=["rev"])


def test_training_backward_is_backward_scale_over_forward_weight_times_the_finite_difference():
    """Default "mix": the backward sends 2 dpi_D, while the forward is pi_D (Euler branch) or
    pi_D / 2 (mid-point branch), so the backward is 2x or 4x the finite difference."""
    with jax.enable_x64(True):
        z = _logits64((256, 4)) * 3.0
        u = _logits64((256, 4), seed=4)

        def gate(z):
            return sparsemixer_route(z, KEY, jitter_eps=0.5).gate

        out = sparsemixer_route(z, KEY, jitter_eps=0.5)
        chosen = jnp.take_along_axis(out.probs, out.expert[:, None], -1)[:, 0]
        weight = np.asarray(out.gate / chosen)
        backward = np.sum(np.asarray(jax.grad(lambda z: jnp.sum(gate(z)))(z)) * np.asarray(u), -1)
        h = 1e-6
        fd = np.asarray(gate(z + h * u) - gate(z - h * u)) / (2 * h)
        live = np.abs(fd) > 1e-6  # tokens with pi_D < 1 (an eligible rival)
        assert live.sum() > 50
        ratio = backward[live] / fd[live]
        np.testing.assert_allclose(ratio, 2.0 / weight[live], rtol=1e-5)
        assert set(np.round(ratio, 3)) == {2.0, 4.0}


def test_jacfwd_is_refused_and_jacrev_works():
    z = jax.random.normal(KEY, (3, 4))

    def gate(z):
        return sparsemixer_route(z, KEY).gate

    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(gate)(z)
    jac = jax.jacrev(gate)(z)
    np.testing.assert_allclose(jnp.einsum("iij->ij", jac), jax.grad(lambda z: gate(z).sum())(z),
                               rtol=1e-6)
