"""The ``"grouped"`` dispatch inside the MoE layer and a whole model: equal to ``padded``.

The grouped matmul kernels themselves are tested in tests/test_grouped_ffn.py; here the layer's
wiring: top-1 and top-2, capacity mode, dropout, the Mosaic kernels under the GPU interpreter,
the refusal on a device that is not a Hopper GPU, and a whole Transformer's loss and gradients.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

from sparsemixer_jax import training
from sparsemixer_jax.moe import GROUPED_IMPLS, expert_ffn, resolve_dispatch
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.training import steps as training_steps
from tests import kit, tiny_wmt_config

# Widths the Mosaic kernels accept on an H100 (the weight-gradient kernel's tiles are >= 64), so
# the interpreted layer runs the kernels weight_grad="auto" picks on a GPU.
EMB, MLP, N, B, T = 64, 128, 4, 4, 8


def layer(dispatch, **kw):
    return kit.moe_layer(EMB, MLP, N, dispatch=dispatch, activation_dropout=0.2, **kw)


def loss_and_grads(module, x, mask, head):
    """``(loss, y, param grads)`` in training mode (tests/kit.py)."""
    loss, y, _, grads, _ = kit.loss_and_grads(module, x, mask, head)
    return loss, y, grads


@pytest.fixture(scope="module")
def data():
    return kit.moe_inputs(4, (B, T, EMB), {1: 5})


def assert_same(got, want, rtol, atol):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                                                         rtol=rtol, atol=atol), got, want)


@pytest.mark.parametrize("top_k,capacity_factor,activation",
                         [(1, 0.0, "relu"), (2, 0.0, "relu"), (2, 1.0, "relu"), (1, 0.0, "gelu")])
def test_xla_grouped_layer_equals_padded(data, top_k, capacity_factor, activation):
    """Float32, the XLA impl: the same rows, dropout masks and drops as ``padded``, so outputs
    and every parameter gradient agree to float32 rounding (1e-5)."""
    kw = dict(top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    want = loss_and_grads(layer("padded", **kw), *data)
    got = loss_and_grads(layer("grouped", grouped_impl="xla", **kw), *data)
    assert_same(got, want, rtol=1e-5, atol=1e-6)


def test_mosaic_grouped_layer_in_the_gpu_interpreter_equals_padded(data):
    """The three Mosaic kernels (forward, input gradient, weight gradient) compute in bfloat16:
    compared with ``padded`` in bfloat16 within bfloat16 rounding (2e-2 of the values, several
    roundings deep)."""
    kw = dict(top_k=2, dtype=jnp.bfloat16)
    want = loss_and_grads(layer("padded", **kw), *data)
    with interpret_params.force_gpu_interpret_mode():
        got = loss_and_grads(layer("grouped", **kw), *data)
    _, y_want, g_want = want
    _, y_got, g_got = got
    scale = float(jnp.max(jnp.abs(y_want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(y_got, np.float32), np.asarray(y_want, np.float32),
                               atol=2e-2 * scale)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want),
                            strict=True):
        bound = 2e-2 * max(float(jnp.max(jnp.abs(w))), 1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=bound, err_msg=jax.tree_util.keystr(path))


def test_mosaic_grouped_is_refused_off_hopper_and_never_picked_by_auto():
    with pytest.raises(ValueError, match=r"sm90 \(Hopper\) NVIDIA GPU, got platform 'cpu'"):
        layer("grouped")
    layer("grouped", grouped_impl="xla")  # the XLA impl runs anywhere
    with pytest.raises(ValueError, match="grouped_impl"):
        layer("grouped", grouped_impl="triton")
    assert "tokamax" in GROUPED_IMPLS
    for backend in ("cpu", "gpu", "cuda", "tpu"):
        assert resolve_dispatch("auto", backend) != "grouped"


def test_grouped_in_float32_says_it_computes_in_bfloat16():
    # Traced only (eval_shape): the warning comes from building the computation.
    x = jnp.ones((64, EMB), jnp.float32)
    params = (jnp.ones((N, EMB, MLP)), jnp.ones((N, MLP)), jnp.ones((N, MLP, EMB)),
              jnp.ones((N, EMB)))
    group = jnp.arange(64) % N

    def run(impl, x):
        return jax.eval_shape(lambda x: expert_ffn(x, group, jnp.arange(64), params,
                                                   dispatch="grouped", grouped_impl=impl), x)

    warning = r"computes the expert FFN in bfloat16.*model\.compute_dtype"
    with interpret_params.force_gpu_interpret_mode(), pytest.warns(UserWarning, match=warning):
        assert run("mosaic", x).dtype == jnp.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run("xla", x)  # float32 throughout: nothing to say
        with interpret_params.force_gpu_interpret_mode():
            run("mosaic", x.astype(jnp.bfloat16))


@pytest.mark.slow  # fast counterparts: the grouped layer against padded (XLA and Mosaic)
def test_whole_model_loss_and_gradients_equal_padded():
    """A tiny Transformer trained one step with each dispatch (float32, XLA impl): the same
    loss and parameter gradients to float32 rounding."""
    config = tiny_wmt_config.get_config()
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(3, 40, (8, 12), dtype=np.int32))
             for k in ("inputs", "targets")}
    grads = {}
    for dispatch in ("padded", "grouped"):
        config.model.dispatch = dispatch
        config.model.grouped_impl = "xla"
        steps = training.build_steps(run_config(config), 40)
        loss_grad = jax.grad(training_steps.micro_batch_loss, argnums=2, has_aux=True)
        grads[dispatch] = jax.jit(loss_grad, static_argnums=(0, 1))(
            steps.graphdef, steps.task, steps.params, steps.layer_state, steps.rest, batch,
            jax.random.key(1))[0]
    assert_same(grads["grouped"], grads["padded"], rtol=1e-4, atol=1e-6)


def test_zero_unkept_is_where_bit_for_bit():
    """Non-finite values on kept rows survive and unkept rows are +0, as ``jnp.where``."""
    from sparsemixer_jax.kernels.mosaic_grouped_matmul import zero_unkept

    x = jnp.array([[1.5, -0.0], [jnp.inf, jnp.nan], [jnp.nan, -2.0]], jnp.bfloat16)
    keep = jnp.array([[True], [True], [False]])
    got = zero_unkept(keep, x, jnp.array([3, 1], jnp.int32))
    want = jnp.where(keep, x, 0)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_moved_rows_keep_no_zero_array_in_a_differentiated_scan():
    """Inside a differentiated, rematerialised ``lax.scan`` (a model's layer stack) the grouped
    dispatch's row masks must not leave a zero-filled array of the moved rows' shape outside
    the loop, which every masked kernel would read: JAX hoists a literal zero's broadcast out
    of the loop as loop-invariant (``zero_unkept``). Two rows per token, as top-2 routes, so
    the moved rows ``[2 * tokens, emb]`` have a shape of their own in the program."""
    tokens, emb, mlp, n = 16, 8, 16, 2
    ws = (jax.random.normal(jax.random.key(0), (3, n, emb, mlp)),
          jax.random.normal(jax.random.key(1), (3, n, mlp, emb)))

    def layer_body(x, w):
        rows = jnp.repeat(x, 2, axis=0)
        group = (jnp.sum(rows, axis=-1) > 0).astype(jnp.int32)
        y = expert_ffn(rows, group, jnp.arange(2 * tokens), (w[0], None, w[1], None),
                       dispatch="grouped", grouped_impl="xla")
        return x + y.reshape(tokens, 2, emb).sum(axis=1), None

    # remat="elementwise"'s kind of policy: products recomputed, everything else kept.
    body = jax.checkpoint(layer_body, policy=lambda prim, *_, **__: prim.name != "mul",
                          prevent_cse=False)

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    x = jax.random.normal(jax.random.key(2), (tokens, emb))
    text = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    hoisted = [line for line in entry.splitlines()
               if f"[{2 * tokens},{emb}]" in line and "broadcast" in line]
    assert not hoisted, hoisted
