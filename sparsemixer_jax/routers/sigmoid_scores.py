"""SparseMixer under sigmoid scores (DeepSeek-V3's router): the sampling distribution, the gates
and the two-path backward over the whole chosen set (derived in docs/routing.md).

The deterministic type selects ``S = TopK(s + b)``, ``s = sigmoid(z)``, and gates the chosen
experts with ``c s_D / sum_{u in S} s_u``. SparseMixer samples instead: expert ``t`` from

    q^(t)_i = x_i / sum_{j in M_t} x_j  on  M_t,   x = s + b,

``M_t`` the experts left after the first ``t`` whose selection score ``x`` is positive and
passes the router's mask (:func:`~sparsemixer_jax.routers.routing_mask`, computed on ``x``),
the largest ``x`` always kept. With ``b = 0`` this is the normalised score ``s / sum s`` the
balance loss reads, restricted to the mask, and the gates are ``c`` times it renormalised over
``S``. Its top-k in order is ``TopK(s + b)``, the evaluation forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import RouterOutput, routing_dtype, take_expert
from sparsemixer_jax.routers.estimators import (
    ESTIMATORS,
    TWO_PATH_RULES,
    Estimator,
    two_path_scales,
)
from sparsemixer_jax.routers.sampling import (
    MaskRule,
    check_sampling_args,
    check_selection_bias_shape,
    coin_branch,
    coin_probability,
    nan_tokens,
    routing_keys,
    routing_mask,
    two_path_gate,
)
from sparsemixer_jax.routers.selection import selection_scores


def sigmoid_sample_probs(
    logits: jax.Array, selection_bias: jax.Array | None = None, jitter_eps: float = 0.1,
    mask: MaskRule = "reference",
) -> jax.Array:
    """The sampling distribution ``q`` ``[..., N]`` under sigmoid scores (module docstring):
    ``q_i`` proportional to ``x_i = sigmoid(z_i) + b_i`` over the experts with ``x_i > 0``
    that the mask (computed on ``x``) keeps. The largest ``x`` is always kept; where it is not
    positive (no expert has a positive score) ``q`` puts all its mass on it. ``-inf`` logits
    are excluded. Differentiable in ``logits`` with the eligible set held fixed."""
    x = selection_scores(logits, selection_bias, "sigmoid")
    fixed = jax.lax.stop_gradient(x)
    keep = routing_mask(fixed, jitter_eps, mask) & ~jnp.isneginf(fixed)
    is_top = jax.nn.one_hot(jnp.argmax(fixed, axis=-1), x.shape[-1], dtype=bool)
    positive = fixed > 0
    weights = jnp.where(keep & positive, x, 0.0)
    weights = jnp.where(is_top & ~positive, 1.0, weights)
    return weights / jnp.sum(weights, axis=-1, keepdims=True)


def renormalised_gates(logits: jax.Array, experts: jax.Array, scale: float) -> jax.Array:
    """``scale * s_{D_t} / sum_u s_{D_u}`` ``[..., k]`` for ``experts`` int ``[..., k]``,
    ``s = sigmoid(logits)``: DeepSeek-V3's gates, differentiable in ``logits``."""
    chosen = jnp.take_along_axis(jax.nn.sigmoid(logits), experts, axis=-1)
    return scale * chosen / jnp.sum(chosen, axis=-1, keepdims=True)


