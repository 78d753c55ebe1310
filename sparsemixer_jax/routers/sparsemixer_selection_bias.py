"""SparseMixer under a selection bias (bias balancing) on softmax scores, top-1 or top-k:
``D_t ~ q^(t)``, the masked softmax of ``z + b``, gated by ``pi^(t)_{D_t}`` from the softmax of
``z`` alone, with the two-path backward (:data:`TWO_PATH_RULES`, derived in docs/routing.md).

What :func:`~sparsemixer_jax.routers.sparsemixer_route` runs with ``selection_bias`` under
softmax scores.
"""

from __future__ import annotations

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
    router_output,
    routing_keys,
    routing_mask,
    two_path_gate,
)


def sparsemixer_selection_bias_route(
    logits: jax.Array,
    key: jax.Array | None,
    selection_bias: jax.Array,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    mask: MaskRule = "reference",
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    invalid: jax.Array | None = None,
) -> RouterOutput:
    """SparseMixer with ``D_t ~ q^(t)`` (selection logits ``z + b``, the mask computed on them,
    the experts already chosen removed) and gates ``pi^(t)_{D_t}``, ``pi^(t)`` the softmax of
    ``z`` over the same experts. The backward goes along two paths
    (:func:`~sparsemixer_jax.routers.two_path_gate`): ``nabla_1`` along ``grad pi_D``,
    ``nabla_0`` along ``pi_D grad log q_D``, as :data:`TWO_PATH_RULES` splits each estimator.
    The coin's argmax is that of ``z + b`` (``argmax_of="logits"``) or the first of the largest
    float32 ``q^(t)`` (``"probs"``), as without a bias.

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32);
        ``-inf`` excludes an expert.
      key: PRNG key; required when ``training``.
      selection_bias: float ``[N]``, ``b``; it gets no gradient.
      top_k, jitter_eps, training, mask, estimator, midpoint_prob: as in
        :func:`~sparsemixer_jax.routers.sparsemixer_route`. There is no ``backward_scale``: the
        two paths set their own scales.
      invalid: bool ``[...]``, the tokens to give NaN ``probs`` and ``gate`` when the caller has
        checked the logits already; None checks them here (ValueError outside ``jit``).

    Returns:
      :class:`~sparsemixer_jax.routers.RouterOutput`: int32 ``expert`` and float32 ``gate``,
      ``[...]`` for ``top_k == 1`` and ``[..., top_k]`` otherwise; float32 ``probs`` ``[..., N]``,
      the first step's ``pi``. Evaluation takes the top-k of ``z + b`` with ``gate = pi_D``.
    """
    fn = "sparsemixer_selection_bias_route"
    check_sampling_args(fn, logits, key, top_k, jitter_eps, training, estimator, midpoint_prob,
                        None)
    check_selection_bias_shape(fn, logits, selection_bias)
    invalid = nan_tokens(fn, logits, top_k, invalid)
    reduced_prob = coin_probability(estimator, midpoint_prob)
    dtype = routing_dtype(logits)
    gate_logits = logits.astype(dtype)
    remaining = gate_logits + jax.lax.stop_gradient(selection_bias).astype(dtype)
    keys = routing_keys(key, top_k) if training else None
    experts, gates, first_probs = [], [], None
    for step in range(top_k):
        keep = routing_mask(remaining, jitter_eps, mask)
        selection = jnp.where(keep, remaining, -jnp.inf)
        log_q = jax.nn.log_softmax(selection, axis=-1)
        q = jnp.where(invalid[..., None], jnp.nan, jax.nn.softmax(selection, axis=-1))
        pi = jax.nn.softmax(jnp.where(keep, gate_logits, -jnp.inf), axis=-1)
        pi = jnp.where(invalid[..., None], jnp.nan, pi)
        first_probs = pi if first_probs is None else first_probs
        top = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        if not training:
            expert, gate = top, take_expert(pi, top)
        else:
            expert, gate = _two_path_step(pi, q, log_q, top, keys[step], estimator,
                                          reduced_prob)
        experts.append(expert)
        gates.append(gate)
        if step + 1 < top_k:  # later steps choose among the experts not yet chosen
            chosen = jax.nn.one_hot(expert, remaining.shape[-1], dtype=bool)
            remaining = jnp.where(chosen, -jnp.inf, remaining)
            gate_logits = jnp.where(chosen, -jnp.inf, gate_logits)
    return router_output(experts, gates, first_probs)


def _two_path_step(pi, q, log_q, top, keys, estimator, reduced_prob):
    """One draw ``D ~ q`` and its gate ``w pi_D`` with the two-path backward
    (:func:`two_path_gate`); ``top`` is the argmax of the selection logits, ``keys`` ``[2]``
    this step's sample and coin keys."""
    rule, two_path = ESTIMATORS[estimator], TWO_PATH_RULES[estimator]
    coin_top = top if rule.argmax_of == "logits" else jnp.argmax(q, axis=-1).astype(jnp.int32)
    sample_key, coin_key = keys[0], keys[1]
    # Drawn as the plain router draws (log of the probabilities): b = 0 samples alike.
    expert = jax.random.categorical(sample_key, jnp.log(jax.lax.stop_gradient(q)),
                                    axis=-1).astype(jnp.int32)
    coin_flipped, reduced = coin_branch(estimator, expert != coin_top, coin_key, reduced_prob)
    gate_scale, selection_scale = two_path_scales(two_path, reduced, coin_flipped, reduced_prob)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(pi.dtype)
    gate = two_path_gate(take_expert(pi, expert), take_expert(log_q, expert), forward_scale,
                         gate_scale, selection_scale)
    return expert, gate
