"""SparseMixer routing (Liu, Gao & Chen, ICLR 2024) and GRIN's SparseMixer-v2, top-1 and top-k.

Notation follows the paper: ``pi`` are the (masked) router probabilities, ``D`` the chosen
expert, ``g`` the rest of the network. The exact router gradient is ``nabla_0 + nabla_1``:
``nabla_1`` flows through the gate ``pi_D`` by ordinary backpropagation, ``nabla_0`` comes from
the sampling of ``D`` and is what ordinary MoE training drops. SparseMixer estimates it with a
forward-Euler or mid-point rule applied along the path from ``0`` to ``pi_D f_D`` (see
:mod:`sparsemixer_jax.exact` for an exact oracle and the measured orders of accuracy).

:func:`sparsemixer_route` is the public router: it checks its arguments and picks one route per
algorithm, each a function of its own options: :func:`sparsemixer_softmax_route` (softmax
scores, top-1 or top-k, every estimator), :func:`sparsemixer_selection_bias_route` (softmax
scores under a selection bias, two-path backward) and :func:`sparsemixer_sigmoid_route`
(sigmoid scores). Their shared parts (mask, masked softmax, keys, gates) are in
:mod:`sparsemixer_jax.routers.sampling`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.routers.common import RouterOutput, check_finite_logits
from sparsemixer_jax.routers.estimators import Estimator
from sparsemixer_jax.routers.sampling import (
    MaskRule,
    check_sampling_args,
    check_selection_bias_shape,
)
from sparsemixer_jax.routers.selection import limit_to_groups, selection_scores
from sparsemixer_jax.routers.sigmoid_scores import check_scaling_factor, sparsemixer_sigmoid_route
from sparsemixer_jax.routers.sparsemixer_selection_bias import sparsemixer_selection_bias_route
from sparsemixer_jax.routers.sparsemixer_softmax import sparsemixer_softmax_route


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
      mask: which experts are eligible, see :func:`~sparsemixer_jax.routers.routing_mask`.
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
        (:func:`~sparsemixer_jax.routers.selection_probs`); ``b`` gets no gradient. The
        backward then has two paths (:func:`~sparsemixer_jax.routers.two_path_gate`, derived
        in docs/routing.md): ``nabla_1`` exactly along ``grad pi_D``, ``nabla_0`` along
        ``pi_D grad log q_D`` with the estimator's rule
        (:data:`~sparsemixer_jax.routers.TWO_PATH_RULES`; ``v2`` sends no ``nabla_1``, as
        published). No ``backward_scale``. For ``top_k > 1`` every step does this on its own
        conditional ``q^(t)`` and ``pi^(t)``. Inference takes the top-k of ``z + b``.
        ``probs`` is ``pi``.
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
      :class:`~sparsemixer_jax.routers.RouterOutput`: ``expert`` int32 and ``gate`` float32
      of shape ``[...]`` when ``top_k == 1`` and ``[..., top_k]`` otherwise (``gate[..., t]``
      is the probability of expert ``t`` among those left after the first ``t``, not
      renormalised, as in GRIN);
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
    (:func:`~sparsemixer_jax.routers.routing_mask`); inference takes the argmax of the logits,
    so experts whose probabilities tie in float32 are told apart by their logits; the coin's
    "is it the argmax" in training breaks such ties as each estimator's reference does
    (:attr:`~sparsemixer_jax.routers.EstimatorRule.argmax_of`: the logits for ``"mix"``,
    ``"euler"``, ``"midpoint"``, the first of the tied float32 probabilities for ``"v2"`` and
    ``"v2star"``); the top-k steps draw from independent keys
    (:func:`~sparsemixer_jax.routers.routing_keys`).

    Non-finite logits: ``-inf`` removes an expert (never sampled, probability 0). A token with
    NaN or +inf logits, or fewer than ``top_k`` experts above ``-inf``, gets NaN ``probs`` and
    ``gate`` (a valid ``expert`` index); called outside ``jit`` it raises ValueError instead.

    Long only by this docstring, the reference of the public router: the body checks the
    arguments and dispatches to one route per algorithm in about 20 lines.
    """
    fn = "sparsemixer_route"
    check_sampling_args(fn, logits, key, top_k, jitter_eps, training, estimator, midpoint_prob,
                        backward_scale)
    invalid = check_finite_logits(fn, logits, top_k)
    check_score_args(fn, logits, score, routed_scaling_factor, selection_bias, backward_scale)
    if num_groups > 1:
        logits = _exclude_unkept_groups(logits, selection_bias, score, num_groups, top_groups,
                                        group_score)
    # invalid is of the logits as given: a NaN in an excluded group still makes the token NaN.
    options = dict(top_k=top_k, jitter_eps=jitter_eps, training=training, mask=mask,
                   estimator=estimator, midpoint_prob=midpoint_prob, invalid=invalid)
    if score == "sigmoid":
        return sparsemixer_sigmoid_route(logits, key, selection_bias=selection_bias,
                                         routed_scaling_factor=routed_scaling_factor, **options)
    if selection_bias is not None:
        return sparsemixer_selection_bias_route(logits, key, selection_bias, **options)
    return sparsemixer_softmax_route(logits, key, backward_scale=backward_scale, **options)


def _exclude_unkept_groups(logits, selection_bias, score, num_groups, top_groups,
                           group_score) -> jax.Array:
    """``logits`` with ``-inf`` on the experts outside the token's ``top_groups`` groups, chosen
    on the selection scores (:func:`~sparsemixer_jax.routers.selection.limit_to_groups`).

    SparseMixer samples among the experts of the kept groups; no gradient flows through the
    choice of groups."""
    selection = jax.lax.stop_gradient(selection_scores(logits, selection_bias, score))
    kept = limit_to_groups(selection, num_groups, top_groups, group_score)
    return jnp.where(jnp.isneginf(kept), -jnp.inf, logits)


def check_score_args(fn: str, logits, score: str, routed_scaling_factor,
                     selection_bias, backward_scale: float | None) -> None:
    """ValueError in one line for a ``score`` SparseMixer does not know, a scale without sigmoid
    scores, a selection bias of the wrong shape, or ``backward_scale`` with a selection bias or
    sigmoid scores (the two-path backward sets its own scales)."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"{fn}: unknown score {score!r}; expected 'softmax' or 'sigmoid'")
    if score == "softmax" and routed_scaling_factor != 1.0:
        raise ValueError(f"{fn}: routed_scaling_factor={routed_scaling_factor!r} has no "
                         f"effect with score='softmax'; only score='sigmoid' takes it")
    if score == "sigmoid":
        check_scaling_factor(fn, routed_scaling_factor)
    if selection_bias is not None:
        check_selection_bias_shape(fn, logits, selection_bias)
        if backward_scale is not None:
            raise ValueError(f"{fn}: backward_scale={backward_scale!r} does not compose with "
                             f"selection_bias: the two-path backward sets its own scales")
    elif score == "sigmoid" and backward_scale is not None:
        raise ValueError(f"{fn}: backward_scale={backward_scale!r} does not compose with "
                         f"score='sigmoid': the two-path backward sets its own scales")
