"""The one attention module (:mod:`sparsemixer_jax.layers.attention`): each model's parameter names,
its two einsum layouts agree, and the cache's bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.layers.attention import (
    FAIRSEQ_NAMES,
    HF_NAMES,
    Attention,
    AttentionOptions,
    KVCache,
)


def _linear(rngs: nnx.Rngs):
    def make(in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
        return nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=rngs)
    return make


def _attention(options: AttentionOptions) -> Attention:
    rngs = nnx.Rngs(params=0, dropout=1)
    return Attention(options, qkv_linear=_linear(rngs), out_linear=_linear(rngs), rngs=rngs)


def test_parameter_names_are_each_models_own():
    """fairseq's names for the translation/ELECTRA checkpoints, the HF types' for the LMs."""
    for names in (FAIRSEQ_NAMES, HF_NAMES):
        attn = _attention(AttentionOptions(16, 4, 2, 4, names=names))
        params = nnx.state(attn, nnx.Param)
        assert sorted(params.keys()) == sorted(names)
        assert params[names[1]]["kernel"].shape == (16, 2 * 4)  # two key/value heads
    with pytest.raises(ValueError, match=r"projection names \['project_q'\]"):
        _attention(AttentionOptions(16, 4, 4, 4, names=("project_q", "k", "v", "o")))
    with pytest.raises(ValueError, match="'heads' needs them equal"):
        _attention(AttentionOptions(16, 4, 2, 4, einsum_layout="heads"))


def test_the_two_einsum_layouts_give_the_same_attention():
    """Same weights, one query/key/value head each: the layouts differ in the order of float32
    sums only, a few units in the last place of values of size about 1."""
    heads = _attention(AttentionOptions(16, 4, 4, 4, einsum_layout="heads"))
    grouped = _attention(AttentionOptions(16, 4, 4, 4))
    nnx.update(grouped, nnx.state(heads, nnx.Param))
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None] & jnp.array([True] * 4 + [False])
    bias = jax.random.normal(jax.random.key(1), (1, 4, 5, 5))
    want = heads(x, x, mask, deterministic=True, bias=bias)
    got = grouped(x, x, mask, deterministic=True, bias=bias)
    assert not np.allclose(want, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_cache_records_real_slots_and_positions():
    cache = KVCache.empty((jnp.zeros((2, 4, 1, 1)),), (jnp.zeros((2, 4, 1, 1)),), 2, 4)
    real = jnp.array([[False, True], [True, True]])  # row 0 starts with left padding
    cache = cache.advanced(cache.keys, cache.values, real)
    cache = cache.advanced(cache.keys, cache.values, jnp.ones((2, 1), bool))
    assert int(cache.index) == 3
    assert cache.valid.tolist() == [[False, True, True, False], [True, True, True, False]]
    assert cache.positions.tolist() == [2, 3]
