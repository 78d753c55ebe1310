"""Parameters cast to the compute dtype once per update (training/compute_copies.py): which ones
the model's own casts select, and that training with the copies is bit for bit training
without them on CPU (on a GPU: within two bfloat16 ulps, see the last test)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import training
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.training import compute_copies
from tests import tiny_lm_config

BF16 = jnp.dtype(jnp.bfloat16)
VOCAB = 120


def _dtypes(fn, *params):
    return compute_copies.copy_dtypes(fn, *params)


def test_only_a_single_narrowing_cast_selects_a_parameter():
    w = jnp.ones((2, 3, 3))  # a stack of two layers' weights
    x = jnp.ones((3, 3), jnp.bfloat16)

    def layers(params, x):
        def body(h, wi):
            return h @ wi.astype(jnp.bfloat16), None
        h, _ = jax.lax.scan(body, x, params["stack"])
        h = jax.checkpoint(lambda h, t: h @ t.astype(jnp.bfloat16))(h, params["once"])
        h = h @ params["twice"].astype(jnp.bfloat16) + (x @ params["twice"].astype(
            jnp.bfloat16))  # a tied weight: two cotangents, added in float32 today
        h = h.astype(jnp.float32) @ params["float32"]  # consumed in float32
        return jnp.sum(h) + jnp.sum(jax.lax.scan(  # a loop constant, cast every iteration
            lambda c, _: (c + params["const"].astype(jnp.bfloat16), None), x, None,
            length=2)[0])

    params = {"stack": w, "once": w[0], "twice": w[0], "float32": w[0], "const": w[0]}
    assert _dtypes(layers, params, x) == {"stack": BF16, "once": BF16, "twice": None,
                                          "float32": None, "const": None}


@pytest.fixture(scope="module")
def steps_and_batches():
    config = tiny_lm_config.get_config()
    # bfloat16 compute, and the backward pass recomputing elementwise operations (the casts
    # among them), as configs/lm_bench.py trains
    config.model.update(compute_dtype="bfloat16", remat="elementwise")
    config.data.update(batch_size=8, micro_batch_size=4)
    rng = np.random.default_rng(0)

    def batch():
        return {"tokens": jnp.asarray(rng.integers(1, VOCAB, (4, 16)), jnp.int32),
                "segments": jnp.ones((4, 16), jnp.int32), "targets": jnp.ones((4, 16), bool),
                "bytes": jnp.full((4,), 40.0, jnp.float32)}

    return training.build_steps(run_config(config), VOCAB), [batch() for _ in range(6)]


def test_the_model_selects_its_bf16_matmul_weights_not_its_router(steps_and_batches):
    steps, batches = steps_and_batches
    copies = steps.compute_copies(steps.init_state(), batches[0])
    layer = copies["stacks"][0]["layers"][0]
    for expert in ("w_gate", "w_up", "w_down"):
        assert layer["mlp"]["moe"][expert].dtype == BF16
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert layer["self_attn"][proj]["kernel"].dtype == BF16
    assert copies["lm_head"]["kernel"].dtype == BF16
    assert layer["mlp"]["moe"]["router"]["kernel"] is None  # the router computes in float32
    np.testing.assert_array_equal(  # the copy is the cast, nothing else
        layer["mlp"]["moe"]["w_up"],
        steps.params["stacks"][0]["layers"][0]["mlp"]["moe"]["w_up"].astype(jnp.bfloat16))


def _assert_within_bf16_rounding(actual, desired):
    """On a GPU the matmuls that consume a parameter through a cast and those that consume its
    copy are different kernels: XLA fuses the cast into the GEMM's operand read (a Triton GEMM)
    in one program and hands a bfloat16 parameter to a library GEMM in the other, and the two sum
    their float32 products in different orders. Where a product lies at a bfloat16 rounding
    boundary its two roundings differ by one ulp, and a gradient that such a product feeds (itself
    rounded to bfloat16 again) by up to two: relative 2**-6 of the value, or 2**-6 of the leaf's
    largest element where a sum cancels to near zero."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    scale = float(np.max(np.abs(desired), initial=0.0))
    np.testing.assert_allclose(actual, desired, rtol=2**-6, atol=2**-6 * scale)


def test_updates_with_copies_equal_updates_without_bitwise(steps_and_batches):
    """Three updates of two micro-batches: with the copies made once per update (the steps'
    own path) and without any (every layer casting its weights, as before): the accumulated
    gradients and the parameters are equal bit for bit on CPU, since the copies' gradients are
    the cotangents the casts' own derivative converts to float32 and XLA:CPU runs the same
    matmul kernel whichever way its bfloat16 operand was made. On a GPU they agree to bfloat16
    rounding (:func:`_assert_within_bf16_rounding`); an H200 showed 10 of 1,920 elements of one
    gradient a bfloat16 ulp or two apart (at most 0.0156, relative 0.0081)."""
    steps, batches = steps_and_batches
    bitwise = jax.default_backend() == "cpu"
    # On a GPU, parameters within one Adam step at the peak learning rate (3e-3, about what a
    # step moves an element): gradients that agree to bfloat16 rounding give steps that differ
    # by far less than a whole step.
    same_grads = np.testing.assert_array_equal if bitwise else _assert_within_bf16_rounding
    same_params = np.testing.assert_array_equal if bitwise else functools.partial(
        np.testing.assert_allclose, rtol=0, atol=3e-3)
    key = jax.random.key(3)
    none = jax.tree.map(lambda _: None, steps.params)
    ref = steps.new_state(jax.tree.map(jnp.copy, steps.params), steps.layer_state)
    new = steps.new_state(jax.tree.map(jnp.copy, steps.params), steps.layer_state)
    for update in range(3):
        pair = batches[2 * update: 2 * update + 2]
        step_key = jax.random.fold_in(key, update)
        accs = []
        for state, copies in ((ref, none), (new, steps.compute_copies(new, pair[0]))):
            acc = steps.zeros(state, pair[0])
            for j, b in enumerate(pair):
                acc, _ = steps.accumulate(state, acc, b, jax.random.fold_in(step_key, j),
                                          copies)
            accs.append(acc)
        jax.tree.map(same_grads, accs[0]["grads"], accs[1]["grads"])
        equal = [np.asarray(a) == np.asarray(b) for a, b in zip(
            jax.tree.leaves(accs[0]["grads"]), jax.tree.leaves(accs[1]["grads"]), strict=True)]
        # where the kernels differ, few elements land on a rounding boundary
        assert sum(e.sum() for e in equal) >= 0.95 * sum(e.size for e in equal)
        ref, _ = steps.update(ref, accs[0])
        new, _ = steps.train_step(new, pair, step_key)
        jax.tree.map(same_params, ref.params, new.params)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), new.params,
                                         steps_and_batches[0].params))
    assert sum(moved) > len(moved) // 2  # three updates changed the parameters
