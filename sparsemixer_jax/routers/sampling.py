"""The parts every SparseMixer route is made of: which experts stay eligible (the mask), the
masked softmax, the keys of a draw, the gates whose custom backward carries an estimator, and the
checks of the arguments the routes share.

The routes themselves, one per algorithm, build on this module:
:func:`~sparsemixer_jax.routers.sparsemixer_softmax_route`,
:func:`~sparsemixer_jax.routers.sparsemixer_selection_bias_route` and
:func:`~sparsemixer_jax.routers.sparsemixer_sigmoid_route`;
:func:`~sparsemixer_jax.routers.sparsemixer_route` picks one of them.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import (
    RouterOutput,
    check_finite_logits,
    check_route_args,
    routing_dtype,
)
from sparsemixer_jax.routers.estimators import ESTIMATORS, check_estimator_args

MaskRule = Literal["reference", "paper", "none"]


def routing_mask(logits: jax.Array, jitter_eps: float, rule: MaskRule = "reference") -> jax.Array:
    """Which experts stay eligible: bool ``[..., N]``, True where expert i may be sampled.

    ``rule="reference"`` (default) is the test of microsoft/SparseMixer and of Hugging Face's
    ``phimoe`` (GRIN): ``(max(z) - z_i) / max(|z_i|, max(z)) > 2 * jitter_eps`` masks expert i,
    computed in that division form, so that a logit within rounding of the threshold falls on
    the same side as in the references (the product form ``gap > 2 eps scale`` can differ by an
    ulp). Where the scale is zero (``z_i = max(z) = 0``) the gap is zero too and the expert is
    kept, as the references keep it (their ``0/0`` is NaN, which compares false).

    ``rule="paper"`` is the paper's Section 3.5 statement of the Switch support:
    expert i is masked when ``max(z) - z_i > jitter_eps * (|max(z)| + |z_i|)``. The two differ:
    the reference uses a factor 2 on the larger magnitude instead of the sum of both.

    ``rule="none"`` keeps every expert (plain softmax sampling, the paper's ablation).

    The argmax is never masked, so at least one expert stays eligible. No gradient flows through
    the mask. Both tests are relative to the logits' magnitude, so near-zero logits (a freshly
    initialised router) often leave only the argmax eligible; such a token has ``pi_D = 1`` and
    gives the router no gradient, as in the reference.
    """
    logits = jax.lax.stop_gradient(logits.astype(routing_dtype(logits)))
    if rule == "none":
        return jnp.ones(logits.shape, dtype=bool)
    top = jnp.max(logits, axis=-1, keepdims=True)
    gap = top - logits
    if rule == "reference":
        scale = jnp.maximum(jnp.abs(logits), top)
        ratio = gap / jnp.where(scale > 0, scale, 1.0)
        # An excluded expert (-inf) stays excluded; its inf / inf would be NaN.
        masked = jnp.isneginf(logits) | (ratio > 2.0 * jitter_eps)
    elif rule == "paper":
        masked = gap > jitter_eps * (jnp.abs(top) + jnp.abs(logits))
    else:
        raise ValueError(f"unknown mask rule {rule!r}; expected 'reference', 'paper' or 'none'")
    return ~masked


def router_probs(
    logits: jax.Array, jitter_eps: float = 0.1, mask: MaskRule = "reference"
) -> jax.Array:
    """Masked softmax ``pi``: float32 ``[..., N]``, zero on masked experts.

    Differentiable in ``logits`` (the mask is held fixed), which the exact-gradient oracle uses.
    """
    logits = logits.astype(routing_dtype(logits))
    keep = jax.lax.stop_gradient(routing_mask(logits, jitter_eps, mask))
    return jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)


@jax.custom_vjp
def fill_masked(values: jax.Array, keep: jax.Array) -> jax.Array:
    """``where(keep, values, -inf)`` (``values [..., N]`` float, ``keep`` bool of the same
    shape) whose backward passes the cotangent through to every entry.

    For logits about to enter a masked softmax (:func:`router_probs` masks them again), where
    a filled entry has probability 0 and so gets a zero cotangent anyway (up to the sign of
    zero): the select's own backward would keep ``keep`` for the backward pass, a ``[..., N]``
    mask that a layer scan stores per layer.
    """
    return jnp.where(keep, values, -jnp.inf)


def _fill_masked_fwd(values, keep):
    return jnp.where(keep, values, -jnp.inf), None


def _fill_masked_bwd(_, cotangent):
    return cotangent, None


fill_masked.defvjp(_fill_masked_fwd, _fill_masked_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def scaled_gate(prob: jax.Array, forward_scale: jax.Array, backward_scale: float) -> jax.Array:
    """``prob * forward_scale`` whose cotangent to ``prob`` is ``backward_scale * cotangent``.

    The backward ignores ``forward_scale`` on purpose: this is the reference's balancing core
    (a halved forward on the mid-point branch, the same doubled backward on both branches).
    """
    return prob * forward_scale


def _scaled_gate_fwd(prob, forward_scale, backward_scale):
    # Nothing saved: the backward needs neither input (forward_scale's cotangent is zero).
    return prob * forward_scale, None


def _scaled_gate_bwd(backward_scale, _, cotangent):
    return cotangent * backward_scale, None


scaled_gate.defvjp(_scaled_gate_fwd, _scaled_gate_bwd)


def selection_probs(
    logits: jax.Array, selection_bias: jax.Array, jitter_eps: float = 0.1,
    mask: MaskRule = "reference",
) -> tuple[jax.Array, jax.Array]:
    """``(q, pi)``, float32 ``[..., N]`` each, for a selection-only bias ``b [N]``.

    ``q`` is the masked softmax of ``z + b``, the distribution ``D`` is drawn from; ``pi`` is
    the softmax of ``z`` over the same eligible experts, the gates. The mask is the router's
    (:func:`routing_mask`) computed on the selection logits ``z + b``. Both are differentiable
    in ``logits`` with the mask held fixed; ``b`` gets no gradient. With ``b = 0`` both equal
    :func:`router_probs`.
    """
    logits = logits.astype(routing_dtype(logits))
    selection = logits + jax.lax.stop_gradient(selection_bias).astype(logits.dtype)
    keep = routing_mask(selection, jitter_eps, mask)
    q = jax.nn.softmax(jnp.where(keep, selection, -jnp.inf), axis=-1)
    pi = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return q, pi


@jax.custom_vjp
def two_path_gate(prob: jax.Array, log_sample_prob: jax.Array, forward_scale: jax.Array,
                  gate_scale: jax.Array, selection_scale: jax.Array) -> jax.Array:
    """``prob * forward_scale`` whose cotangent ``c`` goes along two paths: ``gate_scale * c``
    to ``prob`` (the gate ``pi_D``) and ``selection_scale * prob * c`` to ``log_sample_prob``
    (``log q_D``, the sampling distribution).

    The backward of SparseMixer under a selection bias (docs/routing.md): the gate term
    ``nabla_1`` goes along ``grad pi_D``, the selection term ``nabla_0`` along
    ``pi_D grad log q_D = pi_D (e_D - q)``. The scales and ``forward_scale`` get no gradient.
    """
    return prob * forward_scale


def _two_path_gate_fwd(prob, log_sample_prob, forward_scale, gate_scale, selection_scale):
    return prob * forward_scale, (prob, forward_scale, gate_scale, selection_scale)


def _two_path_gate_bwd(residuals, cotangent):
    prob, forward_scale, gate_scale, selection_scale = residuals
    zero = jnp.zeros_like(forward_scale)
    return (cotangent * gate_scale, cotangent * selection_scale * prob, zero, zero, zero)


two_path_gate.defvjp(_two_path_gate_fwd, _two_path_gate_bwd)


def routing_keys(key: jax.Array, top_k: int) -> jax.Array:
    """The keys of a top-k draw: ``[top_k, 2]``, a (sample, coin) pair per step.

    All ``2 top_k`` come from one split of ``key``, so no two steps share a key; step 0's pair
    is ``jax.random.split(key)``, so the first expert is drawn as in top-1.
    """
    return jax.random.split(key, (top_k, 2))


def chosen_prob(probs: jax.Array, expert: jax.Array) -> jax.Array:
    """``probs[..., expert]`` per token (``probs [..., N]`` in ``[0, 1]`` or NaN, int
    ``expert [...]``), as a sum over a one-hot: exactly :func:`take_expert`'s value (the other
    terms are zeros), and its backward is a product that fuses with the softmax's, where a
    gather's is a scatter kernel of its own."""
    one_hot = jax.nn.one_hot(expert, probs.shape[-1], dtype=probs.dtype)
    return jnp.sum(probs * one_hot, axis=-1)


