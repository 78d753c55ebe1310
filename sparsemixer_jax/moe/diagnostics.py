"""Router diagnostics: why a router trains (or does not), from what the router already computed.

Pure functions of the router logits ``z [..., N]``, the router's
:class:`~sparsemixer_jax.routers.RouterOutput` (chosen expert, gate, probabilities) and the padding
mask. :class:`~sparsemixer_jax.moe.MoEFeedForward` merges :func:`router_diagnostics` into its
per-layer metrics, so every run logs them per MoE layer at ``log_every`` (``metrics.jsonl``, key
``moe``) and ``python -m experiments.plot --diagnostics`` draws them.

What they answer ("does SparseMixer train faster than Switch?", docs/science.md):

* ``eligible_fraction [N]``: share of tokens with exactly 1, 2, ..., N experts of nonzero
  probability. Under SparseMixer's mask a token with one eligible expert has ``pi_D = 1``: its
  gate is constant, so it gives the router no gradient at all (not even the balance loss's, which
  uses the same masked probabilities). ``eligible_fraction[0]`` is the share of such tokens.
* ``ref_mask_eligible``: mean number of experts the reference mask (``jitter_eps``, rule
  ``"reference"``) would leave on the selection scores, whatever the router; for Switch it says
  what SparseMixer's mask would make of Switch's logits. The selection scores are what experts
  are chosen on: the logits ``z``, plus the selection bias ``b`` under bias balancing (``z + b``,
  on which SparseMixer's own mask is computed), and ``sigmoid(z) + b`` under sigmoid scores.
* ``max_logit``, ``logit_mean``, ``logit_std``: the logits' scale (mean over tokens of the max,
  the mean over experts and the std over experts). ``logit_mean`` is the common shift that the
  softmax ignores but the relative mask does not (docs/science.md).
* ``load_max``, ``load_min``: largest and smallest share of tokens routed to one expert (of
  rows, for top-k: each of a token's ``k`` rows counts ``1/k``).
* ``non_argmax_share``: share of tokens whose (first) expert is not the argmax of the
  selection scores: sampling (SparseMixer) or jitter (Switch) at work. Zero at evaluation.

All are float32, means over the non-padding tokens of the call.

After training, what changed (:func:`routing_sums`, read at each evaluation by
:mod:`sparsemixer_jax.training.routing_watch`): per layer, the share of tokens whose chosen
set of experts differs from the starting model's on the same validation tokens (churn), and the
share of tokens each expert takes, whose largest value and normalised entropy tell a collapsing
router. The training loop averages
metrics over micro-batches weighted by tokens, so ``load_max`` is the mean of per-micro-batch
maxima, which can exceed the max of the update's mean ``expert_fraction``.

Not here: the norm of the router gradient from each term. With the reference's
``backward_scale = 2`` the realised per-token gradient of SparseMixer is exactly twice the plain
gate gradient of the sampled output, half of it ``nabla_1`` and half the estimate of
``nabla_0``; their norms are equal by construction, so that split says nothing. The informative
split (task loss through the gate vs. the balance loss) needs separate backward passes of the
whole model, which the forward pass of a layer cannot provide; see docs/science.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax import routers


def _token_mean(values: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Mean of ``values`` ``[...]`` or ``[..., K]`` over the token axes ``[...]`` of the bool
    ``token_mask``, padding (False) left out: a scalar or ``[K]``."""
    weights = token_mask.astype(jnp.float32)
    weights = weights.reshape(weights.shape + (1,) * (values.ndim - weights.ndim))
    token_axes = tuple(range(token_mask.ndim))
    return jnp.sum(values * weights, axis=token_axes) / jnp.maximum(jnp.sum(weights), 1.0)


def _all_tokens(logits: jax.Array, token_mask: jax.Array | None) -> jax.Array:
    return jnp.ones(logits.shape[:-1], bool) if token_mask is None else token_mask


def eligible_counts(probs: jax.Array) -> jax.Array:
    """Number of experts with nonzero probability per token: int32 ``[...]`` from ``[..., N]``.

    A masked expert has probability exactly 0. An eligible one could underflow to 0 only if its
    logit lay about 100 below the max in float32 (``exp(-104)``), far outside what routers reach.
    """
    return jnp.sum(probs > 0, axis=-1).astype(jnp.int32)


