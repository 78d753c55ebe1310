"""The language model's token loss with a backward pass of its own.

``-log_softmax(logits)[target]`` differentiated by JAX keeps the float32 log-probabilities of
every position and vocabulary entry (``[B, T, V]``: 2 GiB for 4 x 4096 tokens of a 32,768
vocabulary), transposes the target lookup into a scatter over a zero-filled copy of them, and
pads the gradient of ``logits[:, :-1]`` back to ``[B, T, V]``: six passes over that size.
:func:`token_nll` keeps only the logits (in their own dtype) and each position's
log-normaliser: its forward pass reads the logits once, its backward pass reads them once and
writes their cotangent ``softmax - one_hot(target)`` once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 ``logsumexp(logits) - logits[target]`` per position: ``logits [..., V]`` (any
    float dtype, computed in float32), int ``targets [...]`` in ``[0, V)``. Returns
    ``[...]``."""
    return _nll_and_normaliser(logits, targets)[0]


def _nll_and_normaliser(logits, targets):
    x = logits.astype(jnp.float32)
    normaliser = jax.nn.logsumexp(x, axis=-1)
    picked = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return normaliser - picked, normaliser


def _token_nll_fwd(logits, targets):
    nll, normaliser = _nll_and_normaliser(logits, targets)
    return nll, (logits, targets, normaliser)


def _token_nll_bwd(residuals, cotangent):
    logits, targets, normaliser = residuals
    probs = jnp.exp(logits.astype(jnp.float32) - normaliser[..., None])
    hit = jnp.arange(logits.shape[-1]) == targets[..., None]
    grad = cotangent[..., None] * (probs - hit.astype(jnp.float32))
    return grad.astype(logits.dtype), None


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)
