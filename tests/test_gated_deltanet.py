"""Gated DeltaNet (:mod:`sparsemixer_jax.layers.gated_deltanet`) and its delta rule
(:mod:`sparsemixer_jax.layers.delta_rule`): the chunked and recurrent forms equal the scan
oracle, packed documents and padding, gradients, prefill then decode, both projection layouts,
transformers' layers, and the config's checks.

Tolerances, float32 throughout: the forms sum the same terms in different orders (a triangular
solve and block matmuls against rank-one updates), each rounding at float32's 6e-8 relative;
every transition ``exp(g) (I - beta k k^T)`` has norm at most one for unit keys, so rounding
does not grow along the sequence, and over the tests' few dozen tokens and sums of at most 16
terms the differences stay below 1e-6 of values of order one; 2e-5 leaves a margin of ten and
still fails for any wrong term (a dropped decay or write moves outputs by 1e-2 or more).
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.layers.delta_rule import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    scan_gated_delta_rule,
    segment_resets,
)
from sparsemixer_jax.layers.gated_deltanet import (
    DeltaNetCache,
    GatedDeltaNet,
    GatedDeltaNetConfig,
)

DATA = os.path.join(os.path.dirname(__file__), "data", "deltanet")
TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(key, batch=2, length=13, heads=3, dk=8, dv=5, decay_scale=1.0):
    """Unit keys, scaled unit queries, log decays in about (-4, 0) (strong and weak), beta in
    (0, 1), a random initial state."""
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (batch, length, heads, dk))
    k = jax.random.normal(ks[1], (batch, length, heads, dk))
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (batch, length, heads, dv))
    g = -decay_scale * jax.nn.softplus(2.0 * jax.random.normal(ks[3], (batch, length, heads)))
    beta = jax.nn.sigmoid(2.0 * jax.random.normal(ks[4], (batch, length, heads)))
    state = jax.random.normal(ks[5], (batch, heads, dk, dv))
    return q, k, v, g, beta, state


SEGMENTS = jnp.array([[0] * 5 + [1] * 6 + [2] * 2, [3] * 13])


@pytest.mark.parametrize("length", [1, 5, 13])
def test_chunked_and_recurrent_equal_the_oracle(length):
    """Lengths that end in a partial chunk (chunks of 4), an initial state, and (row 0) three
    packed documents whose boundaries fall inside chunks."""
    q, k, v, g, beta, state = _inputs(jax.random.key(length), length=length)
    reset = segment_resets(SEGMENTS[:, :length])
    want_o, want_s = scan_gated_delta_rule(q, k, v, g, beta, state, reset)
    for chunk in (1, 4, 64):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, state, reset, chunk_size=chunk)
        np.testing.assert_allclose(o, want_o, **TOL, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(s, want_s, **TOL, err_msg=f"chunk {chunk}")
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, state, reset)
    np.testing.assert_allclose(o, want_o, **TOL)
    np.testing.assert_allclose(s, want_s, **TOL)


def test_strong_decays_stay_exact_and_finite():
    """Log decays down to -760 a token (a head that forgets at once; a chunk's cumulative
    decay then reaches -1e4 and its exp underflows to 0): the chunked form still equals the
    oracle, and its gradients are finite (no inf - inf or 0 * inf from the masked decays)."""
    q, k, v, g, beta, state = _inputs(jax.random.key(11), length=40, decay_scale=100.0)
    assert g.min() < -500
    want_o, want_s = scan_gated_delta_rule(q, k, v, g, beta, state)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    np.testing.assert_allclose(o, want_o, **TOL)
    np.testing.assert_allclose(s, want_s, **TOL)
    grads = jax.grad(lambda *a: jnp.sum(chunk_gated_delta_rule(*a, chunk_size=16)[0] ** 2),
                     argnums=tuple(range(6)))(q, k, v, g, beta, state)
    chex.assert_tree_all_finite(grads)


def test_a_document_boundary_resets_the_state():
    """Row 0's documents run alone (each from a zero state, the first from the initial state)
    give what the packed row gives; the oracle's own reset is checked this way too."""
    q, k, v, g, beta, state = _inputs(jax.random.key(7))
    reset = segment_resets(SEGMENTS)
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, state, reset, chunk_size=4)
    oracle, _ = scan_gated_delta_rule(q, k, v, g, beta, state, reset)
    for start, stop in ((0, 5), (5, 11), (11, 13)):
        alone, _ = scan_gated_delta_rule(
            *(a[:1, start:stop] for a in (q, k, v, g, beta)),
            state[:1] if start == 0 else None)
        np.testing.assert_allclose(packed[:1, start:stop], alone, **TOL)
        np.testing.assert_allclose(oracle[:1, start:stop], alone, **TOL)
    # Without the reset the later documents read the earlier ones: the test can fail.
    joined, _ = scan_gated_delta_rule(q, k, v, g, beta, state)
    assert np.abs(np.asarray(joined[0, 5:] - oracle[0, 5:])).max() > 1e-3


