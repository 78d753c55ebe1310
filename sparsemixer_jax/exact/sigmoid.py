"""SparseMixer under sigmoid scores: the exact gradient and the estimators' exact expectations,
by enumerating ordered tuples (see :mod:`sparsemixer_jax.exact`).

The router (``sparsemixer_route(..., score="sigmoid")``) draws ``D_1, ..., D_k`` one after
another from ``q^(t)`` (:func:`sparsemixer_jax.routers.sigmoid_sample_probs` of the logits with
the experts chosen before removed), and gates them with ``G_t = c s_{D_t} / sum_u s_{D_u}``,
``s = sigmoid(theta)``. The loss is ``L = sum_D P(D) g(sum_t G_t f_{D_t})`` with
``P(D) = prod_t q^(t)_{D_t}``.
"""

from __future__ import annotations

from typing import Literal

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


def sigmoid_expected_gradient(
    problem: RoutingProblem,
    sampling_fn: ProbsFn,
    top_k: int,
    *,
    estimator: str = "mix",
    midpoint_prob: float | None = None,
    scale: float = 1.0,
    variant: Variant = "two_path",
) -> jax.Array:
    """Exact expectation ``[N]`` of the logits gradient of ``sparsemixer_route(top_k=k,
    score="sigmoid")``, or of a wrong ``variant`` (:data:`VARIANTS`).

    For a tuple ``D`` one coin (never flipped when the set of ``D`` is the greedy set, and
    not by ``"euler"``, ``"midpoint"``) picks the branch: weight ``w`` on every gate (``1`` or
    the estimator's reduced weight), ``y = w sum_t G_t f_{D_t}``, ``c_t = g'(y) . f_{D_t}``,
    and the backward sends ``a sum_t c_t grad G_t + b (sum_t G_t c_t) grad log P(D)``
    (``(a, b)`` the branch's pair of ``routers.TWO_PATH_RULES``). Summed over every tuple and
    both branches with their probabilities.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    rule, two_path = ESTIMATORS[estimator], TWO_PATH_RULES[estimator]
    r = rule.reduced_prob if midpoint_prob is None else midpoint_prob
    split = 0.0 < r < 1.0 and estimator not in ("euler", "midpoint")
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
        flipped = split & ~jnp.all(top[chosen])
        if estimator == "euler":
            chance_reduced = 0.0
        elif estimator == "midpoint":
            chance_reduced = 1.0
        else:
            chance_reduced = jnp.where(flipped, r, 0.0)
        outputs = problem.expert_outputs[chosen]  # [k, d]

        def branch(reduced):
            y = jnp.where(reduced, rule.reduced_weight, 1.0) * gates @ outputs
            slopes = jax.vmap(lambda f: jax.jvp(problem.downstream, (y,), (f,))[1])(outputs)
            a = jnp.where(reduced, 0.0, two_path.gate / (1.0 - r)) if split else 0.0
            b = jnp.where(reduced, two_path.quadrature[1] / r,
                          two_path.quadrature[0] / (1.0 - r)) if split else 0.0
            a = jnp.where(flipped, a, two_path.sure[0])
            b = jnp.where(flipped, b, two_path.sure[1])
            if variant == "single_path":
                estimate = rule.backward_scale * slopes @ gate_jac
            elif variant == "per_step":
                estimate = a * slopes @ gate_jac + b * (slopes * gates) @ log_jac
            else:
                estimate = a * slopes @ gate_jac + b * (slopes @ gates) * jnp.sum(log_jac, 0)
            chance = jnp.where(reduced, chance_reduced, 1.0 - chance_reduced)
            return chance * estimate

        return jnp.prod(chances) * (branch(False) + branch(True))

    return jnp.sum(jax.vmap(one)(tuples), axis=0)


def sigmoid_midpoint_rule_gradient(problem: RoutingProblem, sampling_fn: ProbsFn, top_k: int,
                                   scale: float = 1.0) -> jax.Array:
    """``nabla_1 + `` the mid-point estimate of ``nabla_0`` on every tuple (the greedy set
    included): ``sum_D P(D) [g'(y) . sum_t f_{D_t} grad G_t + g'(y / 2) . y grad log P(D)]``.
    The quantity the router's ``mix`` computes off the greedy set; second order in ``y``."""
    exact = exact_sigmoid_gradient(problem, sampling_fn, top_k, scale)
    gates_fn = sigmoid_gates_fn(scale)
    z = problem.logits
    tuples = jnp.asarray(ordered_tuples(z.shape[-1], top_k))

    def one(chosen):
        log_prob = jax.grad(lambda t: jnp.sum(jnp.log(tuple_gates(sampling_fn, t, chosen))))
        y = gates_fn(z, chosen) @ problem.expert_outputs[chosen]
        value = jax.jvp(problem.downstream, (0.5 * y,), (y,))[1]
        prob = jnp.prod(tuple_gates(sampling_fn, z, chosen))
        return jnp.where(prob > 0, prob * value * log_prob(z), 0.0)

    return exact.nabla1 + jnp.sum(jax.vmap(one)(tuples), axis=0)