def sparsemixer_sigmoid_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    selection_bias: jax.Array | None = None,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    mask: MaskRule = "reference",
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    routed_scaling_factor: float = 1.0,
    invalid: jax.Array | None = None,
) -> RouterOutput:
    """SparseMixer under sigmoid scores (the module docstring gives the distribution).

    Training draws ``D_t ~ q^(t)`` for ``t < k``; one coin per token chooses the branch, and
    the set's gates go through :func:`~sparsemixer_jax.routers.two_path_gate`: ``a c_t`` along
    ``grad G_t`` and ``b sum_u G_u c_u`` along ``grad log P(D) = sum_t grad log q^(t)_{D_t}``
    (``c_t`` gate ``t``'s cotangent, ``(a, b)`` the branch's pair from
    :data:`TWO_PATH_RULES`). The coin is flipped unless the drawn set is ``TopK(s + b)``.
    Evaluation takes ``TopK(s + b)``.

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32);
        ``-inf`` excludes an expert.
      key: PRNG key; required when ``training``.
      selection_bias: float ``[N]`` added to the scores for the selection only, or None.
      top_k, jitter_eps, training, mask, estimator, midpoint_prob, routed_scaling_factor: as in
        :func:`~sparsemixer_jax.routers.sparsemixer_route` with ``score="sigmoid"``. There is
        no ``backward_scale``: the two paths set their own scales.
      invalid: bool ``[...]``, the tokens to give NaN ``probs`` and ``gate`` when the caller has
        checked the logits already; None checks them here (ValueError outside ``jit``).

    Returns:
      :class:`~sparsemixer_jax.routers.RouterOutput`: int32 ``expert`` and float32 ``gate``
      (``routed_scaling_factor * s_{D_t} / sum_u s_{D_u}``), ``[...]`` for ``top_k == 1`` and
      ``[..., top_k]`` otherwise; float32 ``probs`` ``[..., N]`` (``s / sum s``) and
      ``scores`` ``[..., N]`` (``s = sigmoid(z)``).
    """
    fn = "sparsemixer_sigmoid_route"
    check_sampling_args(fn, logits, key, top_k, jitter_eps, training, estimator, midpoint_prob,
                        None)
    check_scaling_factor(fn, routed_scaling_factor)
    if selection_bias is not None:
        check_selection_bias_shape(fn, logits, selection_bias)
    invalid = nan_tokens(fn, logits, top_k, invalid)
    reduced_prob = coin_probability(estimator, midpoint_prob)
    logits = logits.astype(routing_dtype(logits))
    scores = jax.nn.sigmoid(logits)
    probs = jnp.where(invalid[..., None], jnp.nan,
                      scores / jnp.sum(scores, axis=-1, keepdims=True))
    selection = jax.lax.stop_gradient(selection_scores(logits, selection_bias, "sigmoid"))
    _, top_set = jax.lax.top_k(selection, top_k)
    top_set = top_set.astype(jnp.int32)
    if not training:
        gates = jnp.where(invalid[..., None], jnp.nan,
                          renormalised_gates(logits, top_set, routed_scaling_factor))
        return _output(top_set, gates, probs, scores, top_k)
    keys = routing_keys(key, top_k)
    experts, log_prob = _draw_set(logits, selection_bias, invalid, keys, jitter_eps, mask)
    on_top = jnp.all(jnp.any(experts[..., :, None] == top_set[..., None, :], axis=-1), axis=-1)
    forward_scale, gate_scale, selection_scale = _branch_scales(
        estimator, on_top, keys[0][1], reduced_prob, scores.dtype)
    gates = renormalised_gates(logits, experts, routed_scaling_factor)
    gates = jnp.where(invalid[..., None], jnp.nan, gates)

    def per_gate(value):  # one value per token, the same for each of its k gates
        return jnp.broadcast_to(value[..., None], gates.shape)

    # The log-probability of the set is broadcast to the k gates: its cotangent is the sum of
    # their selection-path shares, b * sum_u G_u c_u.
    gates = two_path_gate(gates, per_gate(log_prob), per_gate(forward_scale),
                          per_gate(gate_scale), per_gate(selection_scale))
    return _output(experts, gates, probs, scores, top_k)


def _branch_scales(estimator, on_top, coin_key, reduced_prob, dtype):
    """``(forward_scale, gate_scale, selection_scale)`` per token ``[...]`` for the set's
    branch: one coin per token, flipped unless the drawn set ``on_top`` is ``TopK(s + b)``."""
    rule, two_path = ESTIMATORS[estimator], TWO_PATH_RULES[estimator]
    flipped, reduced = coin_branch(estimator, ~on_top, coin_key, reduced_prob)
    gate_scale, selection_scale = two_path_scales(two_path, reduced, flipped, reduced_prob)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(dtype)
    return forward_scale, gate_scale, selection_scale


def _draw_set(logits, selection_bias, invalid, keys, jitter_eps, mask):
    """The drawn experts int32 ``[..., k]`` (``D_t ~ q^(t)``, one step per row of ``keys``
    ``[k, 2]``) and ``log P(D)`` ``[...]``, differentiable in ``logits``."""
    remaining, experts, log_prob = logits, [], 0.0
    for step in range(keys.shape[0]):
        q = sigmoid_sample_probs(remaining, selection_bias, jitter_eps, mask)
        draw_from = jnp.where(invalid[..., None], 0.0, jnp.log(jax.lax.stop_gradient(q)))
        expert = jax.random.categorical(keys[step][0], draw_from, axis=-1).astype(jnp.int32)
        experts.append(expert)
        log_prob = log_prob + jnp.log(take_expert(q, expert))
        chosen = jax.nn.one_hot(expert, logits.shape[-1], dtype=bool)
        remaining = jnp.where(chosen, -jnp.inf, remaining)
    return jnp.stack(experts, axis=-1), log_prob


def _output(experts, gates, probs, scores, top_k) -> RouterOutput:
    if top_k == 1:
        experts, gates = experts[..., 0], gates[..., 0]
    return RouterOutput(expert=experts, gate=gates, probs=probs, scores=scores)


def check_scaling_factor(fn: str, routed_scaling_factor) -> None:
    """ValueError in one line unless ``routed_scaling_factor`` is a finite number ``> 0``."""
    if isinstance(routed_scaling_factor, bool) or not (
            isinstance(routed_scaling_factor, (int, float))
            and math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"{fn}: routed_scaling_factor must be a finite number > 0, got "
                         f"{routed_scaling_factor!r}")
