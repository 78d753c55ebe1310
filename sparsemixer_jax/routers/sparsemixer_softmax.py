"""SparseMixer on the masked softmax of the logits, top-1 or top-k: ``D_t ~ pi^(t)`` and one
gate per step whose backward scales the gate's cotangent (the paper's SparseMixer, its -1st and
-2nd variants, GRIN's SparseMixer-v2 and the corrected v2*, all by :data:`ESTIMATORS`).

What :func:`~sparsemixer_jax.routers.sparsemixer_route` runs without a selection bias under
softmax scores; its docstring gives each estimator's expected gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import RouterOutput, routing_dtype, take_expert
from sparsemixer_jax.routers.estimators import ESTIMATORS, Estimator, EstimatorRule
from sparsemixer_jax.routers.sampling import (
    MaskRule,
    check_sampling_args,
    chosen_prob,
    coin_branch,
    coin_probability,
    fill_masked,
    nan_tokens,
    router_output,
    router_probs,
    routing_keys,
    scaled_gate,
)


def sparsemixer_softmax_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    mask: MaskRule = "reference",
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    backward_scale: float | None = None,
    invalid: jax.Array | None = None,
) -> RouterOutput:
    """SparseMixer on the softmax of the logits: ``D_t ~ pi^(t)``, the masked softmax of the
    logits with the experts already chosen removed, gated by ``w pi_{D_t}`` whose backward sends
    ``backward_scale`` times the gate's cotangent to ``pi_{D_t}`` (:func:`scaled_gate`).

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32);
        ``-inf`` excludes an expert.
      key: PRNG key; required when ``training``. Step ``t`` draws from its own pair of keys
        (:func:`~sparsemixer_jax.routers.routing_keys`).
      top_k, jitter_eps, training, mask, estimator, midpoint_prob, backward_scale: as in
        :func:`~sparsemixer_jax.routers.sparsemixer_route`, which documents each estimator.
      invalid: bool ``[...]``, the tokens to give NaN ``probs`` and ``gate`` when the caller has
        checked the logits already; None checks them here (NaN, +inf or fewer than ``top_k``
        experts above ``-inf`` raise a ValueError outside ``jit``).

    Returns:
      :class:`~sparsemixer_jax.routers.RouterOutput`: int32 ``expert`` and float32 ``gate``,
      ``[...]`` for ``top_k == 1`` and ``[..., top_k]`` otherwise; float32 ``probs`` ``[..., N]``,
      the first step's ``pi``. Evaluation takes the top-k of the logits with ``gate = pi_D``.
    """
    fn = "sparsemixer_softmax_route"
    check_sampling_args(fn, logits, key, top_k, jitter_eps, training, estimator, midpoint_prob,
                        backward_scale)
    invalid = nan_tokens(fn, logits, top_k, invalid)
    rule = ESTIMATORS[estimator]
    reduced_prob = coin_probability(estimator, midpoint_prob)
    scale = rule.backward_scale if backward_scale is None else float(backward_scale)
    remaining = logits.astype(routing_dtype(logits))
    keys = routing_keys(key, top_k) if training else None
    experts, gates, first_probs = [], [], None
    for step in range(top_k):
        probs = router_probs(remaining, jitter_eps, mask)
        probs = jnp.where(invalid[..., None], jnp.nan, probs)
        first_probs = probs if first_probs is None else first_probs
        # Ties in probability (logits closer than float32's softmax resolves) go to the larger
        # logit at inference, as in both references, which take the argmax of the logits.
        top = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        if training:
            # The coin's argmax: phimoe's v2 takes it of the probabilities (first of a tie).
            coin_top = top if rule.argmax_of == "logits" else jnp.argmax(
                probs, axis=-1).astype(jnp.int32)
            expert, gate = _sample_step(probs, coin_top, keys[step], estimator, rule,
                                        reduced_prob, scale)
        else:
            expert, gate = top, take_expert(probs, top)
        experts.append(expert)
        gates.append(gate)
        if step + 1 < top_k:  # later steps choose among the experts not yet chosen
            chosen = jax.nn.one_hot(expert, remaining.shape[-1], dtype=bool)
            remaining = fill_masked(remaining, ~chosen)
    return router_output(experts, gates, first_probs)


def _sample_step(probs, top, keys, estimator, rule: EstimatorRule, reduced_prob, scale):
    """One draw ``D ~ probs`` and its gate ``w pi_D`` with the estimator's backward; ``keys``
    ``[2]`` are this step's sample and coin keys."""
    sample_key, coin_key = keys[0], keys[1]
    # Gumbel-max over the masked logits; log(probs) differs from them by a constant per token.
    masked_logits = jnp.log(jax.lax.stop_gradient(probs))
    expert = jax.random.categorical(sample_key, masked_logits, axis=-1).astype(jnp.int32)
    _, reduced = coin_branch(estimator, expert != top, coin_key, reduced_prob)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(probs.dtype)
    return expert, scaled_gate(chosen_prob(probs, expert), forward_scale, scale)
