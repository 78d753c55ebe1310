"""SparseMixer under sigmoid scores: the exact gradient and the estimators' exact expectations,
by enumerating ordered tuples (see :mod:`sparsemixer_jax.exact`).

The router (``sparsemixer_route(..., score="sigmoid")``) draws ``D_1, ..., D_k`` one after
another from ``q^(t)`` (:func:`sparsemixer_jax.routers.sigmoid_sample_probs` of the logits with
the experts chosen before removed), and gates them with ``G_t = c s_{D_t} / sum_u s_{D_u}``,
``s = sigmoid(theta)``. The loss is ``L = sum_D P(D) g(sum_t G_t f_{D_t})`` with
``P(D) = prod_t q^(t)_{D_t}``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from sparsemixer_jax.exact.top1 import ExactGradient, ProbsFn, RoutingProblem
from sparsemixer_jax.exact.topk import (
    TupleGatesFn,
    exact_topk_gradient,
    ordered_tuples,
    step_probs,
    tuple_gates,
)
from sparsemixer_jax.routers import ESTIMATORS, TWO_PATH_RULES, sigmoid_sample_probs

Variant = Literal["two_path", "per_step", "single_path"]
#: ``"two_path"``: the router's backward (the set's output along ``grad log P(D)``);
#: ``"per_step"``: each gate's share only along its own step's ``grad log q^(t)_{D_t}`` (wrong
#: at k > 1: the cross terms are missing); ``"single_path"``: the released backward, everything
#: along the gates (wrong: at k = 1 the gate is constant and this is zero).
VARIANTS = ("two_path", "per_step", "single_path")


def sigmoid_gates_fn(scale: float = 1.0) -> TupleGatesFn:
    """``(theta [N], tuple [k]) -> [k]``: ``scale * s_{D_t} / sum_u s_{D_u}``, written out
    here rather than taken from the router, so that the tests compare two implementations."""

    def gates(logits, chosen):
        chosen_scores = 1.0 / (1.0 + jnp.exp(-logits[chosen]))
        return scale * chosen_scores / jnp.sum(chosen_scores)

    return gates


def sigmoid_sampling_fn(bias: jax.Array | None, jitter_eps: float = 0.1,
                        mask: str = "none") -> ProbsFn:
    """The sampling distribution ``q`` (the router's definition) as ``theta [N] -> [N]``."""
    return lambda logits: sigmoid_sample_probs(logits, bias, jitter_eps, mask)


def exact_sigmoid_gradient(problem: RoutingProblem, sampling_fn: ProbsFn, top_k: int,
                           scale: float = 1.0) -> ExactGradient:
    """``L``, ``nabla_0`` (through ``P(D)``) and ``nabla_1`` (through the gates)."""
    return exact_topk_gradient(problem, None, top_k, sampling_fn, sigmoid_gates_fn(scale))


def greedy_set(sampling_fn: ProbsFn, logits: jax.Array, top_k: int) -> jax.Array:
    """bool ``[N]``: the experts of the evaluation forward, each step's most likely expert
    (the top-k of ``s + b``)."""
    excluded = jnp.zeros(logits.shape, bool)
    for _ in range(top_k):
        best = jnp.argmax(sampling_fn(jnp.where(excluded, -jnp.inf, logits)))
        excluded = excluded | (jnp.arange(logits.shape[-1]) == best)
    return excluded


#: The forward weights a branch can take: full, the mid-point's 1/2 and Heun's 1/3.
WEIGHTS = (1.0, 0.5, 1.0 / 3.0)


class TupleTerms(NamedTuple):
    """Per ordered tuple ``D`` (``T`` of them) and forward weight ``w`` of :data:`WEIGHTS`,
    with ``y_w = w sum_t G_t f_{D_t}`` and ``c_t(w) = g'(y_w) . f_{D_t}``: ``prob [T]``
    ``P(D)``; ``off_top`` bool ``[T]`` the set is not the greedy set; ``gate [T, W, N]``
    ``sum_t c_t grad G_t``; ``whole [T, W, N]`` ``(sum_t G_t c_t) grad log P(D)``;
    ``per_step [T, W, N]`` ``sum_t G_t c_t grad log q^(t)_{D_t}``."""

    prob: jax.Array
    off_top: jax.Array
    gate: jax.Array
    whole: jax.Array
    per_step: jax.Array


def tuple_terms(problem: RoutingProblem, sampling_fn: ProbsFn, top_k: int,
                scale: float = 1.0) -> TupleTerms:
    """The :class:`TupleTerms` of every ordered tuple: every estimator's expectation is a sum
    of them weighted by the tuple's probability and its branches' chances."""
    gates_fn = sigmoid_gates_fn(scale)
    z = problem.logits
    top = greedy_set(sampling_fn, z, top_k)
    tuples = jnp.asarray(ordered_tuples(z.shape[-1], top_k))

    def one(chosen):
        sample = step_probs(sampling_fn, z, chosen)  # [k, N]
        chances = sample[jnp.arange(top_k), chosen]
        # grad log q = grad q / q; a tuple with a masked expert has probability 0 and adds 0.
        log_jac = jax.jacobian(tuple_gates, argnums=1)(sampling_fn, z, chosen) * jnp.where(
            chances > 0, 1.0 / jnp.where(chances > 0, chances, 1.0), 0.0)[:, None]
        gates = gates_fn(z, chosen)
        gate_jac = jax.jacobian(gates_fn)(z, chosen)  # [k, N]
        outputs = problem.expert_outputs[chosen]  # [k, d]

        def at(weight):
            y = weight * gates @ outputs
            slopes = jax.vmap(lambda f: jax.jvp(problem.downstream, (y,), (f,))[1])(outputs)
            return (slopes @ gate_jac, (slopes @ gates) * jnp.sum(log_jac, 0),
                    (slopes * gates) @ log_jac)

        gate, whole, per_step = (jnp.stack(t) for t in zip(*map(at, WEIGHTS), strict=True))
        return TupleTerms(jnp.prod(chances), ~jnp.all(top[chosen]), gate, whole, per_step)

    return jax.vmap(one)(tuples)


def sigmoid_expected_gradient(
    problem: RoutingProblem,
    sampling_fn: ProbsFn,
    top_k: int,
    *,
    estimator: str = "mix",
    midpoint_prob: float | None = None,
    scale: float = 1.0,
    variant: Variant = "two_path",
    terms: TupleTerms | None = None,
) -> jax.Array:
    """Exact expectation ``[N]`` of the logits gradient of ``sparsemixer_route(top_k=k,
    score="sigmoid")``, or of a wrong ``variant`` (:data:`VARIANTS`).

    For a tuple ``D`` one coin (never flipped when the set of ``D`` is the greedy set, and
    not by ``"euler"``, ``"midpoint"``) picks the branch: weight ``w`` on every gate (``1`` or
    the estimator's reduced weight), ``y = w sum_t G_t f_{D_t}``, ``c_t = g'(y) . f_{D_t}``,
    and the backward sends ``a sum_t c_t grad G_t + b (sum_t G_t c_t) grad log P(D)``
    (``(a, b)`` the branch's pair of ``routers.TWO_PATH_RULES``). Summed over every tuple and
    both branches with their probabilities. ``terms``: :func:`tuple_terms` of these
    arguments, when the caller already has them.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    rule, two_path = ESTIMATORS[estimator], TWO_PATH_RULES[estimator]
    r = rule.reduced_prob if midpoint_prob is None else midpoint_prob
    split = 0.0 < r < 1.0 and estimator not in ("euler", "midpoint")
    t = tuple_terms(problem, sampling_fn, top_k, scale) if terms is None else terms
    reduced_at = WEIGHTS.index(rule.reduced_weight) if rule.reduced_weight in WEIGHTS else None
    flipped = split & t.off_top  # the branches' own scales; else the sure pair
    if estimator == "euler":
        chance_reduced = jnp.zeros_like(t.prob)
    elif estimator == "midpoint":
        chance_reduced = jnp.ones_like(t.prob)
    else:
        chance_reduced = jnp.where(t.off_top, r, 0.0)

    def branch(reduced: bool, at: int):
        a = (0.0 if reduced else two_path.gate / (1.0 - r)) if split else 0.0
        b = (two_path.quadrature[1] / r if reduced else two_path.quadrature[0] / (1.0 - r)
             ) if split else 0.0
        a = jnp.where(flipped, a, two_path.sure[0])[:, None]
        b = jnp.where(flipped, b, two_path.sure[1])[:, None]
        if variant == "single_path":
            estimate = rule.backward_scale * t.gate[:, at]
        else:
            selection = t.per_step if variant == "per_step" else t.whole
            estimate = a * t.gate[:, at] + b * selection[:, at]
        chance = chance_reduced if reduced else 1.0 - chance_reduced
        return chance[:, None] * estimate

    total = branch(False, 0) + branch(True, reduced_at)
    return jnp.sum(t.prob[:, None] * total, axis=0)


def sigmoid_midpoint_rule_gradient(problem: RoutingProblem, sampling_fn: ProbsFn, top_k: int,
                                   scale: float = 1.0,
                                   terms: TupleTerms | None = None) -> jax.Array:
    """``nabla_1 + `` the mid-point estimate of ``nabla_0`` on every tuple (the greedy set
    included): ``sum_D P(D) [g'(y) . sum_t f_{D_t} grad G_t + g'(y / 2) . y grad log P(D)]``.
    The quantity the router's ``mix`` computes off the greedy set; second order in ``y``."""
    t = tuple_terms(problem, sampling_fn, top_k, scale) if terms is None else terms
    return jnp.sum(t.prob[:, None] * (t.gate[:, 0] + t.whole[:, 1]), axis=0)