def test_gradients_of_the_chunked_form_equal_the_oracles():
    q, k, v, g, beta, state = _inputs(jax.random.key(3), length=11)
    reset = segment_resets(SEGMENTS[:, :11])
    weights = jax.random.normal(jax.random.key(4), (2, 11, 3, 5))
    weights_s = jax.random.normal(jax.random.key(5), state.shape)

    def loss(rule, *args):
        o, s = rule(*args, reset=reset)
        return jnp.sum(o * weights) + jnp.sum(s * weights_s)

    def chunked(*args, reset):
        return chunk_gated_delta_rule(*args, reset=reset, chunk_size=4)

    argnums = tuple(range(6))
    want = jax.grad(lambda *a: loss(scan_gated_delta_rule, *a), argnums)(q, k, v, g, beta, state)
    got = jax.grad(lambda *a: loss(chunked, *a), argnums)(q, k, v, g, beta, state)
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)  # sums of 11 tokens' terms
    chex.assert_tree_all_finite(got)


def test_causal_conv1d_with_state_and_documents():
    """Against the definition written out, with a state from an earlier call and a document
    boundary; the new state keeps only the last document's inputs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 6, 3)).astype(np.float32)
    weight = rng.normal(size=(3, 4)).astype(np.float32)
    state = rng.normal(size=(1, 3, 3)).astype(np.float32)
    reset = jnp.array([[False, False, False, False, True, False]])
    y, new_state = causal_conv1d(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(state), reset)
    history = np.concatenate([state, x], axis=1)
    want = np.zeros_like(x)
    for t in range(6):
        first = 3 + 4 if t >= 4 else 0          # the second document starts at input t = 4
        for j in range(4):
            if 3 + t - 3 + j >= first:
                want[0, t] += weight[:, j] * history[0, t + j]
    np.testing.assert_allclose(y, want, atol=1e-6)
    np.testing.assert_allclose(new_state, np.concatenate([np.zeros((1, 1, 3)), x[:, 4:]], 1))


# ----------------------------------------------------------------------------------- the layer


def _config(**overrides):
    base = dict(hidden_size=16, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                value_head_dim=6, conv_kernel_size=4, chunk_size=4)
    return GatedDeltaNetConfig(**{**base, **overrides})


def _layer(**overrides):
    layer = GatedDeltaNet(_config(**overrides), nnx.Rngs(0))
    # Weights large enough that every token moves the output (the default init's 0.02 would
    # leave the delta rule's terms near zero and the comparisons vacuous).
    key = jax.random.key(1)
    for path, param in nnx.iter_graph(layer):
        if isinstance(param, nnx.Param) and path[-1] not in ("A_log", "dt_bias"):
            key, sub = jax.random.split(key)
            param[...] = param[...] + 0.4 * jax.random.normal(sub, param[...].shape)
    return layer


def _x(length=13, batch=2, seed=2):
    return jax.random.normal(jax.random.key(seed), (batch, length, 16))


@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_layer_forms_agree_and_packed_documents_run_alone(layout):
    layer = _layer(layout=layout)
    recurrent = _layer(layout=layout, form="recurrent")
    x = _x()
    y, cache = layer(x, segment_ids=SEGMENTS)
    y_r, cache_r = recurrent(x, segment_ids=SEGMENTS)
    np.testing.assert_allclose(y, y_r, **TOL)
    chex.assert_trees_all_close(cache, cache_r, **TOL)
    for start, stop in ((0, 5), (5, 11), (11, 13)):
        alone, _ = layer(x[:1, start:stop])
        np.testing.assert_allclose(y[:1, start:stop], alone, **TOL)


def test_padding_changes_no_real_token():
    """Left and right padding (garbage at the padded positions) leave the real tokens' outputs
    and the final cache of a left-padded row as the unpadded run's."""
    layer = _layer()
    x = _x(length=9, batch=1)
    want, want_cache = layer(x)
    garbage = 5.0 * _x(length=3, batch=1, seed=9)
    left = jnp.concatenate([garbage, x], axis=1)
    mask = jnp.arange(12)[None] >= 3
    y, cache = layer(left, token_mask=mask)
    np.testing.assert_allclose(y[:, 3:], want, **TOL)
    chex.assert_trees_all_close(cache, want_cache, **TOL)
    right = jnp.concatenate([x, garbage], axis=1)
    y, _ = layer(right, token_mask=jnp.arange(12)[None] < 9)
    np.testing.assert_allclose(y[:, :9], want, **TOL)


