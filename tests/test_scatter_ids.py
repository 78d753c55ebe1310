"""The differentiated dispatch keeps no per-element scatter ids.

Differentiating ``zeros.at[slot].set(x)`` where ``slot`` may repeat makes JAX scatter an unsigned
id per element of the result, an array of the whole buffer's shape ``[rows, emb]``, to find
which update won each slot; for OLMoE on 8 H100s that was a 2 GiB ``u32[262144, 2048]`` per
GPU. The dispatch scatters only to distinct slots and says so (``unique_indices``), so its
gradient is a plain gather. These tests lower the gradient of the scattering dispatches (the
expert-parallel exchange, the block-padded layout) and look for an unsigned integer array whose
last axis is the model width.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax.moe.dispatch import ExpertRows, padded_ffn
from sparsemixer_jax.moe.expert_parallel import expert_parallel_ffn
from sparsemixer_jax.parallel.sharding import make_mesh

# A model width no other axis here has, so a [..., EMB] array is recognisable in the HLO text.
EMB, MLP, N, B, T = 24, 16, 8, 8, 12


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, EMB)), jnp.float32)
    # Some rows without expert (group N): those are the ones that used to share a slot.
    group = jnp.asarray(rng.integers(0, N + 1, size=(B, T)), jnp.int32)
    ids = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)
    params = (jnp.ones((N, EMB, MLP)) * 0.1, jnp.zeros((N, MLP)),
              jnp.ones((N, MLP, EMB)) * 0.1, jnp.zeros((N, EMB)))
    return x, group, ids, params


def _unsigned_width_arrays(lowered_text: str) -> list[str]:
    """The StableHLO tensor types of unsigned integer arrays whose last axis is ``EMB``."""
    return re.findall(rf"tensor<(?:\d+x)*{EMB}xui\d+>", lowered_text)


def _grad_text(ffn, x, params) -> str:
    def loss(x, params):
        return jnp.sum(ffn(x, params) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).as_text()


@pytest.mark.parametrize("dispatch", ["padded", "ragged"])
def test_expert_parallel_gradient_has_no_scatter_ids(dispatch):
    x, group, ids, params = _inputs()
    mesh = make_mesh(2, 4)
    text = _grad_text(lambda x, p: expert_parallel_ffn(
        x, group, ids, p, mesh=mesh, dispatch=dispatch, activation="relu"), x, params)
    assert _unsigned_width_arrays(text) == []


@pytest.mark.parametrize("capacity", [None, 6])
def test_padded_gradient_has_no_scatter_ids(capacity):
    x, group, ids, params = _inputs()
    text = _grad_text(lambda x, p: padded_ffn(
        ExpertRows(x.reshape(B * T, EMB), group.reshape(-1), ids.reshape(-1), *p), capacity),
        x, params)
    assert _unsigned_width_arrays(text) == []
