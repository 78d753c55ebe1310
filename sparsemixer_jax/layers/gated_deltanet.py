"""Gated DeltaNet, the linear-attention layer of the Qwen3-Next and Qwen3.5 hybrids, beside
the attention module (:mod:`sparsemixer_jax.layers.attention`).

For input ``x`` ``[B, T, D]`` the layer projects queries and keys (``Hk`` heads of ``Dk``),
values and output gates ``z`` (``Hv`` heads of ``Dv``; ``Hv`` a multiple of ``Hk``), a write
strength ``b`` and a decay input ``a`` per value head; runs a short causal depthwise
convolution with SiLU over the concatenated queries, keys and values; L2-norms queries and
keys and scales queries by ``Dk^-1/2``; repeats each key head over its ``Hv / Hk`` value heads;
runs the gated delta rule (:mod:`sparsemixer_jax.layers.delta_rule`) with ``beta =
sigmoid(b)`` and log decay ``g = -exp(A_log) * softplus(a + dt_bias)``; normalises each value
head's output with an RMSNorm gated by ``silu(z)``; and projects back to ``D``.

Two projection layouts hold the same computation (:attr:`GatedDeltaNetConfig.layout`):
``"fused"`` (Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, their outputs grouped per key
head: for each key head its query, key, then its value heads' values and gates; its value
heads' ``b`` then their ``a``) and ``"separate"`` (Qwen3.5: ``in_proj_qkv`` laid out as all
queries, all keys, all values; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.layers.delta_rule import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    segment_resets,
)
from sparsemixer_jax.layers.linear import projection
from sparsemixer_jax.layers.norms import RMSNorm

LAYOUTS = ("fused", "separate")
FORMS = ("chunked", "recurrent")


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """What a :class:`GatedDeltaNet` computes (a model config's linear-attention section).

    Attributes:
      hidden_size: width ``D`` of the input and output.
      num_key_heads, num_value_heads: ``Hk`` query/key heads and ``Hv`` value heads, ``Hv`` a
        multiple of ``Hk`` (value head ``h`` reads key head ``h // (Hv / Hk)``).
      key_head_dim, value_head_dim: ``Dk`` and ``Dv``.
      conv_kernel_size: taps ``K`` of the causal convolution (the decode cache keeps ``K - 1``
        inputs).
      chunk_size: tokens per chunk of the chunked form.
      layout: ``"fused"`` (Qwen3-Next's projections) or ``"separate"`` (Qwen3.5's).
      form: ``"chunked"`` or ``"recurrent"``: the form of calls longer than one token (one
        token always takes the recurrent step).
      norm_eps: epsilon of the gated RMSNorm.
      l2_eps: epsilon of the query and key L2 norms (``x / sqrt(sum(x^2) + eps)``).
      compute_dtype: dtype of the projections and the layer's output; the delta rule itself,
        the decay and the norms' statistics are float32.
      initializer_range: standard deviation of the projections' and the convolution's
        initial weights.
    """

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    chunk_size: int = 64
    layout: str = "fused"
    form: str = "chunked"
    norm_eps: float = 1e-6
    l2_eps: float = 1e-6
    compute_dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self):
        for key in ("hidden_size", "num_key_heads", "num_value_heads", "key_head_dim",
                    "value_head_dim", "conv_kernel_size", "chunk_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"gated_deltanet.{key}={getattr(self, key)} must be at least 1")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"gated_deltanet.num_value_heads={self.num_value_heads} is not a multiple of "
                f"num_key_heads={self.num_key_heads} (each key head serves a whole group of "
                "value heads)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"gated_deltanet.layout={self.layout!r} is not one of {LAYOUTS}")
        if self.form not in FORMS:
            raise ValueError(f"gated_deltanet.form={self.form!r} is not one of {FORMS}")

    @property
    def key_dim(self) -> int:
        """``Hk * Dk``, the width of all queries (and of all keys)."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """``Hv * Dv``, the width of all values (and of all output gates)."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values concatenated."""
        return 2 * self.key_dim + self.value_dim

    @property
    def heads_per_key(self) -> int:
        """``Hv / Hk``, the value heads that read one key head."""
        return self.num_value_heads // self.num_key_heads


class DeltaNetCache(NamedTuple):
    """A Gated DeltaNet layer's decode cache (a pytree), the counterpart of the attention
    layers' keys and values.

    Attributes:
      conv: ``[B, K - 1, conv_dim]``, the convolution's last inputs (compute dtype), oldest
        first; zeros where there were none.
      state: float32 ``[B, Hv, Dk, Dv]``, the delta rule's state after the last token.
    """

    conv: jax.Array
    state: jax.Array

    @classmethod
    def empty(cls, config: GatedDeltaNetConfig, batch_size: int) -> DeltaNetCache:
        """The cache of a layer that has seen nothing."""
        return cls(
            jnp.zeros((batch_size, config.conv_kernel_size - 1, config.conv_dim),
                      jnp.dtype(config.compute_dtype)),
            jnp.zeros((batch_size, config.num_value_heads, config.key_head_dim,
                       config.value_head_dim), jnp.float32))


def l2_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet layer (module docstring), Flax NNX, parameters named as in the
    Hugging Face types (``conv1d`` holds the convolution's weight ``[conv_dim, K]``, their
    ``conv1d.weight`` without its unit middle axis)."""

    def __init__(self, config: GatedDeltaNetConfig, rngs: nnx.Rngs):
        self.config = config
        c = config

        def proj(din: int, dout: int) -> nnx.Linear:
            return projection(din, dout, False, c.compute_dtype, c.initializer_range, rngs)

        if c.layout == "fused":
            self.in_proj_qkvz = proj(c.hidden_size, 2 * c.key_dim + 2 * c.value_dim)
            self.in_proj_ba = proj(c.hidden_size, 2 * c.num_value_heads)
        else:
            self.in_proj_qkv = proj(c.hidden_size, c.conv_dim)
            self.in_proj_z = proj(c.hidden_size, c.value_dim)
            self.in_proj_b = proj(c.hidden_size, c.num_value_heads)
            self.in_proj_a = proj(c.hidden_size, c.num_value_heads)
        self.conv1d = nnx.Param(c.initializer_range * jax.random.normal(
            rngs.params(), (c.conv_dim, c.conv_kernel_size), jnp.float32))
        # As the Hugging Face types start them: dt_bias at one, A drawn uniformly from (0, 16]
        # (decay rates exp(A_log) spread over orders of magnitude; the floor keeps log finite).
        self.dt_bias = nnx.Param(jnp.ones((c.num_value_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (c.num_value_heads,), jnp.float32, minval=0.01, maxval=16.0)))
        self.norm = RMSNorm(c.value_head_dim, c.norm_eps, jnp.dtype(c.compute_dtype))
        self.out_proj = proj(c.value_dim, c.hidden_size)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The input projections of ``x`` ``[B, T, D]`` as ``(qkv [B, T, conv_dim]`` (all
        queries, all keys, all values), ``z [B, T, Hv, Dv]``, ``b, a [B, T, Hv])``, whichever
        the layout."""
        c = self.config
        batch, length, _ = x.shape
        if c.layout == "separate":
            z = self.in_proj_z(x).reshape(batch, length, c.num_value_heads, c.value_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Fused: per key head [q (Dk), k (Dk), v (G * Dv), z (G * Dv)] and [b (G), a (G)],
        # G = Hv / Hk; value head h = key head * G + its place in the group.
        group = c.heads_per_key * c.value_head_dim
        qkvz = self.in_proj_qkvz(x).reshape(batch, length, c.num_key_heads, -1)
        q, k, v, z = jnp.split(qkvz, [c.key_head_dim, 2 * c.key_head_dim,
                                      2 * c.key_head_dim + group], axis=-1)
        ba = self.in_proj_ba(x).reshape(batch, length, c.num_key_heads, 2 * c.heads_per_key)
        b, a = jnp.split(ba, 2, axis=-1)
        qkv = jnp.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
        z = z.reshape(batch, length, c.num_value_heads, c.value_head_dim)
        return (qkv, z, b.reshape(batch, length, c.num_value_heads),
                a.reshape(batch, length, c.num_value_heads))

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                 token_mask: jax.Array | None = None, cache: DeltaNetCache | None = None
                 ) -> tuple[jax.Array, DeltaNetCache]:
        """The layer on ``x`` ``[B, T, D]``.

        Args:
          segment_ids: int ``[B, T]``, packed documents: where the id changes the state and
            the convolution start afresh. None: one document per row.
          token_mask: bool ``[B, T]``, False at padding: a padded token feeds zeros to the
            convolution and leaves the state as it is (it neither decays nor writes), so left
            padding changes nothing at the real tokens. None: no padding.
          cache: the state and convolution inputs after the tokens before ``x`` (decoding, or
            a prefill that goes on); None: nothing before.

        Returns:
          ``(y [B, T, D]`` in the compute dtype, the cache after ``x``'s last token).
        """
        c = self.config
        dtype = jnp.dtype(c.compute_dtype)
        batch, length, _ = x.shape
        if cache is None:
            cache = DeltaNetCache.empty(c, batch)
        reset = None if segment_ids is None else segment_resets(segment_ids)
        qkv, z, b, a = self.project(x.astype(dtype))
        if token_mask is not None:
            qkv = jnp.where(token_mask[..., None], qkv, 0)
        qkv, conv_state = causal_conv1d(qkv, self.conv1d[...].astype(dtype), cache.conv, reset)
        qkv = jax.nn.silu(qkv)
        q, k, v = jnp.split(qkv, [c.key_dim, 2 * c.key_dim], axis=-1)
        q = l2_normalize(q.reshape(batch, length, c.num_key_heads, c.key_head_dim), c.l2_eps)
        k = l2_normalize(k.reshape(batch, length, c.num_key_heads, c.key_head_dim), c.l2_eps)
        q = q * c.key_head_dim ** -0.5
        q, k = (jnp.repeat(t, c.heads_per_key, axis=2) for t in (q, k))
        v = v.reshape(batch, length, c.num_value_heads, c.value_head_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        # The decay in float32: exp(A_log) in a half dtype can overflow.
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        if token_mask is not None:
            beta = jnp.where(token_mask[..., None], beta, 0.0)
            g = jnp.where(token_mask[..., None], g, 0.0)
        if length == 1 or c.form == "recurrent":
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, cache.state, reset)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, cache.state, reset, c.chunk_size)
        # The gated RMSNorm: norm(o) * silu(z) per value head, gate in float32.
        o = self.norm(o.astype(dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        y = self.out_proj(o.astype(dtype).reshape(batch, length, c.value_dim))
        return y, DeltaNetCache(conv_state, state)
