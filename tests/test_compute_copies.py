"""Parameters cast to the compute dtype once per update (training/compute_copies.py): which ones
the model's own casts select, and that training with the copies is bit for bit training
without them (on CPU, where reductions are deterministic)."""

from __future__ import annotations

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


def test_updates_with_copies_equal_updates_without_bitwise(steps_and_batches):
    """Three updates of two micro-batches: with the copies made once per update (the steps'
    own path) and without any (every layer casting its weights, as before): the accumulated
    gradients and the parameters are equal bit for bit, since the copies' gradients are the
    cotangents the casts' own derivative converts to float32."""
    steps, batches = steps_and_batches
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
        jax.tree.map(np.testing.assert_array_equal, accs[0]["grads"], accs[1]["grads"])
        ref, _ = steps.update(ref, accs[0])
        new, _ = steps.train_step(new, pair, step_key)
        jax.tree.map(np.testing.assert_array_equal, ref.params, new.params)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), new.params,
                                         steps_and_batches[0].params))
    assert sum(moved) > len(moved) // 2  # three updates changed the parameters
