"""How many experts SparseMixer's mask leaves eligible at initialisation, our router init against
the reference's.

The router sees a post-LayerNorm activation (zero mean, unit variance over its ``d`` features,
as in both our model and the reference's fairseq post-norm layers). Two router inits:

* ours: ``nnx.Linear`` defaults, kernel ``lecun_normal`` (std ``1/sqrt(d)``), zero bias;
* the reference's: PyTorch ``nn.Linear`` defaults (what ``gating_network`` in
  microsoft/SparseMixer's ``transformer_switch_layer.py`` gets), kernel and bias both
  ``U(-1/sqrt(d), 1/sqrt(d))``.

Random Gaussian activations stand in for real ones, so this describes the start of training
only; the training logs (``eligible_fraction`` in ``metrics.jsonl``) describe the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax import routers


def _layer_norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)


def router_logits(key: jax.Array, tokens: int, d: int, n: int, init: str) -> jax.Array:
    """``[tokens, n]`` logits of a freshly initialised router on LayerNorm'd Gaussian inputs."""
    kx, kw, kb = jax.random.split(key, 3)
    x = _layer_norm(jax.random.normal(kx, (tokens, d)))
    bound = 1.0 / d**0.5
    if init == "ours":
        w, b = jax.random.normal(kw, (d, n)) * bound, jnp.zeros(n)
    elif init == "reference":
        w = jax.random.uniform(kw, (d, n), minval=-bound, maxval=bound)
        b = jax.random.uniform(kb, (n,), minval=-bound, maxval=bound)
    else:
        raise ValueError(f"init must be 'ours' or 'reference', got {init!r}")
    return x @ w + b


def eligibility(logits: jax.Array, jitter_eps: float) -> tuple[float, float]:
    """(share of tokens with one eligible expert, mean number eligible), reference mask."""
    counts = jnp.sum(routers.routing_mask(logits, jitter_eps, "reference"), axis=-1)
    return float(jnp.mean(counts == 1)), float(jnp.mean(counts))
