"""Gated (SwiGLU) experts without biases in the MoE layer: every dispatch, capacity, the grouped
kernels (XLA impl here; Mosaic in the GPU interpreter), expert parallelism, DenseMixer's dense
pass and ``fold_omega``, each against a per-row loop written out here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

from sparsemixer_jax.moe import MoEFeedForward, expert_ffn, fold_omega
from sparsemixer_jax.moe.dispatch import clamped_swiglu
from sparsemixer_jax.moe.unchosen import all_expert_outputs
from sparsemixer_jax.parallel.sharding import make_mesh
from tests import kit

EMB, MLP, N, B, T = 64, 128, 4, 4, 8


def reference_rows(x, group, w_gate, w_up, w_down):
    """``silu(x w_gate) * (x w_up) w_down`` row by row (numpy float64); zero for group >= N."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for r, g in enumerate(np.asarray(group)):
        if g < w_gate.shape[0]:
            a = x[r] @ w_gate[g]
            out[r] = (a / (1 + np.exp(-a)) * (x[r] @ w_up[g])) @ w_down[g]
    return out


@pytest.fixture(scope="module")
def rows():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (48, EMB))
    group = jax.random.randint(keys[1], (48,), 0, N + 1)  # N: no expert
    params = tuple(jax.random.normal(k, s) * 0.1 for k, s in
                   zip(keys[2:], [(N, EMB, MLP), (N, EMB, MLP), (N, MLP, EMB)], strict=True))
    return x, group, params


@pytest.mark.parametrize("dispatch,kw", [("ragged", {}), ("padded", {}),
                                         ("padded", {"capacity": 48}),
                                         ("grouped", {"grouped_impl": "xla"})])
def test_gated_expert_ffn_equals_the_loop(rows, dispatch, kw):
    x, group, params = rows
    got = expert_ffn(x, group, jnp.arange(48), params, dispatch=dispatch, activation="silu", **kw)
    np.testing.assert_allclose(np.asarray(got), reference_rows(x, group, *params), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.slow  # fast counterpart: the grouped dispatch's gated layout with the XLA impl
def test_gated_mosaic_kernels_in_the_gpu_interpreter(rows):
    """Mosaic's kernels compute in bfloat16: within bfloat16 rounding of the loop."""
    x, group, params = rows
    with interpret_params.force_gpu_interpret_mode():
        got = expert_ffn(x.astype(jnp.bfloat16), group, jnp.arange(48),
                         tuple(p.astype(jnp.bfloat16) for p in params), dispatch="grouped",
                         activation="silu")
    want = reference_rows(x, group, *params)
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               atol=3e-2 * np.abs(want).max())


def test_gated_dense_pass_of_densemixer(rows):
    x, _, params = rows
    every = all_expert_outputs(x, params, "silu")  # [rows, N, emb]
    for n in range(N):
        np.testing.assert_allclose(np.asarray(every[:, n]),
                                   reference_rows(x, np.full(48, n), *params), rtol=2e-5,
                                   atol=2e-5)


def gated_layer(router="switch", mesh=None, **kw):
    if kw.pop("gated_biases", False):
        kw["expert_biases"] = True
    return MoEFeedForward((EMB, MLP), *kit.moe_sections(
        N, router=router, top_k=2, activation="silu", gated=True, router_bias=False,
        activation_dropout=0.0, jitter_eps=0.0, **kw), mesh=mesh,
        rngs=nnx.Rngs(params=0, router=1))


def test_gated_layer_params_and_output():
    layer = gated_layer(router_options={"normalize_top_k": True})
    assert layer.router.bias is None and not hasattr(layer, "wi")
    assert layer.w_gate.shape == layer.w_up.shape == (N, EMB, MLP)
    assert layer.w_down.shape == (N, MLP, EMB)
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    y, _ = nnx.jit(lambda m, x: m(x, deterministic=True))(layer, x)
    # The layer = softmax top-2, renormalised, over the loop's expert outputs (numpy: no eager
    # JAX ops to compile one by one).
    flat = np.asarray(x, np.float64).reshape(-1, EMB)
    logits = flat @ np.asarray(layer.router.kernel[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expert = np.argsort(-probs, axis=-1)[:, :2]
    gate = np.take_along_axis(probs, expert, axis=-1)
    gate = gate / gate.sum(-1, keepdims=True)
    want = sum(gate[:, t, None] * reference_rows(
        flat, expert[:, t], layer.w_gate[...], layer.w_up[...], layer.w_down[...])
        for t in range(2))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, EMB), want, rtol=1e-4, atol=1e-5)


