"""The routing options that change which experts a token may choose, and the per-expert loads
that bias balancing and the global-batch balance loss count.

Pure functions of arrays; the layer (:class:`sparsemixer_jax.moe.MoEFeedForward`) keeps the
bias and the loads as its state, and the training step moves the bias after each update
(:func:`bias_step`). docs/routing.md derives how each estimator composes with each option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: ``config.router.score``: what the experts are selected on and the gates are made of.
SCORES = ("softmax", "sigmoid")
#: ``config.router.group_score``: how group-limited routing scores a group of experts.
GROUP_SCORES = ("max", "top2_sum")
#: ``config.router.balance_scope``: over which tokens the balance loss counts expert loads.
BALANCE_SCOPES = ("micro_batch", "sequence", "global_batch")


def selection_scores(logits: jax.Array, selection_bias: jax.Array | None = None,
                     score: str = "softmax") -> jax.Array:
    """What experts are selected on, ``[..., N]`` in the logits' float32-or-wider dtype: the
    logits ``z`` (``score="softmax"``) or ``sigmoid(z)`` (``"sigmoid"``), plus the selection
    bias ``b [N]`` (which gets no gradient); ``-inf`` where ``z = -inf`` (an excluded expert).
    Differentiable in ``logits``."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    scores = jax.nn.sigmoid(logits) if score == "sigmoid" else logits
    if selection_bias is not None:
        scores = scores + jax.lax.stop_gradient(selection_bias).astype(scores.dtype)
    return jnp.where(jnp.isneginf(logits), -jnp.inf, scores)


def limit_to_groups(scores: jax.Array, num_groups: int, top_groups: int,
                    group_score: str = "max") -> jax.Array:
    """``scores [..., N]`` with every expert outside the token's ``top_groups`` best groups set
    to ``-inf``.

    The experts form ``num_groups`` groups of ``N / num_groups`` consecutive experts (the
    experts one device holds under expert parallelism); a group's score is its best expert's
    score (``group_score="max"``, DeepSeek-V2's group-limited selection) or the sum of its two
    best (``"top2_sum"``: DeepSeek-V3 and GLM-4.5 on the biased sigmoid scores). Taking the
    maximum makes the chosen groups the same for any increasing transform of the scores
    (logits or their softmax); the sum does not. Ties keep the lower-numbered group. The choice
    carries no gradient: kept scores pass theirs through unchanged.
    """
    if num_groups == 1:
        return scores
    *lead, n = scores.shape
    grouped = scores.reshape(*lead, num_groups, n // num_groups)
    if group_score == "max":
        best = jnp.max(jax.lax.stop_gradient(grouped), axis=-1)  # [..., G]
    else:
        best = jnp.sum(jax.lax.top_k(jax.lax.stop_gradient(grouped), 2)[0], axis=-1)
    _, top = jax.lax.top_k(best, top_groups)
    keep = jnp.sum(jax.nn.one_hot(top, num_groups, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    kept = jnp.where(keep[..., None], grouped, -jnp.inf)
    return kept.reshape(scores.shape)


def expert_load(expert: jax.Array, num_experts: int,
                token_mask: jax.Array | None = None) -> jax.Array:
    """float32 ``[N]``: how many routed rows each expert was chosen for (``expert`` int
    ``[...]`` top-1 or ``[..., k]`` top-k; ``token_mask`` bool over the token axes, padding
    uncounted). Counted from the router's choice, before any capacity drops, over the whole
    (global) batch: under ``jit`` every data-parallel device's tokens are in it."""
    rows = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32)
    if token_mask is not None:
        mask = token_mask.astype(jnp.float32)
        rows = rows * mask.reshape(mask.shape + (1,) * (rows.ndim - mask.ndim))
    return jnp.sum(rows.reshape(-1, num_experts), axis=0)


def bias_step(load: jax.Array, rate: float) -> jax.Array:
    """The bias change after an update with per-expert ``load [..., N]``:
    ``rate * sign(mean(load) - load_i)`` (DeepSeek-V3's auxiliary-loss-free balancing): an
    overloaded expert's bias goes down, an underloaded one's up."""
    load = load.astype(jnp.float32)
    return rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
