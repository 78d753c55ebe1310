"""The ``auto`` dispatch table and the switch for ragged_dot's grouped GPU lowering."""

from __future__ import annotations

import jax
import pytest

from sparsemixer_jax import moe
from sparsemixer_jax.kernels import triton_ragged_dot


def test_auto_dispatch_per_backend():
    assert moe.resolve_dispatch("auto", "cpu") == "padded"
    assert moe.resolve_dispatch("auto", "tpu") == "ragged"
    for gpu in ("gpu", "cuda", "rocm"):  # jax 0.11 names NVIDIA's platform "cuda"
        assert moe.resolve_dispatch("auto", gpu) == "padded"
    assert moe.resolve_dispatch("auto", "metal") == "padded"
    assert moe.resolve_dispatch("ragged", "cuda") == "ragged"  # an explicit choice is kept
    assert moe.resolve_dispatch("auto") == moe.AUTO_DISPATCH[jax.default_backend()]


def test_gpu_auto_picks_ragged_only_with_grouped_kernels(monkeypatch):
    monkeypatch.setattr(triton_ragged_dot, "triton_ragged_dot_enabled", lambda: True)
    assert moe.resolve_dispatch("auto", "cuda") == "ragged"
    assert moe.resolve_dispatch("auto", "cpu") == "padded"


def test_enable_triton_ragged_dot_falls_back_without_the_kernels(monkeypatch):
    option = triton_ragged_dot.TRITON_RAGGED_DOT_OPTION
    before = jax.config.values[option]
    monkeypatch.setattr(triton_ragged_dot, "TRITON_RAGGED_DOT_MODULE", "jax._src.no_such.module")
    assert not triton_ragged_dot.triton_ragged_dot_available()
    assert triton_ragged_dot.enable_triton_ragged_dot() is False
    assert jax.config.values[option] == before  # untouched: turning it on would break compiles
    assert not triton_ragged_dot.triton_ragged_dot_enabled()


def test_enable_triton_ragged_dot_where_available(monkeypatch):
    option = triton_ragged_dot.TRITON_RAGGED_DOT_OPTION
    monkeypatch.setattr(triton_ragged_dot, "TRITON_RAGGED_DOT_MODULE", "jax._src.lax.lax")
    assert triton_ragged_dot.triton_ragged_dot_available()
    try:
        assert triton_ragged_dot.enable_triton_ragged_dot() is True
        assert triton_ragged_dot.triton_ragged_dot_enabled()
        assert moe.resolve_dispatch("auto", "gpu") == "ragged"
    finally:
        jax.config.update(option, False)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="needs an NVIDIA GPU")
def test_triton_ragged_dot_matches_padded_on_gpu():
    """Where the grouped kernels exist, ragged (Triton) and padded agree in float32 (highest)."""
    import jax.numpy as jnp
    import numpy as np

    if not triton_ragged_dot.enable_triton_ragged_dot():
        pytest.skip("this jax wheel lacks the Pallas/Triton ragged_dot kernels")
    try:
        kx, kg, kw = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (256, 64))
        group = jax.random.randint(kg, (256,), 0, 4)
        ids = jnp.arange(256, dtype=jnp.int32)
        k1, k2 = jax.random.split(kw)
        params = (jax.random.normal(k1, (4, 64, 128)) / 8, jnp.zeros((4, 128)),
                  jax.random.normal(k2, (4, 128, 64)) / 11, jnp.zeros((4, 64)))
        with jax.default_matmul_precision("highest"):
            outs = [jax.jit(lambda p, d=d: moe.expert_ffn(x, group, ids, p, dispatch=d))(params)
                    for d in ("ragged", "padded")]
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    finally:
        jax.config.update(triton_ragged_dot.TRITON_RAGGED_DOT_OPTION, False)