def eligible_fraction(probs: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    """Share of tokens with exactly ``k + 1`` eligible experts: float32 ``[N]``, sums to 1."""
    num_experts = probs.shape[-1]
    one_hot = jax.nn.one_hot(eligible_counts(probs) - 1, num_experts, dtype=jnp.float32)
    return _token_mean(one_hot, _all_tokens(probs, token_mask))


def router_diagnostics(
    logits: jax.Array,
    routed: routers.RouterOutput,
    token_mask: jax.Array | None = None,
    *,
    jitter_eps: float = 0.1,
    selection_bias: jax.Array | None = None,
    score: str = "softmax",
) -> dict[str, jax.Array]:
    """The per-layer diagnostics of the module docstring.

    Args:
      logits: router logits ``z`` ``[..., N]`` (before any jitter), any float dtype.
      routed: the router's output for these logits.
      token_mask: bool ``[...]``, False on padding (left out), or None.
      jitter_eps: the router's ``jitter_eps``, for ``ref_mask_eligible``.
      selection_bias: float ``[N]``, bias balancing's selection-only bias, or None.
      score: the router's ``score``: ``"softmax"`` selects on ``z (+ b)``, ``"sigmoid"`` on
        ``sigmoid(z) (+ b)``.

    Returns: dict of float32 arrays, scalars except ``eligible_fraction`` ``[N]``.
    """
    z = jax.lax.stop_gradient(logits).astype(jnp.float32)
    probs = jax.lax.stop_gradient(routed.probs)
    num_experts = z.shape[-1]
    token_mask = _all_tokens(z, token_mask)
    rows = jax.nn.one_hot(routed.expert, num_experts, dtype=jnp.float32)
    top_k = routed.expert.ndim == z.ndim  # expert [..., k]: a token's k rows share its weight
    load = _token_mean(jnp.mean(rows, axis=-2) if top_k else rows, token_mask)
    first = routed.expert[..., 0] if top_k else routed.expert
    selection = routers.selection_scores(z, selection_bias, score)
    ref_mask = routers.routing_mask(selection, jitter_eps, "reference")
    argmax = jnp.argmax(selection, axis=-1)
    return {
        "max_logit": _token_mean(jnp.max(z, axis=-1), token_mask),
        "logit_mean": _token_mean(jnp.mean(z, axis=-1), token_mask),
        "logit_std": _token_mean(jnp.std(z, axis=-1), token_mask),
        "eligible_fraction": eligible_fraction(probs, token_mask),
        "ref_mask_eligible": _token_mean(jnp.sum(ref_mask, axis=-1).astype(jnp.float32),
                                         token_mask),
        "load_max": jnp.max(load),
        "load_min": jnp.min(load),
        "non_argmax_share": _token_mean((first != argmax).astype(jnp.float32),
                                        token_mask),
    }


def routing_sums(start: jax.Array, now: jax.Array, token_mask: jax.Array,
                 num_experts: int) -> dict[str, jax.Array]:
    """Sums over the real tokens of one batch for one MoE layer: ``tokens``, ``changed`` (tokens
    whose chosen set in ``now`` differs from ``start``) and ``counts [N]`` (tokens choosing each
    expert in ``now``; they add up to ``k`` per token).

    ``start``, ``now``: each token's chosen experts ``[B, T, k]`` sorted (a set: the order of
    choice does not count), any numeric dtype; ``token_mask``: bool ``[B, T]``.
    """
    real = token_mask.astype(jnp.float32)
    changed = jnp.any(start != now, axis=-1).astype(jnp.float32)
    chosen = jax.nn.one_hot(now.astype(jnp.int32), num_experts, dtype=jnp.float32)
    return {"tokens": jnp.sum(real), "changed": jnp.sum(changed * real),
            "counts": jnp.sum(chosen * real[..., None, None], axis=(0, 1, 2))}


def load_entropy(shares: jax.Array) -> jax.Array:
    """The entropy of the load ``shares [N]`` (each expert's share of tokens, any positive
    total) divided by ``log N``: 1 for a uniform load, 0 when one expert takes every token."""
    p = shares / jnp.maximum(jnp.sum(shares), 1e-30)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0))
    return entropy / jnp.log(jnp.float32(shares.shape[-1]))