def router_output(experts: list, gates: list, first_probs: jax.Array) -> RouterOutput:
    """The :class:`RouterOutput` of the ``k`` steps' experts and gates (each ``[...]``): as
    they are for top-1, stacked on a last axis ``[..., k]`` otherwise."""
    if len(experts) == 1:
        return RouterOutput(expert=experts[0], gate=gates[0], probs=first_probs)
    return RouterOutput(
        expert=jnp.stack(experts, axis=-1), gate=jnp.stack(gates, axis=-1), probs=first_probs
    )


def coin_branch(estimator: str, off_top: jax.Array, coin_key: jax.Array,
                reduced_prob: float) -> tuple[jax.Array, jax.Array]:
    """``(coin_flipped, reduced)``, bool of ``off_top``'s shape ``[...]``: whether a coin was
    flipped for the choice and whether it takes the reduced-weight branch. ``"euler"`` never
    reduces and ``"midpoint"`` always does, neither flipping a coin; the others flip one of
    probability ``reduced_prob`` (from ``coin_key``) where ``off_top``, the choice is not the
    argmax (or the drawn set not the top set)."""
    if estimator == "euler":
        return jnp.zeros(off_top.shape, dtype=bool), jnp.zeros(off_top.shape, dtype=bool)
    if estimator == "midpoint":
        return jnp.zeros(off_top.shape, dtype=bool), jnp.ones(off_top.shape, dtype=bool)
    return off_top, jax.random.bernoulli(coin_key, reduced_prob, off_top.shape) & off_top


