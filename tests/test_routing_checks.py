"""The routers' argument checks and non-finite logits, the auxiliary losses and metrics, and
the registry of routers by name."""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax.routers import (
    ROUTERS,
    get_router,
    load_balancing_loss,
    router_z_loss,
    routing_metrics,
    sparsemixer_route,
    switch_route,
    uses_omega,
)

KEY = jax.random.key(0)
_STATIC = (
    "top_k", "jitter_eps", "training", "mask", "estimator", "midpoint_prob", "backward_scale"
)
route = jax.jit(sparsemixer_route, static_argnames=_STATIC)
switch = jax.jit(switch_route, static_argnames=("top_k", "jitter_eps", "training"))


def _logits(shape, scale=1.0, seed=1):
    return scale * jax.random.normal(jax.random.key(seed), shape)


# ---------------------------------------------------------------- argument checks, non-finite


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"jitter_eps": -1.0}, r"jitter_eps must be a finite number >= 0, got -1.0"),
        ({"jitter_eps": float("nan")}, r"jitter_eps must be .* got nan"),
        ({"top_k": 0}, r"top_k must be an int in \[1, num_experts=4\], got 0"),
        ({"top_k": 2.0}, r"top_k must be an int in \[1, num_experts=4\], got 2.0"),
        ({"training": "yes"}, r"training must be a Python bool .* got 'yes'"),
    ],
)
@pytest.mark.parametrize("router", [sparsemixer_route, switch_route])
def test_static_arguments_are_checked_in_the_router(router, kwargs, message):
    with pytest.raises(ValueError, match=message):
        router(_logits((3, 4)), KEY, **kwargs)


def test_more_argument_errors():
    with pytest.raises(ValueError, match=r"logits must have at least one axis .* got shape \(\)"):
        sparsemixer_route(jnp.float32(1.0), KEY)
    with pytest.raises(ValueError, match=r"logits must have at least one axis"):
        switch_route(jnp.float32(1.0), KEY)
    with pytest.raises(ValueError, match=r"midpoint_prob must lie in \[0, 1\], got -0.5"):
        sparsemixer_route(_logits((3,)), KEY, midpoint_prob=-0.5)
    with pytest.raises(ValueError, match="training must be a Python bool"):
        jax.jit(lambda z, t: sparsemixer_route(z, KEY, training=t))(_logits((3,)), True)
    with pytest.raises(ValueError, match="unknown estimator 'v3'"):
        sparsemixer_route(_logits((3,)), KEY, estimator="v3")


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_nan_or_plus_inf_logits(bad):
    z = jnp.array([[0.5, 0.0, 1.0], [bad, 0.0, 1.0]])
    # Outside jit: a clear error naming the token.
    with pytest.raises(ValueError, match=r"NaN or \+inf for 1 token\(s\), first at index \(1,\)"):
        sparsemixer_route(z, KEY)
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        switch_route(z, KEY)
    # Under jit values cannot raise: that token's gate and probs are NaN (the loss turns NaN and
    # the training loop skips the update), the other token is untouched.
    for out in (route(z, KEY, top_k=2), switch(z, KEY)):
        assert np.all(np.isfinite(out.gate[0])) and np.all(np.isnan(out.gate[1]))
        assert np.all(np.isnan(out.probs[1])) and np.all(np.isfinite(out.probs[0]))
        assert np.all((np.asarray(out.expert) >= 0) & (np.asarray(out.expert) < 3))


def test_minus_inf_logits_exclude_experts():
    z = jnp.array([[-jnp.inf, 0.0, 1.0], [-jnp.inf, -jnp.inf, 1.0]])
    out = route(z, KEY)
    np.testing.assert_array_equal(out.probs[:, 0], 0.0)
    chex.assert_tree_all_finite((out.gate, out.probs))
    with pytest.raises(ValueError, match=r"top_k=2 but token \(1,\) has only 1 expert"):
        sparsemixer_route(z, KEY, top_k=2)
    # Under jit: the token without a second expert gets a NaN second gate.
    out2 = route(z, KEY, top_k=2)
    assert np.isfinite(out2.gate[0]).all() and np.isnan(out2.gate[1, 1])


# ---------------------------------------------------------------- losses and metrics


def test_load_balancing_loss_hand_computed():
    probs = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    expert = jnp.array([0, 0, 1, 0])
    # f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.45 + 0.1) = 1.1
    np.testing.assert_allclose(load_balancing_loss(probs, expert), 1.1, rtol=1e-6)
    uniform = jnp.full((4, 4), 0.25)
    np.testing.assert_allclose(load_balancing_loss(uniform, jnp.arange(4)), 1.0, rtol=1e-6)
    # Padding rows are excluded: the masked loss equals the loss on the kept rows.
    mask = jnp.array([True, True, False, True])
    np.testing.assert_allclose(
        load_balancing_loss(probs, expert, mask),
        load_balancing_loss(probs[mask], expert[mask]),
        rtol=1e-6,
    )


def test_z_loss_and_metrics():
    z = jnp.array([[0.0, 0.0], [1.0, -1.0]])
    lse = np.log([2.0, np.exp(1) + np.exp(-1)])
    np.testing.assert_allclose(router_z_loss(z), np.mean(lse**2), rtol=1e-6)
    z = jnp.array([[1.0, 0.95, -3.0], [2.0, -2.0, -2.0]])
    out = route(z, None, training=False)
    m = jax.jit(routing_metrics)(z, out)
    np.testing.assert_allclose(m["num_unmasked"], 1.5)
    np.testing.assert_allclose(m["expert_fraction"], [1.0, 0.0, 0.0])
    p = np.exp(1.0) / (np.exp(1.0) + np.exp(0.95))
    entropy = -(p * np.log(p) + (1 - p) * np.log(1 - p)) / 2
    np.testing.assert_allclose(m["entropy"], entropy, rtol=1e-5)


def test_router_registry():
    for name in ROUTERS:
        out = get_router(name, 0.1)(_logits((3, 4)), KEY, True)
        chex.assert_shape(out.probs, (3, 4))
        assert uses_omega(name) == name.startswith("sparsemixer")
    with pytest.raises(ValueError, match="unknown router"):
        get_router("top2")
    with pytest.raises(ValueError, match="jitter_eps"):
        get_router("switch", -0.1)


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_logits_that_are_not_floats_are_refused_by_every_router(name, dtype):
    """Integer logits were routed as they were (gate 1.0) although the routers take floats."""
    logits = jnp.array([[1, 2, 3, 4], [0, 1, 0, 1]]).astype(dtype)
    dtype_name = jnp.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"logits must have a float dtype .* got {dtype_name};"):
        get_router(name, 0.1)(logits, KEY, True)
    with pytest.raises(ValueError, match=rf"got {dtype_name};"):
        jax.jit(get_router(name, 0.1), static_argnums=2)(logits, KEY, False)
    out = get_router(name, 0.1)(logits.astype(jnp.bfloat16), KEY, True)  # any float is routed
    assert out.gate.dtype == jnp.float32


def test_import_is_cheap():
    code = "import sys, sparsemixer_jax; assert 'tensorflow' not in sys.modules, 'TF imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
