"""The norms of the models, statistics in float32 whatever the compute dtype: the language
models' RMSNorm and LayerNorm with bias (:class:`~sparsemixer_jax.models.causal_lm.CausalLM`)
and fairseq's LayerNorm (the translation Transformer and the ELECTRA encoder)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, statistics in float32.

    ``zero_centred``: scaled by ``1 + weight`` instead, in float32 before the cast (the weight
    starts at zero; Qwen3-Next's and Qwen3.5's norms)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, zero_centred: bool = False):
        self.weight = nnx.Param((jnp.zeros if zero_centred else jnp.ones)((dim,), jnp.float32))
        self.eps, self.dtype, self.zero_centred = eps, dtype, zero_centred

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centred:
            return (y * (1.0 + self.weight[...])).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * y.astype(self.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (Phi-3.5-MoE), statistics in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]
        return y.astype(self.dtype)


def layer_norm(emb_dim: int, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """fairseq's LayerNorm over the last axis ``emb_dim`` (weight and bias), computing in
    ``dtype``."""
    # fairseq's LayerNorm epsilon; flax computes the statistics in float32 whatever ``dtype``.
    return nnx.LayerNorm(emb_dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
