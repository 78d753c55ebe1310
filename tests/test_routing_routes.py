"""The routes ``sparsemixer_route`` picks among, one per algorithm: each called on its own gives
what the router gives, and checks its own arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax.routers import (
    limit_to_groups,
    selection_scores,
    sparsemixer_route,
    sparsemixer_selection_bias_route,
    sparsemixer_sigmoid_route,
    sparsemixer_softmax_route,
)

KEY = jax.random.key(3)
N = 6
# Logits close together relative to their size, so that most experts pass the mask and the
# router gradient is not zero (a lone eligible expert has gate 1 and no gradient).
LOGITS = 3.0 + 0.3 * jax.random.normal(jax.random.key(1), (4, N))
BIAS = 0.2 * jax.random.normal(jax.random.key(2), (N,))
WEIGHTS = jax.random.normal(jax.random.key(4), (4, 2))


def _outputs_and_gradient(route, logits, top_k, **options):
    """The route's outputs and the gradient of a fixed linear function of its gates and
    probabilities with respect to the logits."""
    def loss(z):
        out = route(z, KEY, top_k=top_k, **options)
        gates = out.gate.reshape(4, -1)
        return jnp.sum(gates * WEIGHTS[:, :top_k]) + jnp.sum(out.probs[..., 0]), out

    grad, out = jax.grad(loss, has_aux=True)(logits)
    return out, grad


CASES = [
    # (the route, its own options, the router's options selecting it)
    (sparsemixer_softmax_route, {}, {}),
    (sparsemixer_softmax_route, {"backward_scale": 1.0, "mask": "paper"},
     {"backward_scale": 1.0, "mask": "paper"}),
    (sparsemixer_selection_bias_route, {}, {"selection_bias": BIAS}),
    (sparsemixer_sigmoid_route, {"routed_scaling_factor": 2.5},
     {"score": "sigmoid", "routed_scaling_factor": 2.5}),
    (sparsemixer_sigmoid_route, {"selection_bias": BIAS},
     {"score": "sigmoid", "selection_bias": BIAS}),
]


@pytest.mark.parametrize(("route", "own", "router"), CASES)
@pytest.mark.parametrize(("estimator", "top_k"), [("mix", 1), ("v2star", 2), ("euler", 2)])
def test_each_route_is_what_the_router_computes(route, own, router, estimator, top_k):
    """The router adds checks and nothing else: outputs and gradients are equal bit for bit (the
    same operations run in the same order, so no tolerance is needed)."""
    if route is sparsemixer_selection_bias_route:
        def route(z, key, **options):  # the bias is its third positional argument
            return sparsemixer_selection_bias_route(z, key, BIAS, **options)
    expected, expected_grad = _outputs_and_gradient(sparsemixer_route, LOGITS, top_k,
                                                    estimator=estimator, **router)
    got, got_grad = _outputs_and_gradient(route, LOGITS, top_k, estimator=estimator, **own)
    assert np.any(np.asarray(expected_grad) != 0)  # the comparison is not of zeros
    for name in ("expert", "gate", "probs", "scores"):
        want, have = getattr(expected, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            np.testing.assert_array_equal(np.asarray(have), np.asarray(want), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got_grad), np.asarray(expected_grad))


def test_the_routes_differ_where_the_router_chooses_between_them():
    """The equality above would hold vacuously if every route computed the same thing."""
    softmax = sparsemixer_softmax_route(LOGITS, KEY, top_k=2)
    biased = sparsemixer_selection_bias_route(LOGITS, KEY, 3.0 * BIAS, top_k=2)
    sigmoid = sparsemixer_sigmoid_route(LOGITS, KEY, top_k=2)
    assert sigmoid.scores is not None and softmax.scores is None
    assert not np.array_equal(np.asarray(softmax.gate), np.asarray(sigmoid.gate))
    assert not np.array_equal(np.asarray(softmax.expert), np.asarray(biased.expert))


def _bias_route(z, key, **options):
    return sparsemixer_selection_bias_route(z, key, BIAS, **options)


ROUTES = [("sparsemixer_softmax_route", sparsemixer_softmax_route),
          ("sparsemixer_selection_bias_route", _bias_route),
          ("sparsemixer_sigmoid_route", sparsemixer_sigmoid_route)]


@pytest.mark.parametrize(("name", "route"), ROUTES)
@pytest.mark.parametrize(("logits", "key", "options", "message"), [
    (LOGITS, KEY, {"top_k": N + 1}, r"top_k=7 is larger than num_experts=6"),
    (LOGITS, None, {}, r"needs a PRNG key when training=True"),
    (LOGITS, KEY, {"estimator": "euler", "midpoint_prob": 0.5},
     r"midpoint_prob=0.5 has no effect with estimator='euler'"),
    (LOGITS.at[1, 2].set(jnp.nan), KEY, {},
     r"logits hold NaN or \+inf for 1 token\(s\), first at index \(1,\)"),
])
def test_each_route_checks_its_arguments_in_one_line_naming_itself(name, route, logits, key,
                                                                   options, message):
    with pytest.raises(ValueError, match=f"^{name}:? {message}") as error:
        route(logits, key, **options)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("route", "kwargs", "message"), [
    (lambda **kw: sparsemixer_selection_bias_route(LOGITS, KEY, jnp.zeros(3), **kw), {},
     r"sparsemixer_selection_bias_route: selection_bias must have shape \[N\] = \(6,\), "
     r"got \(3,\)"),
    (lambda **kw: sparsemixer_sigmoid_route(LOGITS, KEY, **kw),
     {"selection_bias": jnp.zeros((2, N))},
     r"sparsemixer_sigmoid_route: selection_bias must have shape \[N\] = \(6,\), got \(2, 6\)"),
    (lambda **kw: sparsemixer_sigmoid_route(LOGITS, KEY, **kw), {"routed_scaling_factor": 0.0},
     r"sparsemixer_sigmoid_route: routed_scaling_factor must be a finite number > 0, got 0.0"),
])
def test_each_route_checks_its_own_options(route, kwargs, message):
    with pytest.raises(ValueError, match=message):
        route(**kwargs)


@pytest.mark.parametrize(("name", "route"), ROUTES)
def test_tokens_marked_invalid_route_to_nan_without_a_check(name, route):
    """``invalid`` is the caller's verdict on the logits: those tokens get NaN gates and
    probabilities, the others are routed as without it."""
    invalid = jnp.array([False, True, False, False])
    marked = route(LOGITS, KEY, top_k=2, invalid=invalid)
    plain = route(LOGITS, KEY, top_k=2)
    assert np.all(np.isnan(np.asarray(marked.gate[1]))), name
    assert np.all(np.isnan(np.asarray(marked.probs[1]))), name
    keep = np.asarray(~invalid)
    np.testing.assert_array_equal(np.asarray(marked.gate)[keep], np.asarray(plain.gate)[keep])
    np.testing.assert_array_equal(np.asarray(marked.expert)[keep],
                                  np.asarray(plain.expert)[keep])


def test_a_bad_token_stays_nan_when_its_bad_expert_falls_in_an_excluded_group():
    """Group-limited routing excludes experts before the route runs; a token whose logits held
    +inf still gets NaN gates (under ``jit``, where it cannot raise), even when the group
    holding the +inf is the one excluded: the router judges the logits as given."""
    # Under sigmoid scores sigmoid(30) and sigmoid(+inf) are both 1.0 in float32, so the
    # groups tie and the first (without the +inf) is kept.
    logits = LOGITS.at[0, 0].set(30.0).at[0, N - 1].set(jnp.inf)
    kept = limit_to_groups(selection_scores(logits, None, "sigmoid"), 2, 1)
    assert np.isneginf(np.asarray(kept[0, N - 1]))  # the premise: the +inf is excluded
    route = jax.jit(lambda z: sparsemixer_route(z, KEY, num_groups=2, top_groups=1,
                                                score="sigmoid", training=False))
    out = route(logits)
    assert np.isnan(np.asarray(out.gate[0])) and np.all(np.isnan(np.asarray(out.probs[0])))
    assert np.all(np.isfinite(np.asarray(out.gate[1:])))
