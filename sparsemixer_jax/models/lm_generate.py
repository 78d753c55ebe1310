"""Text generation with :class:`sparsemixer_jax.models.causal_lm.CausalLM`'s key/value cache:
greedy or sampled (temperature, top-k), one compiled prefill and one compiled step.

Longrope models (Phi-3.5-MoE) change their rotary scale once the sequence passes
``original_max_position_embeddings``; as transformers' ``generate`` does for them, the cache is
then recomputed once from the whole sequence, so every step's logits equal a full forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.layers.attention import KVCache
from sparsemixer_jax.models.causal_lm import CausalLM


@nnx.jit
def _extend(model: CausalLM, ids: jax.Array, mask: jax.Array, cache: KVCache
            ) -> tuple[jax.Array, KVCache]:
    """Feeds ``ids [B, T]`` (``mask``: real tokens) through the cache: the last position's
    logits ``[B, V]`` and the new cache."""
    out = model.forward(ids, token_mask=mask, cache=cache, deterministic=True)
    return out.logits[:, -1], out.cache


def _pick(logits: jax.Array, key: jax.Array | None, temperature: float, top_k: int | None
          ) -> jax.Array:
    """The next token ``[B]``: argmax when ``temperature == 0``, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *,
             prompt_mask: jax.Array | None = None, temperature: float = 0.0,
             top_k: int | None = None, key: jax.Array | None = None,
             eos_id: int | None = None) -> jax.Array:
    """Continues ``prompt`` int ``[B, P]`` by ``max_new_tokens`` tokens: int32 ``[B, P + N]``.

    Args:
      prompt_mask: bool ``[B, P]``, False for left padding (rows of different lengths are
        padded on the left; positions count real tokens only, as transformers counts them).
      temperature: 0 for greedy decoding, else sampling at this temperature (needs ``key``).
      top_k: sample among the ``top_k`` most likely tokens only.
      eos_id: once a row emits it, the row continues with ``eos_id``.

    Routing is deterministic (the router's evaluation rule) whatever the model's mode.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key")
    batch, length = prompt.shape
    total = length + max_new_tokens
    prompt = prompt.astype(jnp.int32)
    mask = jnp.ones((batch, length), bool) if prompt_mask is None else prompt_mask.astype(bool)
    rope = model.config.arch.rope
    switch = rope.original_max_position_embeddings if rope.kind == "longrope" else None
    tokens = jnp.concatenate([prompt, jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1)
    masks = jnp.concatenate([mask, jnp.ones((batch, max_new_tokens), bool)], axis=1)
    logits, cache = _extend(model, prompt, mask, model.init_cache(batch, total))
    done = jnp.zeros((batch,), bool)
    for step in range(max_new_tokens):
        if key is not None:
            key, sub = jax.random.split(key)
        else:
            sub = None
        token = _pick(logits, sub, temperature, top_k)
        if eos_id is not None:
            token = jnp.where(done, eos_id, token)
            done = done | (token == eos_id)
        cur = length + step
        tokens = tokens.at[:, cur].set(token)
        if step == max_new_tokens - 1:
            break
        if switch is not None and cur + 1 > switch >= int(cache.index):
            # Longrope's scale switches: recompute the cache from the whole sequence.
            logits, cache = _extend(model, tokens[:, :cur + 1], masks[:, :cur + 1],
                                    model.init_cache(batch, total))
        else:
            logits, cache = _extend(model, token[:, None], masks[:, cur:cur + 1], cache)
    return tokens
