"""SparseMixer routing (Liu, Gao & Chen, ICLR 2024) and GRIN's SparseMixer-v2, top-1 and top-k.

Notation follows the paper: ``pi`` are the (masked) router probabilities, ``D`` the chosen
expert, ``g`` the rest of the network. The exact router gradient is ``nabla_0 + nabla_1``:
``nabla_1`` flows through the gate ``pi_D`` by ordinary backpropagation, ``nabla_0`` comes from
the sampling of ``D`` and is what ordinary MoE training drops. SparseMixer estimates it with a
forward-Euler or mid-point rule applied along the path from ``0`` to ``pi_D f_D`` (see
:mod:`sparsemixer_jax.exact` for an exact oracle and the measured orders of accuracy).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import (
    RouterOutput,
    check_finite_logits,
    check_route_args,
    routing_dtype,
    take_expert,
)
from sparsemixer_jax.routers.estimators import (
    ESTIMATORS,
    TWO_PATH_RULES,
    Estimator,
    EstimatorRule,
    check_estimator_args,
    two_path_scales,
)
from sparsemixer_jax.routers.selection import limit_to_groups, selection_scores

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


def sparsemixer_route(
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
    selection_bias: jax.Array | None = None,
    score: str = "softmax",
    routed_scaling_factor: float = 1.0,
    num_groups: int = 1,
    top_groups: int = 1,
    group_score: str = "max",
) -> RouterOutput:
    """SparseMixer routing (top-1, or top-k by sequential sampling) with its sparse gradient.

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32).
        ``-inf`` excludes an expert for that token; NaN or +inf is an error (see below).
      key: PRNG key for sampling; required when ``training``.
      top_k: experts per token, ``1 <= top_k <= N``. Expert ``t`` is drawn like the first from
        the tokens' logits with the experts already chosen removed (mask and softmax recomputed
        from the best remaining logit), so the ``k`` experts of a token are distinct.
        ``top_k = N`` is allowed: every expert, in sampled order; the last has gate 1 and gives
        no router gradient.
      jitter_eps: the Switch jitter ``r``; sets the mask threshold. Python float ``>= 0``.
      training: Python bool. Sample and apply the estimator; otherwise ``D`` = argmax (top-k in
        order of the logits) with ``gate = pi_D`` and no randomness.
      mask: which experts are eligible, see :func:`routing_mask`.
      estimator: how the gradient of the sampling is estimated (defaults below:
        reduced-branch weight / its probability off the argmax / backward scale):

        * ``"mix"`` (SparseMixer, 1/2 / 0.5 / 2): Euler on the argmax, a coin between Euler and
          mid-point elsewhere.
        * ``"euler"`` (SparseMixer-1st, - / 0 / 2): Euler everywhere.
        * ``"midpoint"`` (SparseMixer-2nd, 1/2 / 1 / 2): mid-point everywhere, the argmax
          included, so training and inference outputs differ by a factor 2.
        * ``"v2"`` (GRIN's SparseMixer-v2 as released, 1/3 / 0.75 / 1): Heun's third-order rule
          for ``nabla_0`` and nothing for ``nabla_1``.
        * ``"v2star"`` (1/3 / 0.375 / 2): v2 corrected to carry ``nabla_1`` too (below).
      midpoint_prob: the probability that a non-argmax choice takes the reduced-weight branch;
        None takes the estimator's default. Only for ``"mix"``, ``"v2"``, ``"v2star"``: the
        others flip no coin, and giving it to them is an error.
      backward_scale: factor on the gate's cotangent; None takes the estimator's default.
      selection_bias: float ``[N]`` added to the logits for the selection only (bias
        balancing): ``D ~ q``, the masked softmax of ``z + b`` (the mask computed on ``z + b``),
        gate ``pi_D`` with ``pi`` the softmax of ``z`` over the same experts
        (:func:`selection_probs`); ``b`` gets no gradient. The backward then has two paths
        (:func:`two_path_gate`, derived in docs/routing.md): ``nabla_1`` exactly along
        ``grad pi_D``, ``nabla_0`` along ``pi_D grad log q_D`` with the estimator's rule
        (:data:`TWO_PATH_RULES`; ``v2`` sends no ``nabla_1``, as published). No
        ``backward_scale``. For ``top_k > 1`` every step does this on its own conditional
        ``q^(t)`` and ``pi^(t)``. Inference takes the top-k of ``z + b``. ``probs`` is ``pi``.
      score: ``"softmax"``, or ``"sigmoid"`` (DeepSeek-V3's router): gates
        ``routed_scaling_factor * s_{D_t} / sum_u s_{D_u}``, ``s = sigmoid(z)``, and ``D_t``
        drawn from ``q^(t)`` proportional to ``s + b`` over the eligible experts (the mask
        computed on ``s + b``; ``b`` the selection bias, added to the scores as in DeepSeek-V3).
        One coin per token; the backward sends each gate's cotangent along its own gradient
        and the whole set's output along ``grad log P(D)`` (the mid-point rule on the set;
        :mod:`sparsemixer_jax.routers.sigmoid_scores`, derived in docs/routing.md). No
        ``backward_scale``. Inference takes ``TopK(s + b)``, the type's forward. ``probs`` is
        ``s / sum s`` and ``scores`` is ``s``, as for Switch under sigmoid scores.
      routed_scaling_factor: the sigmoid gates' scale ``c`` (DeepSeek-V3: 2.5); only with
        ``score="sigmoid"``.
      num_groups, top_groups, group_score: group-limited routing
        (:func:`sparsemixer_jax.routers.selection.limit_to_groups`): the groups are chosen once
        per token on the selection scores (``z + b``, or ``sigmoid(z) + b`` under sigmoid
        scores) and the experts of the others are excluded (``-inf``), a second mask held
        fixed in the gradient, as the router's own.

    Returns:
      :class:`RouterOutput`: ``expert`` int32 and ``gate`` float32 of shape ``[...]`` when
      ``top_k == 1`` and ``[..., top_k]`` otherwise (``gate[..., t]`` is the probability of
      expert ``t`` among those left after the first ``t``, not renormalised, as in GRIN);
      ``probs`` float32 ``[..., N]``, the distribution of the first expert.

    The forward-Euler branch outputs ``pi_D f_D``; the reduced branch outputs ``w pi_D f_D``
    (``w = 1/2`` mid-point, ``1/3`` Heun). Both send ``backward_scale * dL/dgate`` to ``pi_D``,
    whatever ``w``. With the defaults the expected router gradient is, per token and in the
    paper's notation (``u(w) = g'(w pi f) . pi f``, so ``nabla_1 = u(1)`` and
    ``nabla_0 = integral of u over [0, 1]``, both times ``dpi / pi``):

    * ``"mix"``, on the argmax: ``2 u(1)``; elsewhere ``u(1) + u(1/2)``: ``nabla_1`` plus the
      mid-point estimate of ``nabla_0``.
    * ``"v2"``: ``u(1)`` on the argmax, ``u(1)/4 + 3 u(1/3)/4`` elsewhere: Heun's third-order
      estimate of ``nabla_0`` alone, with ``nabla_1`` missing. As outputs shrink
      ``nabla_0 -> nabla_1``, so v2 gives about half the exact gradient (GRIN, Appendix A).
    * ``"v2star"``: ``2 u(1)`` on the argmax, ``2 (5 u(1)/8 + 3 u(1/3)/8)`` elsewhere, i.e.
      ``u(1) + (u(1)/4 + 3 u(1/3)/4)``: exact ``nabla_1`` plus Heun's estimate of ``nabla_0``.
      GRIN's Appendix A.2 describes its corrected v2 as a factor 2, a different coin and a
      softmax temperature of 2; the factor and the coin here are derived from the quadrature
      above. The temperature is not applied: its text was not available to check against.

    For ``top_k > 1`` each step's estimator acts on that step's conditional probabilities; the
    term from "the first choice changes the distribution of the second" has no estimate in this
    per-step construction, GRIN's (``sparsemixer_jax.exact.exact_topk_gradient`` measures what
    it costs); ``score="sigmoid"`` uses a whole-tuple construction that has one.

    Where the reference codes depart from their papers, this function follows the code:

    1. Mask threshold: ``(max z - z_i) / max(|z_i|, max z) > 2 r`` instead of the paper's
       ``max z - z_i > r (|max z| + |z_i|)`` (``mask="paper"`` gives the paper's rule).
    2. The paper's SparseMixer uses the mid-point rule on every non-argmax token; the reference
       flips a fair coin between mid-point and Euler there (``midpoint_prob=1.0`` gives the paper).
    3. The paper's estimators approximate ``nabla_0`` alone; the reference doubles the gate's
       gradient so that one backward pass also carries ``nabla_1`` (``backward_scale=1.0``
       drops the doubling). GRIN's released v2 does not double it (scale 1).
    4. ``D`` is drawn with the Gumbel-max trick, as in both reference codes; the papers write
       ``D ~ pi`` without saying how. The two are the same distribution.
    5. GRIN's code writes the Heun weight as ``0.3333`` (and 1 as ``0.3333 + 0.6667``); here it
       is ``1/3`` in float32. Its second expert's coin is compared with the argmax of the
       second step's distribution, as here.

    Matching the references at the edges: the mask test is computed in their division form
    (:func:`routing_mask`); inference takes the argmax of the logits, so experts whose
    probabilities tie in float32 are told apart by their logits; the coin's "is it the argmax"
    in training breaks such ties as each estimator's reference does
    (:attr:`EstimatorRule.argmax_of`: the logits for ``"mix"``, ``"euler"``, ``"midpoint"``,
    the first of the tied float32 probabilities for ``"v2"`` and ``"v2star"``); the top-k
    steps draw from independent keys (:func:`routing_keys`).

    Non-finite logits: ``-inf`` removes an expert (never sampled, probability 0). A token with
    NaN or +inf logits, or fewer than ``top_k`` experts above ``-inf``, gets NaN ``probs`` and
    ``gate`` (a valid ``expert`` index); called outside ``jit`` it raises ValueError instead.

    Long only by this docstring, the reference of the public router: the body, checks and a
    choice among three routes, is about 30 lines.
    """
    fn = "sparsemixer_route"
    check_route_args(fn, logits, top_k, jitter_eps, training)
    check_estimator_args(fn, estimator, midpoint_prob, backward_scale)
    if training and key is None:
        raise ValueError(f"{fn} needs a PRNG key when training=True")
    rule = ESTIMATORS[estimator]
    reduced_prob = rule.reduced_prob if midpoint_prob is None else float(midpoint_prob)
    scale = rule.backward_scale if backward_scale is None else float(backward_scale)
    invalid = check_finite_logits(fn, logits, top_k)
    check_score_args(fn, logits, score, routed_scaling_factor, selection_bias, backward_scale)
    if num_groups > 1:
        logits = _exclude_unkept_groups(logits, selection_bias, score, num_groups, top_groups,
                                        group_score)
    if score == "sigmoid":
        # Imported here: that module builds on this one's mask, keys and gates.
        from sparsemixer_jax.routers.sigmoid_scores import sigmoid_route

        return sigmoid_route(logits, selection_bias, key, invalid, top_k, jitter_eps, training,
                             mask, estimator, reduced_prob, routed_scaling_factor)
    if selection_bias is not None:
        check_selection_bias_args(fn, logits, selection_bias, estimator, backward_scale)
        return _route_with_selection_bias(logits, selection_bias, key, invalid, top_k,
                                          jitter_eps, training, mask, estimator, reduced_prob)
    return _route_softmax(logits, key, invalid, top_k, jitter_eps, training, mask, estimator,
                          reduced_prob, scale)


def _exclude_unkept_groups(logits, selection_bias, score, num_groups, top_groups,
                           group_score) -> jax.Array:
    """``logits`` with ``-inf`` on the experts outside the token's ``top_groups`` groups, chosen
    on the selection scores (:func:`~sparsemixer_jax.routers.selection.limit_to_groups`).

    SparseMixer samples among the experts of the kept groups; no gradient flows through the
    choice of groups."""
    selection = jax.lax.stop_gradient(selection_scores(logits, selection_bias, score))
    kept = limit_to_groups(selection, num_groups, top_groups, group_score)
    return jnp.where(jnp.isneginf(kept), -jnp.inf, logits)


def _route_softmax(logits, key, invalid, top_k, jitter_eps, training, mask, estimator,
                   reduced_prob, scale) -> RouterOutput:
    """SparseMixer on the softmax of the logits without a selection bias: ``D_t ~ pi^(t)``, the
    masked softmax of the logits with the experts already chosen removed, and its gate with the
    estimator's backward (:func:`scaled_gate`); evaluation takes the top-k of the logits."""
    rule = ESTIMATORS[estimator]
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
    return _router_output(experts, gates, first_probs)


def _router_output(experts: list, gates: list, first_probs: jax.Array) -> RouterOutput:
    """The :class:`RouterOutput` of the ``k`` steps' experts and gates (each ``[...]``): as
    they are for top-1, stacked on a last axis ``[..., k]`` otherwise."""
    if len(experts) == 1:
        return RouterOutput(expert=experts[0], gate=gates[0], probs=first_probs)
    return RouterOutput(
        expert=jnp.stack(experts, axis=-1), gate=jnp.stack(gates, axis=-1), probs=first_probs
    )


def _sample_step(probs, top, keys, estimator, rule: EstimatorRule, reduced_prob, scale):
    """One draw ``D ~ probs`` and its gate ``w pi_D`` with the estimator's backward; ``keys``
    ``[2]`` are this step's sample and coin keys."""
    sample_key, coin_key = keys[0], keys[1]
    # Gumbel-max over the masked logits; log(probs) differs from them by a constant per token.
    masked_logits = jnp.log(jax.lax.stop_gradient(probs))
    expert = jax.random.categorical(sample_key, masked_logits, axis=-1).astype(jnp.int32)
    if estimator == "euler":
        reduced = jnp.zeros(expert.shape, dtype=bool)
    elif estimator == "midpoint":
        reduced = jnp.ones(expert.shape, dtype=bool)
    else:
        coin = jax.random.bernoulli(coin_key, reduced_prob, expert.shape)
        reduced = coin if rule.on_argmax else coin & (expert != top)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(probs.dtype)
    return expert, scaled_gate(chosen_prob(probs, expert), forward_scale, scale)


def chosen_prob(probs: jax.Array, expert: jax.Array) -> jax.Array:
    """``probs[..., expert]`` per token (``probs [..., N]`` in ``[0, 1]`` or NaN, int
    ``expert [...]``), as a sum over a one-hot: exactly :func:`take_expert`'s value (the other
    terms are zeros), and its backward is a product that fuses with the softmax's, where a
    gather's is a scatter kernel of its own."""
    one_hot = jax.nn.one_hot(expert, probs.shape[-1], dtype=probs.dtype)
    return jnp.sum(probs * one_hot, axis=-1)


def check_selection_bias_args(fn: str, logits, selection_bias, estimator: str,
                              backward_scale: float | None) -> None:
    """ValueError in one line for a selection bias of the wrong shape or with an option the
    two-path estimator does not take."""
    num_experts = jnp.shape(logits)[-1]
    if jnp.shape(selection_bias) != (num_experts,):
        raise ValueError(f"{fn}: selection_bias must have shape [N] = ({num_experts},), got "
                         f"{jnp.shape(selection_bias)}")
    if backward_scale is not None:
        raise ValueError(f"{fn}: backward_scale={backward_scale!r} does not compose with "
                         f"selection_bias: the two-path backward sets its own scales")


def check_score_args(fn: str, logits, score: str, routed_scaling_factor,
                     selection_bias, backward_scale: float | None) -> None:
    """ValueError in one line for a ``score`` SparseMixer does not know, a scale without sigmoid
    scores, or ``backward_scale`` under sigmoid scores (the two paths set their own scales)."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"{fn}: unknown score {score!r}; expected 'softmax' or 'sigmoid'")
    if score == "softmax":
        if routed_scaling_factor != 1.0:
            raise ValueError(f"{fn}: routed_scaling_factor={routed_scaling_factor!r} has no "
                             f"effect with score='softmax'; only score='sigmoid' takes it")
        return
    if isinstance(routed_scaling_factor, bool) or not (
            isinstance(routed_scaling_factor, (int, float))
            and math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"{fn}: routed_scaling_factor must be a finite number > 0, got "
                         f"{routed_scaling_factor!r}")
    if selection_bias is not None:
        check_selection_bias_args(fn, logits, selection_bias, "mix", backward_scale)
    elif backward_scale is not None:
        raise ValueError(f"{fn}: backward_scale={backward_scale!r} does not compose with "
                         f"score='sigmoid': the two-path backward sets its own scales")


def _route_with_selection_bias(logits, selection_bias, key, invalid, top_k, jitter_eps,
                               training, mask, estimator, reduced_prob) -> RouterOutput:
    """SparseMixer with ``D_t ~ q^(t)`` (selection logits ``z + b``, the experts already chosen
    removed) and gates ``pi^(t)_{D_t}``; the backward splits as :data:`TWO_PATH_RULES` says.
    The coin's argmax is that of ``z + b`` (``argmax_of="logits"``) or the first of the largest
    float32 ``q^(t)`` (``"probs"``), as without a bias."""
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
    return _router_output(experts, gates, first_probs)


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
    if estimator == "euler":
        coin_flipped = reduced = jnp.zeros(expert.shape, dtype=bool)
    elif estimator == "midpoint":
        coin_flipped, reduced = (jnp.zeros(expert.shape, dtype=bool),
                                 jnp.ones(expert.shape, dtype=bool))
    else:
        coin_flipped = expert != coin_top
        reduced = jax.random.bernoulli(coin_key, reduced_prob, expert.shape) & coin_flipped
    gate_scale, selection_scale = two_path_scales(two_path, reduced, coin_flipped, reduced_prob)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(pi.dtype)
    gate = two_path_gate(take_expert(pi, expert), take_expert(log_q, expert), forward_scale,
                         gate_scale, selection_scale)
    return expert, gate