def test_gated_layer_under_expert_parallelism_equals_one_device():
    """Experts split over a (2 data, 2 expert) mesh: output and gradients equal one device
    (DenseMixer: top-k routing plus the dense pass over every gated expert)."""
    router = "densemixer"
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    head = jax.random.normal(jax.random.key(4), (B, T, EMB))

    def run(layer):
        def loss(layer):
            y, _ = layer(x, deterministic=False)
            return jnp.sum(y * head)
        return nnx.jit(nnx.value_and_grad(loss))(layer)

    want = run(gated_layer(router))
    mesh = make_mesh(2, 2, jax.devices()[:4])
    got = run(gated_layer(router, mesh=mesh))
    # Leaves only: the mesh's params carry sharding metadata that one device's do not.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_fold_omega_on_gated_experts():
    layer = gated_layer("sparsemixer_v2")
    layer.omega[...] = jnp.linspace(0.5, 1.5, EMB)
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    apply = nnx.jit(lambda m, x: m(x, deterministic=True)[0])  # one compilation for both
    before = apply(layer, x)
    assert fold_omega(layer) == 1
    after = apply(layer, x)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=1e-5, atol=1e-6)


def clamped_reference_rows(x, group, params, limit, alpha):
    """gpt-oss's experts row by row (numpy float64): ``g = min(x w_gate + b_gate, limit)``,
    ``u = clip(x w_up + b_up, +-limit)``, ``(g sigmoid(alpha g) (u + 1)) w_down + b_down``."""
    x = np.asarray(x, np.float64)
    w_gate, w_up, w_down, b_gate, b_up, b_down = (np.asarray(p, np.float64) for p in params)
    out = np.zeros_like(x)
    for r, g in enumerate(np.asarray(group)):
        if g < w_gate.shape[0]:
            gate = np.minimum(x[r] @ w_gate[g] + b_gate[g], limit)
            up = np.clip(x[r] @ w_up[g] + b_up[g], -limit, limit)
            out[r] = (gate / (1 + np.exp(-alpha * gate)) * (up + 1)) @ w_down[g] + b_down[g]
    return out


@pytest.mark.parametrize("dispatch,kw", [("ragged", {}), ("padded", {}),
                                         ("grouped", {"grouped_impl": "xla"})])
def test_clamped_swiglu_experts_with_biases_equal_the_loop(rows, dispatch, kw):
    """gpt-oss's experts through each dispatch. The gate and up values of these rows spread
    about 0.8 (64 unit inputs times weights of 0.1), so at limit 0.3 the clamps cut about a third
    of the gates and most up values: a missing clamp would show."""
    x, group, params = rows
    keys = jax.random.split(jax.random.key(5), 3)
    biases = tuple(jax.random.normal(k, s) * 0.1 for k, s in
                   zip(keys, [(N, MLP), (N, MLP), (N, EMB)], strict=True))
    params = (*params, *biases)
    got = expert_ffn(x, group, jnp.arange(48), params, dispatch=dispatch,
                     activation=clamped_swiglu(0.3, 1.702), **kw)
    np.testing.assert_allclose(np.asarray(got), clamped_reference_rows(x, group, params, 0.3,
                                                                       1.702),
                               rtol=2e-5, atol=2e-5)


def test_fold_omega_on_experts_with_biases():
    layer = gated_layer("sparsemixer_v2", gated_biases=True)
    layer.b_down[...] = jnp.ones((N, EMB))
    layer.omega[...] = jnp.linspace(0.5, 1.5, EMB)
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    apply = nnx.jit(lambda m, x: m(x, deterministic=True)[0])
    before = apply(layer, x)
    assert fold_omega(layer) == 1
    np.testing.assert_allclose(np.asarray(apply(layer, x)), np.asarray(before), rtol=1e-5,
                               atol=1e-6)
