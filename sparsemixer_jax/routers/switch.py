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
from sparsemixer_jax.routers.selection import limit_to_groups


def switch_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    jitter: bool = True,
    normalize_top_k: bool = False,
    score: str = "softmax",
    routed_scaling_factor: float = 1.0,
    selection_bias: jax.Array | None = None,
    num_groups: int = 1,
    top_groups: int = 1,
    group_score: str = "max",
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
      score: ``"softmax"``, or ``"sigmoid"`` (DeepSeek-V3): experts are selected on the
        sigmoid scores ``s = sigmoid(logits)`` and the gates are
        ``routed_scaling_factor * s_{D_t} / sum_t s_{D_t}`` (always renormalised).
      selection_bias: float ``[N]`` added to the selection scores only (the logits under
        softmax, the sigmoid scores under sigmoid); the gates never see it and it gets no
        gradient. None: no bias.
      num_groups, top_groups, group_score: group-limited selection
        (:func:`sparsemixer_jax.routers.selection.limit_to_groups`), on the biased scores.

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
    if score == "sigmoid" or selection_bias is not None or num_groups > 1:
        return _select_and_gate(logits, invalid, top_k, normalize_top_k, score,
                                routed_scaling_factor, selection_bias,
                                (num_groups, top_groups, group_score))
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


def _select_and_gate(logits, invalid, top_k, normalize_top_k, score, routed_scaling_factor,
                     selection_bias, groups) -> RouterOutput:
    """Switch routing with a selection that differs from the gates' scores: by sigmoid scores,
    with a bias, or within groups. The selection is held constant (no gradient); the gates are
    the scores (softmax probabilities or renormalised sigmoid scores) at the chosen experts."""
    if score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        scores = jnp.where(invalid[..., None], jnp.nan, scores)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        selection, gates_of, renormalise = scores, scores, True
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        probs = jnp.where(invalid[..., None], jnp.nan, probs)
        scores = None
        # Without a bias the probabilities are selected on, as the plain router does (float32
        # ties in probability go to the first index); with one, the logits plus the bias.
        selection, gates_of, renormalise = (
            probs if selection_bias is None else logits), probs, normalize_top_k
    selection = jax.lax.stop_gradient(selection)
    if selection_bias is not None:
        selection = selection + jax.lax.stop_gradient(selection_bias).astype(selection.dtype)
    selection = limit_to_groups(selection, *groups)
    _, expert = jax.lax.top_k(selection, top_k)
    expert = expert.astype(jnp.int32)
    gate = jnp.take_along_axis(gates_of, expert, axis=-1)
    if renormalise:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    if score == "sigmoid":
        gate = gate * routed_scaling_factor
    if top_k == 1:
        expert, gate = expert[..., 0], gate[..., 0]
    return RouterOutput(expert=expert, gate=gate, probs=probs, scores=scores)
