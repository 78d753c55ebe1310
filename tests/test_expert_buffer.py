"""Expert-parallel exchange buffers sized by ``expert_buffer_factor``: the rows that overflow
are the ones counted here by hand, every other row's output equals one device's, the exchange
and the experts run on ``f`` times a balanced routing's rows, and a factor of at least the
expert axis's size is the dropless exchange."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.moe import MoEConfig, MoEFeedForward, expert_ffn
from sparsemixer_jax.moe.expert_parallel import buffer_overflow, buffer_slots, expert_parallel_ffn
from sparsemixer_jax.parallel.sharding import make_mesh
from tests import kit

# 2 data shards x 4 expert devices; 8 experts (2 a device). A data shard holds 4 rows of 12
# positions: 48 rows, 4 chunks of 12, so a balanced routing sends 3 rows of each chunk to each
# device.
EMB, MLP, N, B, T, DATA, EXPERT = 16, 32, 8, 8, 12, 2, 4
CHUNK = B // DATA * T // EXPERT


def _inputs(skew: bool):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, EMB)), jnp.float32)
    # Skewed: most rows to experts 0 and 1 (device 0), so its slots overflow.
    p = np.array([0.3, 0.3] + [0.05] * 6 + [0.1]) if skew else np.full(N + 1, 1 / (N + 1))
    group = jnp.asarray(rng.choice(N + 1, size=(B, T), p=p / p.sum()), jnp.int32)  # N: none
    ids = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)
    keys = jax.random.split(jax.random.key(1), 4)
    params = (jax.random.normal(keys[0], (N, EMB, MLP)) * 0.2,
              jax.random.normal(keys[1], (N, MLP)) * 0.1,
              jax.random.normal(keys[2], (N, MLP, EMB)) * 0.2,
              jax.random.normal(keys[3], (N, EMB)) * 0.1)
    return x, group, ids, params


def _overflow_by_hand(group: np.ndarray, slots: int) -> np.ndarray:
    """The rows past their destination's ``slots`` in each chunk of ``CHUNK`` rows of a data
    shard (batch rows ``[d * B / DATA, (d + 1) * B / DATA)``), counted in row order."""
    rows = group.reshape(DATA, -1)
    over = np.zeros_like(rows, bool)
    for d in range(DATA):
        for c in range(EXPERT):
            seen = [0] * EXPERT
            for r in range(c * CHUNK, (c + 1) * CHUNK):
                if rows[d, r] < N:
                    dest = rows[d, r] // (N // EXPERT)
                    over[d, r] = seen[dest] >= slots
                    seen[dest] += 1
    return over.reshape(group.shape)


def test_slots_are_the_factor_of_a_balanced_share():
    assert buffer_slots(0.0, CHUNK, EXPERT) == CHUNK  # room for every row
    assert buffer_slots(1.0, CHUNK, EXPERT) == 3
    assert buffer_slots(1.5, CHUNK, EXPERT) == math.ceil(1.5 * CHUNK / EXPERT) == 5
    assert buffer_slots(EXPERT, CHUNK, EXPERT) == CHUNK
    assert buffer_slots(100.0, CHUNK, EXPERT) == CHUNK  # never more than a chunk
    assert buffer_slots(1e-3, CHUNK, EXPERT) == 1
    with pytest.raises(ValueError, match=r"buffer_factor must be >= 0"):
        buffer_slots(-1.0, CHUNK, EXPERT)


@pytest.mark.parametrize("dispatch", ["ragged", "padded"])
def test_rows_past_their_slots_drop_and_the_rest_equal_one_device(dispatch):
    x, group, ids, params = _inputs(skew=True)
    mesh = make_mesh(DATA, EXPERT, jax.devices()[:DATA * EXPERT])
    factor = 1.0
    over = np.asarray(buffer_overflow(group, mesh=mesh, num_experts=N, buffer_factor=factor))
    want_over = _overflow_by_hand(np.asarray(group), buffer_slots(factor, CHUNK, EXPERT))
    np.testing.assert_array_equal(over, want_over)
    assert 0 < over.sum() < (np.asarray(group) < N).sum()  # the skew overflows some rows
    served = jnp.where(over, N, group)
    got = jax.jit(lambda x, g: expert_parallel_ffn(
        x, g, ids, params, mesh=mesh, dispatch=dispatch, buffer_factor=factor))
    one = expert_ffn(x.reshape(B * T, EMB), served.reshape(-1), ids.reshape(-1), params,
                     dispatch=dispatch).reshape(B, T, EMB)
    # The same rows through the same expert FFN, a different order of rows around the matmuls:
    # float32 sums of 32 products of O(1) values, equal to a few ulps.
    np.testing.assert_allclose(np.asarray(got(x, served)), np.asarray(one), rtol=1e-5,
                               atol=1e-5)
    # Unmarked rows past their slots are dropped by the exchange itself: the same outputs.
    np.testing.assert_allclose(np.asarray(got(x, group)), np.asarray(one), rtol=1e-5, atol=1e-5)


def test_a_factor_of_the_expert_axis_is_the_dropless_exchange():
    x, group, ids, params = _inputs(skew=True)
    mesh = make_mesh(DATA, EXPERT, jax.devices()[:DATA * EXPERT])
    assert not np.asarray(buffer_overflow(group, mesh=mesh, num_experts=N,
                                          buffer_factor=float(EXPERT))).any()
    run = [jax.jit(lambda x, f=f: expert_parallel_ffn(x, group, ids, params, mesh=mesh,
                                                     dispatch="ragged", buffer_factor=f))(x)
           for f in (0.0, float(EXPERT))]
    np.testing.assert_array_equal(np.asarray(run[0]), np.asarray(run[1]))


def _exchanged_rows(factor: float) -> set[int]:
    """The rows (per device) of the activations' all-to-alls in the lowered exchange: their
    ``[devices, slots, EMB]`` float32 results."""
    x, group, ids, params = _inputs(skew=False)
    mesh = make_mesh(DATA, EXPERT, jax.devices()[:DATA * EXPERT])
    text = jax.jit(lambda x: expert_parallel_ffn(
        x, group, ids, params, mesh=mesh, dispatch="ragged", buffer_factor=factor)
    ).lower(x).as_text()
    shapes = re.findall(rf'"stablehlo.all_to_all".*-> tensor<(\d+)x(\d+)x{EMB}xf32>', text)
    assert len(shapes) == 2, "expected the rows' exchange there and back"
    return {int(devices) * int(slots) for devices, slots in shapes}


def test_the_exchange_moves_the_factor_of_a_balanced_share():
    # Dropless: every device receives room for its whole data shard (EXPERT chunks); at
    # factor 1, one chunk's worth (EXPERT slots of CHUNK / EXPERT rows).
    assert _exchanged_rows(0.0) == {EXPERT * CHUNK}
    assert _exchanged_rows(1.0) == {EXPERT * buffer_slots(1.0, CHUNK, EXPERT)} == {CHUNK}


def _layer(mesh, factor):
    return MoEFeedForward((EMB, MLP), *kit.moe_sections(
        N, router="switch", top_k=2, activation_dropout=0.0, jitter_eps=0.0,
        expert_buffer_factor=factor), mesh=mesh, rngs=nnx.Rngs(params=0, router=1))


def test_the_layer_counts_the_rows_it_drops():
    """The layer's ``dropped_fraction`` is the share of its rows that overflow (counted by
    hand from its own choices); those rows output zeros, so its output differs from the
    dropless layer's exactly at the tokens that lost a row."""
    mesh = make_mesh(DATA, EXPERT, jax.devices()[:DATA * EXPERT])
    x = jax.random.normal(jax.random.key(3), (B, T // 2, EMB))
    run = nnx.jit(lambda m, x: m(x, deterministic=True))
    layer = _layer(mesh, 1.0)
    # Skew the router towards experts 0 and 1 (device 0) so that its slots overflow.
    layer.router.bias[...] = jnp.array([3.0, 2.5] + [0.0] * (N - 2))
    y, metrics = run(layer, x)
    dropless = _layer(mesh, 0.0)
    nnx.update(dropless, nnx.state(layer))
    y0, metrics0 = run(dropless, x)
    logits = np.asarray(x @ layer.router.kernel[...] + layer.router.bias[...])
    expert = np.argsort(-logits, axis=-1, kind="stable")[..., :2]  # [B, T/2, 2]
    group = expert.reshape(B, T)  # rows token * 2 + choice
    over = _overflow_by_hand(group, buffer_slots(1.0, CHUNK, EXPERT))
    assert over.any()
    assert float(metrics["dropped_fraction"]) == pytest.approx(over.mean(), rel=1e-6)
    assert float(metrics0["dropped_fraction"]) == 0.0
    lost = over.reshape(B, T // 2, 2).any(-1)
    diff = np.abs(np.asarray(y) - np.asarray(y0)).max(-1)
    # A lost row is a whole expert output of O(0.1) gone; a kept token's rows meet the same
    # weights in a buffer of another size, equal to float32 rounding of 16- and 32-term sums.
    assert (diff[lost] > 1e-3).all() and (diff[~lost] < 1e-5).all()


def test_a_negative_factor_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^config\.model\.expert_buffer_factor must be >= 0"):
        MoEConfig(num_experts=N, expert_buffer_factor=-0.5).check("config.model.")


def test_the_lm_config_field_reaches_every_moe_layer():
    """``config.model.expert_buffer_factor`` of a language-model config reaches the model's MoE
    layers (through the typed sections and :class:`LMConfig`)."""
    from configs import lm_quickstart
    from sparsemixer_jax.hf.scratch import from_scratch_config
    from sparsemixer_jax.models.causal_lm import CausalLM
    from sparsemixer_jax.models.lm_config import LMExecution
    from sparsemixer_jax.routers import RouterConfig
    from sparsemixer_jax.tasks.lm_sections import LMModelConfig

    config = lm_quickstart.get_config()
    config.model.expert_buffer_factor = 1.5
    lm = from_scratch_config(LMModelConfig.from_config(config.model),
                             RouterConfig.from_config(config.router), vocab_size=64,
                             execution=LMExecution.from_config(config.model))
    assert lm.execution.expert_buffer_factor == 1.5
    model = nnx.eval_shape(lambda: CausalLM(lm, rngs=nnx.Rngs(0)))
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoEFeedForward)]
    assert layers and all(m.moe.expert_buffer_factor == 1.5 for m in layers)
