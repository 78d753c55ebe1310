"""Router auxiliary losses and the statistics every MoE layer logs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import RouterOutput


def token_mean(values: jax.Array, token_mask: jax.Array | None) -> jax.Array:
    """Mean of ``values`` over its token axes (those of ``token_mask``, or all but the last).

    ``values`` is ``[..., K]`` or ``[...]``; padding (``token_mask`` False) is left out.
    """
    if token_mask is None:
        return jnp.mean(values, axis=tuple(range(values.ndim - 1)) if values.ndim > 1 else None)
    token_axes = tuple(range(token_mask.ndim))
    weights = token_mask.astype(jnp.float32).reshape(
        token_mask.shape + (1,) * (values.ndim - token_mask.ndim)
    )
    return jnp.sum(values * weights, axis=token_axes) / jnp.maximum(jnp.sum(weights), 1.0)


def expert_share(expert: jax.Array, num_experts: int, probs_ndim: int) -> jax.Array:
    """float32 ``[..., N]``: each token's share of its routed rows per expert (1 for top-1).

    ``expert`` is ``[...]`` (top-1) or ``[..., k]`` (top-k, then it has as many axes as the
    probabilities): each of the ``k`` rows counts ``1/k``.
    """
    share = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32)
    return jnp.mean(share, axis=-2) if expert.ndim == probs_ndim else share


def load_balancing_loss(
    probs: jax.Array, expert: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """Switch load-balancing loss ``N * sum_i f_i * P_i`` (Fedus et al., 2021, eq. 4).

    Args:
      probs: ``[..., N]`` router probabilities (gradient flows through ``P_i``).
      expert: int ``[...]`` chosen experts, or ``[..., k]`` for top-k (``f_i``, the fraction of
        routed rows, carries no gradient).
      token_mask: optional bool ``[...]``; False marks padding, left out of both means.

    Returns: scalar float32; 1.0 for perfectly uniform routing.
    """
    num_experts = probs.shape[-1]
    fraction = token_mean(expert_share(expert, num_experts, probs.ndim), token_mask)
    mean_prob = token_mean(probs.astype(jnp.float32), token_mask)
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(logits: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    """Router z-loss ``mean(logsumexp(z)^2)`` (Zoph et al., 2022, ST-MoE eq. 5). Scalar float32."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return token_mean(jnp.square(log_z), token_mask)


def routing_metrics(
    logits: jax.Array, routed: RouterOutput, token_mask: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Per-layer router statistics for logging.

    Returns a dict of float32 arrays: ``balance_loss`` and ``z_loss`` (scalars),
    ``expert_fraction`` ``[N]`` (share of routed rows per expert), ``num_unmasked`` (mean number of
    experts with nonzero probability per token) and ``entropy`` (mean router entropy, nats).
    """
    probs = routed.probs
    num_experts = probs.shape[-1]
    safe_log = jnp.log(jnp.where(probs > 0, probs, 1.0))
    return {
        "balance_loss": load_balancing_loss(probs, routed.expert, token_mask),
        "z_loss": router_z_loss(logits, token_mask),
        "expert_fraction": token_mean(
            expert_share(routed.expert, num_experts, probs.ndim), token_mask
        ),
        "num_unmasked": token_mean(jnp.sum(probs > 0, axis=-1).astype(jnp.float32), token_mask),
        "entropy": token_mean(-jnp.sum(probs * safe_log, axis=-1), token_mask),
    }


def sequence_balancing_loss(
    probs: jax.Array, expert: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """:func:`load_balancing_loss` of each sequence (``probs [B, T, N]``, ``expert [B, T]`` or
    ``[B, T, k]``, ``token_mask [B, T]``), averaged over the sequences that hold a token
    (DeepSeek-V3's sequence-wise balance loss, Megatron's ``seq_aux_loss``). Scalar float32."""
    if token_mask is None:
        token_mask = jnp.ones(probs.shape[:2], bool)
    per_sequence = jax.vmap(load_balancing_loss)(probs, expert, token_mask)
    has_tokens = jnp.any(token_mask, axis=1).astype(jnp.float32)
    return jnp.sum(per_sequence * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def global_balancing_loss(
    probs: jax.Array, load: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """``N * sum_i f_i P_i`` with the expert fractions ``f = load / sum(load)`` of ``load [N]``
    (the routed rows per expert counted over the update's micro-batches so far, this one
    included: Megatron's ``global_aux_loss``) and ``P_i`` this micro-batch's mean probability
    (its gradient). Scalar float32; 1.0 for uniform routing."""
    load = jax.lax.stop_gradient(load.astype(jnp.float32))
    fraction = load / jnp.maximum(jnp.sum(load), 1.0)
    return probs.shape[-1] * jnp.sum(fraction * token_mean(probs.astype(jnp.float32),
                                                            token_mask))