def test_layer_gradients_chunked_equal_recurrent():
    layer, recurrent = _layer(), _layer(form="recurrent")
    x = _x(length=10)

    def loss(model):
        y, _ = model(x, segment_ids=SEGMENTS[:, :10])
        return jnp.sum(y * jnp.cos(jnp.arange(16.0)))

    want = nnx.grad(loss)(recurrent)
    got = nnx.grad(loss)(layer)
    chex.assert_trees_all_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want),
                                atol=1e-4, rtol=1e-4)


def test_prefill_then_decode_equals_one_forward():
    """Prefill 7 tokens whose last document is 2 tokens long (shorter than the 3 convolution
    inputs the cache keeps, so the cache must drop the earlier document's), then 6 tokens one
    at a time, then 3 more as a second prefill: the outputs of one forward over all."""
    layer = _layer()
    x = _x(length=16)
    segments = jnp.array([[0] * 5 + [1] * 11, [0] * 16])
    want, want_cache = layer(x, segment_ids=segments)
    y, cache = layer(x[:, :7], segment_ids=segments[:, :7])
    outs = [y]
    for t in range(7, 13):
        y, cache = layer(x[:, t:t + 1], cache=cache)
        outs.append(y)
    y, cache = layer(x[:, 13:], cache=cache)
    outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, **TOL)
    chex.assert_trees_all_close(cache, want_cache, **TOL)
    empty = DeltaNetCache.empty(layer.config, 2)
    assert empty.conv.shape == (2, 3, 2 * 16 + 24) and empty.state.shape == (2, 4, 8, 6)


def test_the_two_layouts_compute_the_same():
    """The separate layer's weights regrouped per key head into the fused projections give
    the same outputs."""
    separate = _layer(layout="separate")
    fused = _layer(layout="fused")
    c = separate.config
    kernel = lambda proj: np.asarray(proj.kernel[...])
    q, k, v = np.split(kernel(separate.in_proj_qkv), [c.key_dim, 2 * c.key_dim], axis=1)
    z = kernel(separate.in_proj_z)
    per_head = lambda w, width: w.reshape(16, c.num_key_heads, width)
    group = c.heads_per_key * c.value_head_dim
    qkvz = np.concatenate([per_head(q, 8), per_head(k, 8), per_head(v, group),
                           per_head(z, group)], axis=2).reshape(16, -1)
    ba = np.concatenate([per_head(kernel(separate.in_proj_b), 2),
                         per_head(kernel(separate.in_proj_a), 2)], axis=2).reshape(16, -1)
    fused.in_proj_qkvz.kernel[...] = jnp.asarray(qkvz)
    fused.in_proj_ba.kernel[...] = jnp.asarray(ba)
    for name in ("conv1d", "dt_bias", "A_log"):
        getattr(fused, name)[...] = getattr(separate, name)[...]
    fused.norm.weight[...] = separate.norm.weight[...]
    fused.out_proj.kernel[...] = separate.out_proj.kernel[...]
    x = _x()
    np.testing.assert_allclose(fused(x)[0], separate(x)[0], **TOL)


