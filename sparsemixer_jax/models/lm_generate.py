"""Text generation with :class:`sparsemixer_jax.models.causal_lm.CausalLM`'s key/value cache:
greedy or sampled (temperature, top-k, top-p), a compiled prefill and the decoding loop compiled
as one program (a ``lax.fori_loop`` over the new tokens, the cache in its carry), so a call
costs one dispatch per program, not one per token.

With ``return_routes``, the rollout records its routes as it is sampled: each MoE layer's
experts for every token fed through the model (the prompt in the prefill, each new token in the
step after its pick), ``[B, P + N, L, K]``, for routing replay in the update
(:meth:`~sparsemixer_jax.models.causal_lm.CausalLM.forward`'s ``routes``).

Longrope models (Phi-3.5-MoE) change their rotary scale once the sequence passes
``original_max_position_embeddings``; as transformers' ``generate`` does for them, the cache is
then recomputed once from the whole sequence, so every step's logits equal a full forward pass.
The step at which that happens is known before decoding starts, so the loop is compiled in two
parts around it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.layers.attention import KVCache
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_routes import num_moe_layers


@nnx.jit
def _extend(model: CausalLM, ids: jax.Array, mask: jax.Array, cache: KVCache
            ) -> tuple[jax.Array, KVCache, jax.Array]:
    """Feeds ``ids [B, T]`` (``mask``: real tokens) through the cache: the last position's
    logits ``[B, V]``, the new cache and the routes ``[B, T, L, K]`` (-1 on padding)."""
    out = model.forward(ids, token_mask=mask, cache=cache, deterministic=True)
    return out.logits[:, -1], out.cache, out.routes


def sampling_logits(logits: jax.Array, temperature: float, top_k: int | None,
                    top_p: float | None) -> jax.Array:
    """``logits [B, V]`` divided by ``temperature`` (> 0), then every token outside the
    ``top_k`` largest and outside the nucleus (the fewest most likely tokens whose probabilities
    reach ``top_p``; the most likely token always stays) set to ``-inf``; in that order, the
    order of transformers' ``generate``."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:  # a nucleus of 1 is every token (no cumulative
        # sum's rounding may drop the tail's)
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # A token stays while the mass of the tokens before it is below top_p: the first token
        # (mass 0 before it) always stays, and so does the one that crosses top_p.
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def _pick(logits: jax.Array, key: jax.Array | None, temperature: float, top_k: int | None,
          top_p: float | None) -> jax.Array:
    """The next token ``[B]``: argmax when ``temperature == 0``, else a draw from
    :func:`sampling_logits`."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = sampling_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("first", "stop", "offset", "temperature", "top_k",
                                             "top_p", "eos_id"))
def _decode(model: CausalLM, tokens: jax.Array, logits: jax.Array, cache: KVCache,
            done: jax.Array, key: jax.Array | None, routes: jax.Array | None, *, first: int,
            stop: int, offset: int, temperature: float, top_k: int | None,
            top_p: float | None, eos_id: int | None
            ) -> tuple[jax.Array, KVCache, jax.Array, jax.Array | None, jax.Array | None]:
    """Steps ``first .. stop - 1`` of decoding in one program: step ``s`` picks a token from
    ``logits`` (the previous position's) and writes it to ``tokens[:, offset + s]``; every step
    after the first feeds the previous token through ``cache`` first, and writes its routes to
    ``routes[:, offset + s - 1]`` where ``routes`` ``[B, P + N, L, K]`` is given. The last
    token is never fed (nothing reads its logits). Returns ``(tokens, cache, done, key,
    routes)``, the routes from each row's first new ``eos_id`` on set to -1."""
    graphdef, state = nnx.split(model)

    def write(step, logits, tokens, done, key):
        sub = None
        if key is not None:  # the key is split before every pick, as the first pick's is
            key, sub = jax.random.split(key)
        token = _pick(logits, sub, temperature, top_k, top_p)
        if eos_id is not None:
            token = jnp.where(done, eos_id, token)
            done = done | (token == eos_id)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, offset + step))
        return tokens, done, key, token

    def body(step, carry):
        # The model's state rides in the carry (unchanged): a model merged inside the loop from
        # state closed over from outside it could not be updated at the loop's trace level.
        state, tokens, cache, done, key, previous, routes = carry
        logits, cache, fed = _feed(graphdef, state, previous[:, None], cache)
        if routes is not None:
            routes = jax.lax.dynamic_update_slice(routes, fed, (0, offset + step - 1, 0, 0))
        tokens, done, key, token = write(step, logits, tokens, done, key)
        return state, tokens, cache, done, key, token, routes

    tokens, done, key, token = write(first, logits, tokens, done, key)
    _, tokens, cache, done, key, _, routes = jax.lax.fori_loop(
        first + 1, stop, body, (state, tokens, cache, done, key, token, routes))
    if routes is not None and eos_id is not None:
        # No routes from a row's first new eos on: the rollout ends there.
        ended = jnp.cumsum(tokens[:, offset:] == eos_id, axis=1) > 0
        ended = jnp.pad(ended, ((0, 0), (offset, 0)))
        routes = jnp.where(ended[:, :, None, None], -1, routes)
    return tokens, cache, done, key, routes


