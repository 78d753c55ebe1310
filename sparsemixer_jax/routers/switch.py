"""Switch Transformer routing (Fedus et al., 2021), top-1 or top-k: the deterministic-argmax
forward that Switch, DenseMixer and Default MoE share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import (
    RouterOutput,
    check_finite_logits,
    check_route_args,
    routing_dtype,
    take_expert,
)


def switch_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    jitter: bool = True,
    normalize_top_k: bool = False,
) -> RouterOutput:
    """Switch Transformer routing, as the reference baseline (``switchgate.py``), top-1 or top-k.

    With ``jitter`` (Switch's default), in training the logits are multiplied by
    ``u ~ U(1 - jitter_eps, 1 + jitter_eps)`` per element. ``probs`` is the softmax of the
    (jittered) logits, ``expert`` its argmax (its ``top_k`` largest, in decreasing order) and
    ``gate`` its value there. The gradient is plain backpropagation through the gate: the
    routing term ``nabla_0`` is dropped, as in ordinary MoE training.

    Args:
      logits: ``[..., N]``, any float dtype; ``-inf`` excludes an expert, NaN/+inf as in
        :func:`sparsemixer_jax.routers.sparsemixer_route`.
      key: PRNG key for the jitter; required when ``training``, ``jitter`` and
        ``jitter_eps > 0``.
      top_k: experts per token, ``1 <= top_k <= N``.
      jitter_eps: Python float ``>= 0``; training: Python bool.
      jitter: whether training multiplies the logits by the jitter. DenseMixer's and Default
        MoE's released code route without it.
      normalize_top_k: divide the ``k`` gates by their sum, ``gate_t = pi_{D_t} / S`` with
        ``S = sum_t pi_{D_t}`` (differentiated through ``S`` too), as Mixtral, and Qwen and
        DeepSeek models with ``norm_topk_prob``, route. Off: the gates are the softmax values
        themselves (Switch, GRIN's top-2). With ``top_k = 1`` every gate is 1.

    Returns:
      :class:`RouterOutput` with int32 ``expert`` and float32 ``gate`` of shape ``[...]``
      (``top_k == 1``) or ``[..., top_k]``, and ``probs`` ``[..., N]`` (never renormalised:
      the load-balancing loss reads it).
    """
    fn = "switch_route"
    check_route_args(fn, logits, top_k, jitter_eps, training)
    invalid = check_finite_logits(fn, logits, top_k)
    logits = logits.astype(routing_dtype(logits))
    if training and jitter and jitter_eps > 0:
        if key is None:
            raise ValueError("switch_route needs a PRNG key when training with jitter_eps > 0")
        noise = jax.random.uniform(
            key, logits.shape, logits.dtype, minval=1.0 - jitter_eps, maxval=1.0 + jitter_eps
        )
        logits = logits * noise
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(invalid[..., None], jnp.nan, probs)
    if top_k == 1:
        expert = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        gate = take_expert(probs, expert)
        if normalize_top_k:
            gate = gate / gate
        return RouterOutput(expert=expert, gate=gate, probs=probs)
    gate, expert = jax.lax.top_k(probs, top_k)
    if normalize_top_k:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    return RouterOutput(expert=expert.astype(jnp.int32), gate=gate, probs=probs)