@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_equals_transformers(layout):
    """transformers' Qwen3-Next (fused) and Qwen3.5-MoE (separate) layers
    (scripts/make_deltanet_references.py), 70 tokens, float32. Outputs reach 3.5; both sides
    sum in float32 in different orders (torch's chunks of 64 against ours of 16, its
    triangular solve against ours) and agree to 6e-6 at chunks of 5, 16 or 64: 3e-5 leaves a
    margin of five."""
    ref = np.load(os.path.join(DATA, f"{layout}.npz"))
    layer = GatedDeltaNet(_config(layout=layout, chunk_size=16), nnx.Rngs(0))
    for name in ref.files:
        if name in ("x", "y"):
            continue
        module, _, leaf = name.rpartition(".")
        value = ref[name]
        if leaf == "weight" and module.startswith(("in_proj", "out_proj")):
            getattr(layer, module).kernel[...] = jnp.asarray(value.T)
        elif name == "conv1d.weight":
            layer.conv1d[...] = jnp.asarray(value[:, 0])
        elif name == "norm.weight":
            layer.norm.weight[...] = jnp.asarray(value)
        else:
            getattr(layer, name)[...] = jnp.asarray(value)
    y, _ = layer(jnp.asarray(ref["x"]))
    np.testing.assert_allclose(y, ref["y"], atol=3e-5, rtol=0)


def test_bfloat16_under_jit():
    """The compute dtype bfloat16 under ``nnx.jit``: output and convolution cache in bfloat16,
    the state in float32, and the outputs those of float32 to 1.4% (relative Frobenius norm,
    measured): bfloat16 rounds at 0.4% relative in each of the projections, the convolution,
    the gated norm and the output projection, and the norm divides by a head's RMS, which
    magnifies the error of a small head; 3% leaves a margin of two."""
    full = _layer()
    half = _layer(compute_dtype="bfloat16")
    x = _x(length=40)
    want, want_cache = full(x)
    y, cache = nnx.jit(lambda layer, x: layer(x))(half, x)
    assert y.dtype == cache.conv.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32
    error = jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want)
    assert error < 0.03, error
    state_error = jnp.linalg.norm(cache.state - want_cache.state) / jnp.linalg.norm(
        want_cache.state)
    assert state_error < 0.03, state_error


def test_bad_layouts_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"^gated_deltanet.num_value_heads=6 is not a multiple "
                                         r"of num_key_heads=4"):
        _config(num_key_heads=4, num_value_heads=6)
    with pytest.raises(ValueError, match=r"^gated_deltanet.layout='grouped'"):
        _config(layout="grouped")
    with pytest.raises(ValueError, match=r"^gated_deltanet.chunk_size=0 must be at least 1"):
        _config(chunk_size=0)


def test_cpu_benchmark_runs_at_tiny_sizes(capsys):
    """lab/benchmarks/gated_deltanet.py's CPU timing, at sizes that take a second."""
    from lab.benchmarks.gated_deltanet import bench_cpu

    results = bench_cpu([6], heads=1, dim=4, chunk=4, rounds=1)
    assert set(results) == {(6, "fwd"), (6, "fwd+bwd")}
    assert all(set(r) == {"chunked", "scan"} and min(r.values()) > 0 for r in results.values())
    assert "T=    6 fwd" in capsys.readouterr().out