def _feed(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, cache: KVCache
          ) -> tuple[jax.Array, KVCache, jax.Array]:
    """One token a row ``ids [B, 1]`` through ``cache`` (inside the traced loop, where the
    model is its split graph and state): its logits ``[B, V]``, the cache and its routes
    ``[B, 1, L, K]``."""
    mask = jnp.ones(ids.shape, bool)
    out = nnx.merge(graphdef, state).forward(ids, token_mask=mask, cache=cache,
                                             deterministic=True)
    return out.logits[:, -1], out.cache, out.routes


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                    key: jax.Array | None) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generate(model: CausalLM, prompt: jax.Array, max_new_tokens: int, *,
             prompt_mask: jax.Array | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             key: jax.Array | None = None, eos_id: int | None = None,
             return_routes: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Continues ``prompt`` int ``[B, P]`` by ``max_new_tokens`` tokens: int32 ``[B, P + N]``.

    Args:
      prompt_mask: bool ``[B, P]``, False for left padding (rows of different lengths are
        padded on the left; positions count real tokens only, as transformers counts them).
      temperature: 0 for greedy decoding, else sampling at this temperature (needs ``key``).
      top_k: sample among the ``top_k`` most likely tokens only.
      top_p: sample within the nucleus: the fewest most likely tokens whose probabilities sum
        to at least ``top_p`` (after ``top_k``).
      eos_id: once a row emits it, the row continues with ``eos_id``.
      return_routes: also return the routes of the rollout, int32 ``[B, P + N, L, K]`` (``L``
        MoE layers, ``K`` experts per token): the experts each position's token was routed to
        when it was fed through the model, ``-1`` in whole rows where no token was computed
        (left padding, the last position, never fed) and from a row's first new ``eos_id``
        on. Replayed by ``model.forward(tokens, routes=routes)``.

    Returns the tokens, or ``(tokens, routes)`` with ``return_routes``.
    Routing is deterministic (the router's evaluation rule) whatever the model's mode.
    """
    _check_sampling(temperature, top_k, top_p, key)
    batch, length = prompt.shape
    total = length + max_new_tokens
    prompt = prompt.astype(jnp.int32)
    mask = jnp.ones((batch, length), bool) if prompt_mask is None else prompt_mask.astype(bool)
    tokens = jnp.concatenate([prompt, jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1)
    if max_new_tokens == 0:
        config = model.config  # nothing is fed: no routes
        return (tokens, jnp.full((batch, length, num_moe_layers(config), config.top_k), -1,
                                 jnp.int32)) if return_routes else tokens
    logits, cache, routes = _extend(model, prompt, mask, model.init_cache(batch, total))
    # The new positions' rows are -1 until their token is fed.
    routes = jnp.pad(routes, ((0, 0), (0, max_new_tokens), (0, 0), (0, 0)),
                     constant_values=-1) if return_routes else None
    done = jnp.zeros((batch,), bool)
    options = dict(offset=length, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_id=eos_id)
    rope = model.config.arch.rope
    # The step that writes the token at the longrope switch position; the cache is recomputed
    # from the whole sequence before the next step, when a next step exists.
    switch_step = rope.original_max_position_embeddings - length \
        if rope.kind == "longrope" else -1
    if 0 <= switch_step < max_new_tokens - 1:
        tokens, _, done, key, routes = _decode(model, tokens, logits, cache, done, key, routes,
                                               first=0, stop=switch_step + 1, **options)
        seen = length + switch_step + 1
        masks = jnp.concatenate([mask, jnp.ones((batch, max_new_tokens), bool)], axis=1)
        logits, cache, seen_routes = _extend(model, tokens[:, :seen], masks[:, :seen],
                                             model.init_cache(batch, total))
        if return_routes:  # the cache now holds what this pass computed: its routes are theirs
            routes = routes.at[:, :seen].set(seen_routes)
        tokens, _, _, _, routes = _decode(model, tokens, logits, cache, done, key, routes,
                                          first=switch_step + 1, stop=max_new_tokens, **options)
    else:
        tokens, _, _, _, routes = _decode(model, tokens, logits, cache, done, key, routes,
                                          first=0, stop=max_new_tokens, **options)
    return (tokens, routes) if return_routes else tokens
