"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi-K2), as transformers 5.23's
``DeepseekV3Attention`` computes it, for :class:`sparsemixer_jax.models.causal_lm.CausalLM`
models whose config has ``kv_lora_rank > 0``.

Per token, with ``H`` heads, ``n = head_dim - qk_rope_head_dim`` unrotated and ``r =
qk_rope_head_dim`` rotated query/key dimensions and ``v = v_head_dim``:

* queries ``[H, n + r]``: ``q_b_proj(norm(q_a_proj(x)))`` (``q_lora_rank > 0``) or
  ``q_proj(x)``;
* ``kv_a_proj_with_mqa(x)`` gives a latent ``c [kv_lora_rank]`` and one rotated key
  ``k_r [r]`` shared by every head; ``kv_b_proj(norm(c))`` gives each head's unrotated key
  ``[n]`` and value ``[v]``; a head's key is ``[k_nope, k_r]``;
* the last ``r`` query dimensions and ``k_r`` are rotated (pairs interleaved where
  ``rope_interleave``), the softmax scale is ``head_dim^-0.5`` times YaRN's
  :func:`~sparsemixer_jax.layers.rope.yarn_softmax_mscale`, and ``o_proj`` maps the
  ``[H, v]`` heads back.

The cache holds what transformers' holds: the normed latent and the rotated shared key per
token (:attr:`LMArchitecture.cache_shapes`); keys and values are expanded from them at each call.
The two norms take transformers' fixed epsilon 1e-6 (``DeepseekV3RMSNorm``'s default), not
``rms_norm_eps``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.layers.attention import MASK_VALUE
from sparsemixer_jax.layers.linear import linear
from sparsemixer_jax.layers.norms import RMSNorm
from sparsemixer_jax.layers.rope import apply_rope, deinterleave, yarn_softmax_mscale
from sparsemixer_jax.models.lm_config import LMConfig

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    """Multi-head latent attention with the interface of
    :class:`~sparsemixer_jax.layers.attention.Attention`: :meth:`qkv` gives the queries and
    what the cache holds, :meth:`attend` expands and attends."""

    def __init__(self, config: LMConfig, rngs: nnx.Rngs):
        h, e, d = config.arch.num_heads, config.arch.hidden_size, config.arch.head_dim
        dtype = jnp.dtype(config.execution.compute_dtype)
        self.num_heads, self.head_dim = h, d
        self.rope_dim, self.value_dim = config.arch.qk_rope_head_dim, config.arch.v_head_dim
        self.nope_dim = d - config.arch.qk_rope_head_dim
        self.kv_lora_rank, self.interleave = config.arch.kv_lora_rank, config.arch.rope_interleave
        self.scale = d**-0.5 * yarn_softmax_mscale(config.arch.rope)
        if config.arch.q_lora_rank:
            self.q_a_proj = linear(e, config.arch.q_lora_rank, config.arch.qkv_bias, config, rngs)
            self.q_a_layernorm = RMSNorm(config.arch.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(config.arch.q_lora_rank, h * d, False, config, rngs)
        else:
            self.q_proj = linear(e, h * d, False, config, rngs)
        self.kv_a_proj_with_mqa = linear(e, config.arch.kv_lora_rank + self.rope_dim,
                                         config.arch.qkv_bias, config, rngs)
        self.kv_a_layernorm = RMSNorm(config.arch.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(config.arch.kv_lora_rank, h * (self.nope_dim + self.value_dim),
                                False, config, rngs)
        self.o_proj = linear(h * self.value_dim, e, config.arch.out_bias, config, rngs)

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return apply_rope(deinterleave(x) if self.interleave else x, cos, sin)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Of ``x [B, T, emb]``: queries ``[B, T, H, head_dim]`` (rotated part last), the normed
        latent ``[B, T, 1, kv_lora_rank]`` and the rotated shared key
        ``[B, T, 1, qk_rope_head_dim]`` (the two cached)."""
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        q = jnp.concatenate([q[..., :self.nope_dim],
                             self._rotate(q[..., self.nope_dim:], cos, sin)], axis=-1)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :self.kv_lora_rank])
        shared_key = self._rotate(compressed[..., None, self.kv_lora_rank:], cos, sin)
        return q, latent[:, :, None], shared_key

    def attend(self, q: jax.Array, latent: jax.Array, shared_key: jax.Array, mask: jax.Array,
               causal: bool = False) -> jax.Array:
        """``q [B, T, H, head_dim]`` over the keys and values expanded from ``latent
        [B, S, 1, kv_lora_rank]`` and ``shared_key [B, S, 1, qk_rope_head_dim]`` with bool
        ``mask`` broadcastable to ``[B, H, T, S]``: the output projection of the heads,
        ``[B, T, emb]``. (``causal`` is the grouped-query attention's cuDNN hint; this einsum
        form applies ``mask``.)"""
        del causal
        b, t, h, _ = q.shape
        s = latent.shape[1]
        kv = self.kv_b_proj(latent[:, :, 0].astype(q.dtype))
        kv = kv.reshape(b, s, h, self.nope_dim + self.value_dim)
        key_nope, values = kv[..., :self.nope_dim], kv[..., self.nope_dim:]
        shared = shared_key.astype(q.dtype)
        q = q * jnp.asarray(self.scale, q.dtype)
        logits = jnp.einsum("bthd,bshd->bhts", q[..., :self.nope_dim], key_nope,
                            preferred_element_type=jnp.float32)
        logits = logits + jnp.einsum("bthd,bsd->bhts", q[..., self.nope_dim:], shared[:, :, 0],
                                     preferred_element_type=jnp.float32)
        logits = jnp.where(mask, logits, MASK_VALUE)
        weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
        heads = jnp.einsum("bhts,bshd->bthd", weights, values)
        return self.o_proj(heads.reshape(b, t, h * self.value_dim))
