"""Tests of the MoE feed-forward layer (single device): dispatch equivalence, a dense reference,
padding, capacity mode, dtypes, randomness and argument errors."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import routers
from sparsemixer_jax.moe import (
    MoEConfig,
    MoEFeedForward,
    capacity_keep,
    expert_capacity,
    expert_ffn,
    resolve_dispatch,
)
from tests import kit

EMB, MLP, N, B, T = 16, 32, 4, 4, 8


def make_layer(**kw) -> MoEFeedForward:
    return kit.moe_layer(EMB, MLP, N, **kw)


@pytest.fixture(scope="module")
def data():
    """``(x, mask, head)``; ``head`` is a fixed projection for the loss."""
    return kit.moe_inputs(42, (B, T, EMB), {1: 5, 3: 2})


def loss_and_grads(layer, x, mask, head, deterministic: bool = False):
    """``(loss, y, metrics, param grads)`` of ``sum(y * head) + balance_loss`` (tests/kit.py)."""
    return kit.loss_and_grads(layer, x, mask, head, deterministic=deterministic)[:4]


def dense_reference(params, x, mask):
    """Deterministic layer output computed densely: every expert on every token, then select the
    argmax expert. Written independently of the dispatch code."""
    p = params
    logits = x @ p["router"]["kernel"][...] + p["router"]["bias"][...]
    probs = routers.router_probs(logits, 0.1)
    top = jnp.argmax(probs, -1)
    gate = jnp.take_along_axis(probs, top[..., None], -1)
    h = jax.nn.relu(jnp.einsum("bte,nem->btnm", x, p["wi"][...]) + p["bi"][...])
    f = jnp.einsum("btnm,nme->btne", h, p["wo"][...]) + p["bo"][...]
    f = jnp.take_along_axis(f, top[..., None, None], axis=2)[:, :, 0]
    y = gate * f * p["omega"][...]
    return jnp.where(mask[..., None], y, 0.0)


@jax.jit
def _reference_value_and_grad(params, x, mask, head):
    """Dense reference output and the gradient of the test loss (deterministic routing)."""

    def ref_loss(params):
        y = dense_reference(params, x, mask)
        logits = x @ params["router"]["kernel"][...] + params["router"]["bias"][...]
        routed = routers.get_router("sparsemixer", 0.1)(logits, None, False)
        return jnp.sum(y * head) + routers.routing_metrics(logits, routed, mask)["balance_loss"]

    return dense_reference(params, x, mask), jax.grad(ref_loss)(params)


@pytest.fixture(scope="module")
def train_run(data):
    """Training-mode results (sampling + dropout), padded dispatch. Ragged dispatch in training
    mode is compared with it through the sharded layer in tests/test_sharding.py."""
    x, mask, head = data
    return loss_and_grads(make_layer(dispatch="padded"), x, mask, head)


def test_training_gradients_reach_router_omega_and_used_experts(train_run):
    _, _, metrics, grads = train_run
    # The router gets a gradient (through SparseMixer's custom gate VJP and the balance loss),
    # and so do omega and exactly the experts that received a token.
    assert float(jnp.abs(grads["router"]["kernel"][...]).sum()) > 0
    assert float(jnp.abs(grads["omega"][...]).sum()) > 0
    used = np.asarray(metrics["expert_fraction"]) > 0
    wi_norm = np.asarray(jnp.abs(grads["wi"][...]).sum(axis=(1, 2)))
    np.testing.assert_array_equal(wi_norm > 0, used)


def test_padding_outputs_zero_and_is_left_out_of_metrics(train_run, data):
    mask = data[1]
    _, y, metrics, _ = train_run
    np.testing.assert_array_equal(np.asarray(y)[~np.asarray(mask)], 0.0)
    assert np.all(np.abs(np.asarray(y)[np.asarray(mask)]).sum(-1) > 0)
    frac = np.asarray(metrics["expert_fraction"])
    # Fractions of the unmasked tokens: multiples of 1 / (number of real tokens), summing to 1.
    n_real = int(np.asarray(mask).sum())
    np.testing.assert_allclose(frac.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(frac * n_real, np.round(frac * n_real), atol=1e-4)
    assert float(metrics["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("dispatch", ["ragged", "padded"])
def test_matches_dense_reference_deterministic(data, dispatch):
    x, mask, head = data
    layer = make_layer(dispatch=dispatch)
    params = nnx.state(layer, nnx.Param)
    _, y, metrics, grads = loss_and_grads(layer, x, mask, head, deterministic=True)
    assert float(metrics["dropped_fraction"]) == 0.0

    y_ref, ref_grads = _reference_value_and_grad(params, x, mask, head)
    chex.assert_trees_all_close(y, y_ref, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)


_jit_ffn = jax.jit(expert_ffn, static_argnames=("dispatch",))


def test_expert_ffn_skewed_groups():
    """Extreme group sizes (one expert takes everything, empty experts, rows without expert):
    both dispatches equal a per-row loop."""
    rows, g = 37, 3  # not a multiple of any block size
    k = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(k[0], (rows, EMB))
    params = (
        jax.random.normal(k[1], (g, EMB, MLP)) / 4,
        jax.random.normal(k[2], (g, MLP)),
        jax.random.normal(k[3], (g, MLP, EMB)) / 6,
        jnp.arange(g * EMB, dtype=jnp.float32).reshape(g, EMB) / 50,
    )
    ids = jnp.arange(rows, dtype=jnp.int32)
    wi, bi, wo, bo = (np.asarray(p) for p in params)
    cases = [
        np.full(rows, 1),  # all to one expert
        np.where(np.arange(rows) % 5 == 0, g, 2),  # some rows without expert, expert 0/1 empty
        np.arange(rows) % (g + 1),  # round robin incl. "none"
    ]
    for groups in cases:
        want = np.zeros((rows, EMB), np.float32)
        for r, gr in enumerate(groups):
            if gr < g:
                h = np.maximum(np.asarray(x[r]) @ wi[gr] + bi[gr], 0)
                want[r] = h @ wo[gr] + bo[gr]
        for dispatch in ("ragged", "padded"):
            got = _jit_ffn(x, jnp.asarray(groups), ids, params, dispatch=dispatch)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=dispatch)


@pytest.mark.parametrize("dispatch", ["ragged", "padded"])
def test_capacity_mode(data, dispatch):
    x, mask, _ = data
    dropless, _ = make_layer(dispatch=dispatch)(x, mask, deterministic=True)
    # Capacity large enough for any routing: identical to dropless.
    big, big_met = make_layer(dispatch=dispatch, capacity_factor=float(N))(
        x, mask, deterministic=True)
    np.testing.assert_allclose(big, dropless, rtol=1e-6, atol=1e-7)
    assert float(big_met["dropped_fraction"]) == 0.0

    # Small capacity: the first `cap` real tokens of each expert (flattened order) survive.
    factor = 0.5
    small, met = make_layer(dispatch=dispatch, capacity_factor=factor)(x, mask, deterministic=True)
    cap = int(np.ceil(factor * B * T / N))
    layer = make_layer()
    expert = np.asarray(jnp.argmax(layer.router(x), -1)).reshape(-1)
    m = np.asarray(mask).reshape(-1)
    seen = np.zeros(N, int)
    kept = np.zeros(B * T, bool)
    for i, e in enumerate(expert):
        if m[i]:
            kept[i] = seen[e] < cap
            seen[e] += 1
    assert (~kept & m).sum() > 0, "test needs some dropped tokens"
    small, dropless = np.asarray(small).reshape(-1, EMB), np.asarray(dropless).reshape(-1, EMB)
    np.testing.assert_array_equal(small[~kept], 0.0)
    np.testing.assert_allclose(small[kept], dropless[kept], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(met["dropped_fraction"], (~kept & m).sum() / m.sum(), rtol=1e-6)


def test_padded_capacity_layout_drops_overflow():
    """``expert_ffn(capacity=c)`` keeps the first ``c`` rows of each group, zeros the rest."""
    rows, g, cap = 10, 2, 3
    x = jax.random.normal(jax.random.key(5), (rows, EMB))
    shapes = [(g, EMB, MLP), (g, MLP), (g, MLP, EMB), (g, EMB)]
    keys = jax.random.split(jax.random.key(6), 4)
    params = tuple(jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True))
    groups = jnp.array([0, 0, 1, 0, 0, 2, 0, 1, 1, 1])  # group 0: 5 rows, group 1: 4, one "none"
    ids = jnp.arange(rows, dtype=jnp.int32)
    full = _jit_ffn(x, groups, ids, params, dispatch="padded")
    capped = expert_ffn(x, groups, ids, params, dispatch="padded", capacity=cap)
    kept = np.array([1, 1, 1, 1, 0, 0, 0, 1, 1, 0], bool)
    np.testing.assert_allclose(np.asarray(capped)[kept], np.asarray(full)[kept], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(capped)[~kept], 0.0)


def test_capacity_helpers():
    assert expert_capacity(1.0, 10, 4) == 3
    assert expert_capacity(0.01, 10, 4) == 1
    expert = jnp.array([0, 0, 1, 0, 0])
    active = jnp.array([True, False, True, True, True])
    np.testing.assert_array_equal(capacity_keep(expert, active, 2, 2),
                                  [True, False, True, True, False])


def test_bfloat16_compute(data):
    x, mask, _ = data
    # Both layers see the same bf16-rounded input, so the float32 router makes the same choices
    # (rounding x alone can flip a near-tie between two experts); only the experts' compute
    # dtype differs.
    x = x.astype(jnp.bfloat16)
    y32, _ = make_layer(activation_dropout=0.0)(x.astype(jnp.float32), mask, deterministic=True)
    layer = make_layer(dtype=jnp.bfloat16, activation_dropout=0.0)
    y16, met = layer(x, mask, deterministic=True)
    assert y16.dtype == jnp.bfloat16
    assert layer.wi[...].dtype == jnp.float32 and met["balance_loss"].dtype == jnp.float32
    # bf16 has an 8-bit mantissa: relative error of a few 1e-3 per op.
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, rtol=5e-2, atol=5e-2)


def test_params_and_omega():
    sm = make_layer()
    assert sm.wi[...].shape == (N, EMB, MLP) and sm.bi[...].shape == (N, MLP)
    assert sm.wo[...].shape == (N, MLP, EMB) and sm.bo[...].shape == (N, EMB)
    np.testing.assert_array_equal(sm.omega[...], np.ones(EMB))
    assert sm.router.kernel[...].shape == (EMB, N) and sm.router.bias is not None
    assert make_layer(router="switch").omega is None


def test_randomness_from_module_streams(data):
    x, mask, _ = data
    layer = make_layer(router="switch")
    y1, _ = layer(x, mask)
    y2, _ = layer(x, mask)  # the streams advanced: new dropout masks
    assert not np.allclose(y1, y2)
    # Same seeds, same draws; only the `router` stream seeds the routing.
    y1b, _ = make_layer(router="switch")(x, mask)
    np.testing.assert_array_equal(y1, y1b)
    yd1, _ = layer(x, mask, deterministic=True)
    yd2, _ = layer(x, mask, deterministic=True)
    np.testing.assert_array_equal(yd1, yd2)


def test_auto_dispatch_and_errors():
    assert resolve_dispatch("auto", "cpu") == "padded"
    assert resolve_dispatch("auto", "gpu") == "padded"  # see test_triton_ragged_dot.py
    with pytest.raises(ValueError, match="unknown dispatch 'fast'"):
        make_layer(dispatch="fast")
    with pytest.raises(ValueError, match="unknown router 'top2'"):
        make_layer(router="top2")
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        kit.moe_layer(EMB, MLP, 0)
    with pytest.raises(ValueError, match="capacity_factor"):
        make_layer(capacity_factor=-1.0)
    with pytest.raises(ValueError, match=r"x must be \[B, T, 16\]"):
        make_layer()(jnp.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match="RNG stream 'router'"):
        make_layer(rngs=nnx.Rngs(params=0))


def test_the_constructor_takes_the_sections_and_checks_them():
    """``MoEFeedForward(dims, moe, router)``: the sections kept as given, checked with what
    joins them (the router's ``top_k`` against the experts), one line for each bad argument."""
    moe = MoEConfig(num_experts=N, activation_dropout=0.2, init="fairseq")
    router = routers.RouterConfig(name="switch", top_k=2, jitter_eps=0.0)
    layer = MoEFeedForward((EMB, MLP), moe, router, rngs=nnx.Rngs(0))
    assert (layer.moe, layer.router_config) == (moe, router)
    assert layer.wi.shape == (N, EMB, MLP)
    with pytest.raises(TypeError, match="takes a MoEConfig and a RouterConfig, got dict"):
        MoEFeedForward((EMB, MLP), {"num_experts": N}, router, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"dims must be \(emb_dim, mlp_dim\)"):
        MoEFeedForward((EMB,), moe, router, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward((EMB, MLP), moe, dataclasses.replace(router, top_k=N + 1),
                       rngs=nnx.Rngs(0))


def test_the_normal_scheme_draws_normal_weights_and_zero_biases():
    """``init="normal"`` (the language model's types): the router's kernel and the gated
    experts' weights have the spread ``init_std`` gives, every bias is zero, and the selection
    bias is the layer's own state from construction."""
    moe = MoEConfig(num_experts=N, activation="silu", activation_dropout=0.0, init="normal",
                    gated=True, expert_biases=True, selection_bias=True, init_std=0.5)
    layer = MoEFeedForward((64, 128), moe, routers.RouterConfig(name="switch", jitter_eps=0.0),
                           rngs=nnx.Rngs(0))
    for param in (layer.router.kernel, layer.w_gate, layer.w_up, layer.w_down):
        # 8 * 64 * 128 draws or more: the sample std is within 2% of 0.5 (the router's
        # 64 * 8 draws: 10%).
        assert abs(float(jnp.std(param[...])) - 0.5) < (0.05 if param.shape[-1] == N else 0.01)
    for param in (layer.router.bias, layer.b_gate, layer.b_up, layer.b_down, layer.expert_bias):
        assert not np.any(np.asarray(param[...]))


# ---------------------------------------------------------------- top-k (k rows per token)

K = 2


def dense_topk_reference(params, x, mask, k, kept=None):
    """Deterministic top-k layer output computed densely: every expert on every token, then the
    k best logits in order, each weighted by its probability among the experts not yet chosen.
    ``kept`` (bool ``[B, T, k]``) zeroes dropped rows. Written independently of the dispatch."""
    p = params
    logits = x @ p["router"]["kernel"][...] + p["router"]["bias"][...]
    order = jax.lax.top_k(logits, k)[1]  # [B, T, k]
    h = jax.nn.relu(jnp.einsum("bte,nem->btnm", x, p["wi"][...]) + p["bi"][...])
    f = jnp.einsum("btnm,nme->btne", h, p["wo"][...]) + p["bo"][...]
    y = jnp.zeros_like(x)
    removed = jnp.zeros(logits.shape, bool)
    for t in range(k):
        probs = routers.router_probs(jnp.where(removed, -jnp.inf, logits), 0.1)
        expert = order[..., t]
        gate = jnp.take_along_axis(probs, expert[..., None], -1)
        if kept is not None:
            gate = jnp.where(kept[..., t, None], gate, 0.0)
        y = y + gate * jnp.take_along_axis(f, expert[..., None, None], axis=2)[:, :, 0]
        removed = removed | jax.nn.one_hot(expert, logits.shape[-1], dtype=bool)
    return jnp.where(mask[..., None], y * p["omega"][...], 0.0)


@jax.jit
def _topk_reference_value_and_grad(params, x, mask, head):
    def ref_loss(params):
        y = dense_topk_reference(params, x, mask, K)
        logits = x @ params["router"]["kernel"][...] + params["router"]["bias"][...]
        routed = routers.get_router("sparsemixer", 0.1, K)(logits, None, False)
        return jnp.sum(y * head) + routers.routing_metrics(logits, routed, mask)["balance_loss"]

    return dense_topk_reference(params, x, mask, K), jax.grad(ref_loss)(params)


@pytest.mark.parametrize("dispatch", ["ragged", "padded"])
def test_top2_matches_dense_reference_deterministic(data, dispatch):
    x, mask, head = data
    layer = make_layer(dispatch=dispatch, top_k=K)
    params = nnx.state(layer, nnx.Param)
    _, y, metrics, grads = loss_and_grads(layer, x, mask, head, deterministic=True)
    y_ref, ref_grads = _topk_reference_value_and_grad(params, x, mask, head)
    chex.assert_trees_all_close(y, y_ref, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    # Two distinct experts per real token: each expert's share is a multiple of 1 / (2 * real).
    frac = np.asarray(metrics["expert_fraction"])
    rows = 2 * int(np.asarray(mask).sum())
    np.testing.assert_allclose(frac.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(frac * rows, np.round(frac * rows), atol=1e-4)


def test_top2_training_dispatches_agree(data):
    """Training mode (sampled experts, v2star estimator, per-row dropout): ragged == padded in
    outputs, metrics and gradients, and every expert that got a row gets a gradient."""
    x, mask, head = data
    runs = [loss_and_grads(make_layer(dispatch=d, top_k=K, router="sparsemixer_v2star"),
                           x, mask, head) for d in ("ragged", "padded")]
    (_, y0, m0, g0), (_, y1, m1, g1) = runs
    chex.assert_trees_all_close((y0, m0), (y1, m1), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(g0), nnx.to_pure_dict(g1), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(g0["router"]["kernel"][...]).sum()) > 0
    used = np.asarray(m0["expert_fraction"]) > 0
    np.testing.assert_array_equal(np.asarray(jnp.abs(g0["wi"][...]).sum(axis=(1, 2))) > 0, used)
    np.testing.assert_array_equal(np.asarray(y0)[~np.asarray(mask)], 0.0)


@pytest.mark.parametrize("dispatch", ["ragged", "padded"])
def test_top2_capacity_mode(data, dispatch):
    x, mask, _ = data
    layer = make_layer(dispatch=dispatch, top_k=K, capacity_factor=0.5)
    small, met = layer(x, mask, deterministic=True)
    big, big_met = make_layer(dispatch=dispatch, top_k=K, capacity_factor=float(N))(
        x, mask, deterministic=True)
    params = nnx.state(layer, nnx.Param)
    np.testing.assert_allclose(big, dense_topk_reference(params, x, mask, K), rtol=1e-5,
                               atol=1e-6)
    assert float(big_met["dropped_fraction"]) == 0.0
    # By hand: rows served first choices first, in token order; cap rows per expert.
    cap = int(np.ceil(0.5 * B * T * K / N))
    order = np.asarray(jax.lax.top_k(layer.router(x), K)[1]).reshape(-1, K)
    m = np.asarray(mask).reshape(-1)
    seen, kept = np.zeros(N, int), np.zeros((B * T, K), bool)
    for t in range(K):
        for i in range(B * T):
            if m[i]:
                kept[i, t] = seen[order[i, t]] < cap
                seen[order[i, t]] += 1
    assert (~kept & m[:, None]).sum() > 0, "test needs dropped rows"
    want = dense_topk_reference(params, x, mask, K, kept=jnp.asarray(kept.reshape(B, T, K)))
    np.testing.assert_allclose(small, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(met["dropped_fraction"],
                               (~kept & m[:, None]).sum() / (K * m.sum()), rtol=1e-6)


def test_top_k_errors():
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, num_experts=4\], got 5"):
        make_layer(top_k=5)
    with pytest.raises(ValueError, match=r"got 0"):
        make_layer(top_k=0)


def test_gelu_experts_match_a_per_row_reference_with_gradients():
    """``activation="gelu"``: every dispatch equals a per-row loop ``gelu(x wi + bi) wo + bo``
    (exact erf GELU), in value and in the gradient of every parameter and of ``x``; ReLU gives
    another value (so the switch is not ignored)."""
    rows, g = 29, 3
    k = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(k[0], (rows, EMB))
    params = (jax.random.normal(k[1], (g, EMB, MLP)) / 4, jax.random.normal(k[2], (g, MLP)),
              jax.random.normal(k[3], (g, MLP, EMB)) / 6, jax.random.normal(k[4], (g, EMB)))
    groups = jnp.asarray(np.arange(rows) % (g + 1))  # every expert, and rows without one
    ids = jnp.arange(rows, dtype=jnp.int32)
    head = jax.random.normal(jax.random.key(6), (rows, EMB))

    def reference(x, params):
        wi, bi, wo, bo = params
        safe = jnp.minimum(groups, g - 1)
        h = jnp.einsum("re,rem->rm", x, wi[safe]) + bi[safe]
        erf_gelu = 0.5 * h * (1.0 + jax.scipy.special.erf(h / jnp.sqrt(2.0)))
        y = jnp.einsum("rm,rme->re", erf_gelu, wo[safe]) + bo[safe]
        return jnp.where((groups < g)[:, None], y, 0.0)

    def loss(fn):
        return lambda x, params: jnp.sum(fn(x, params) * head)

    want, want_grads = jax.value_and_grad(loss(reference), argnums=(0, 1))(x, params)
    for dispatch in ("ragged", "padded"):
        def ffn(x, params, dispatch=dispatch, activation="gelu"):
            return expert_ffn(x, groups, ids, params, dispatch=dispatch, activation=activation)

        got, grads = jax.jit(jax.value_and_grad(loss(ffn), argnums=(0, 1)))(x, params)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=dispatch)
        chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-5)
        relu = loss(lambda x, p, d=dispatch: ffn(x, p, d, "relu"))(x, params)
        assert abs(float(relu) - float(want)) > 1e-2, dispatch
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        make_layer(activation="swish")


@pytest.mark.parametrize("k, with_omega", [(2, True), (1, True), (2, False)])
def test_gated_sum_matches_the_plain_expression_and_its_gradients(k, with_omega):
    # gated_sum saves its inputs for the backward (and under omega writes the backward by
    # hand); its value and gradients are those of the expression it replaces.
    from sparsemixer_jax.moe.combine import gated_sum

    keys = jax.random.split(jax.random.key(3), 4)
    shape = (2, 5, k, EMB) if k > 1 else (2, 5, EMB)
    f = jax.random.normal(keys[0], shape, jnp.bfloat16)
    gate = jax.random.uniform(keys[1], shape[:-1])
    omega = 1.0 + 0.5 * jax.random.normal(keys[2], (EMB,)) if with_omega else None
    weights = jax.random.normal(keys[3], (2, 5, EMB))

    def plain(f, gate, omega):
        scale = gate[..., None] if omega is None else gate[..., None] * omega
        y = f.astype(jnp.float32) * scale
        return jnp.sum(y, axis=2) if k > 1 else y

    def loss(fn):
        return lambda *args: jnp.sum(fn(*args) * weights)

    argnums = (0, 1, 2) if with_omega else (0, 1)
    np.testing.assert_array_equal(gated_sum(f, gate, omega), plain(f, gate, omega))
    got = jax.grad(loss(gated_sum), argnums)(f, gate, omega)
    want = jax.grad(loss(plain), argnums)(f, gate, omega)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        # The same products; only the order of the float32 sums over emb (the gates) and over
        # the tokens (omega) may differ, a few ulps of sums of at most 20 terms of size ~1.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-5, atol=1e-5)