def check_sampling_args(fn: str, logits, key, top_k, jitter_eps, training, estimator: str,
                        midpoint_prob: float | None, backward_scale: float | None) -> None:
    """ValueError in one line, prefixed ``fn``, for an argument every SparseMixer route takes
    that it cannot use: the router arguments (:func:`check_route_args`), the estimator's
    options, and a missing key in training."""
    check_route_args(fn, logits, top_k, jitter_eps, training)
    check_estimator_args(fn, estimator, midpoint_prob, backward_scale)
    if training and key is None:
        raise ValueError(f"{fn} needs a PRNG key when training=True")


def check_selection_bias_shape(fn: str, logits, selection_bias) -> None:
    """ValueError in one line unless ``selection_bias`` has shape ``[N]``, ``N`` the logits'
    last axis."""
    num_experts = jnp.shape(logits)[-1]
    if jnp.shape(selection_bias) != (num_experts,):
        raise ValueError(f"{fn}: selection_bias must have shape [N] = ({num_experts},), got "
                         f"{jnp.shape(selection_bias)}")


def coin_probability(estimator: str, midpoint_prob: float | None) -> float:
    """The probability that a non-argmax choice takes the reduced-weight branch:
    ``midpoint_prob``, or the estimator's default (:data:`ESTIMATORS`) when it is None."""
    rule = ESTIMATORS[estimator]
    return rule.reduced_prob if midpoint_prob is None else float(midpoint_prob)


def nan_tokens(fn: str, logits: jax.Array, top_k: int, invalid: jax.Array | None) -> jax.Array:
    """bool ``[...]``, the tokens a route gives NaN ``probs`` and ``gate``: ``invalid`` when the
    caller has already checked the logits (before excluding any experts), else
    :func:`check_finite_logits` of ``logits``, which raises outside ``jit``."""
    return check_finite_logits(fn, logits, top_k) if invalid is None else invalid
