"""Top-k sequential routing: the exact gradient and every estimator's exact expectation, by
enumerating ordered tuples (see :mod:`sparsemixer_jax.exact`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.exact.top1 import ExactGradient, ProbsFn, RoutingProblem, probs_and_jacobian
from sparsemixer_jax.routers import ESTIMATORS, TWO_PATH_RULES, Estimator


def ordered_tuples(num_experts: int, top_k: int) -> np.ndarray:
    """int32 ``[N! / (N - k)!, k]``: every ordered tuple of ``k`` distinct experts."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts}], got {top_k}")
    return np.array(list(itertools.permutations(range(num_experts), top_k)), np.int32)


def step_probs(probs_fn: ProbsFn, logits: jax.Array, chosen: jax.Array) -> jax.Array:
    """``pi^(t)`` ``[k, N]`` for one ordered tuple ``chosen [k]``: row ``t`` is the router
    distribution with the experts ``chosen[:t]`` removed (logit ``-inf``)."""
    num_experts = logits.shape[-1]
    rows = []
    excluded = jnp.zeros((num_experts,), bool)
    for expert in chosen:
        rows.append(probs_fn(jnp.where(excluded, -jnp.inf, logits)))
        excluded = excluded | (jnp.arange(num_experts) == expert)
    return jnp.stack(rows)


def tuple_gates(probs_fn: ProbsFn, logits: jax.Array, chosen: jax.Array) -> jax.Array:
    """Gates ``[k]`` of one ordered tuple: ``pi^(t)_{D_t}``; their product is its probability."""
    return step_probs(probs_fn, logits, chosen)[jnp.arange(chosen.shape[0]), chosen]


TupleGatesFn = Callable[[jax.Array, jax.Array], jax.Array]  # (theta [N], tuple [k]) -> [k]


def exact_topk_gradient(problem: RoutingProblem, probs_fn: ProbsFn | None, top_k: int,
                        sample_probs_fn: ProbsFn | None = None,
                        gates_fn: TupleGatesFn | None = None) -> ExactGradient:
    """``L``, ``nabla_0`` (through the tuple probabilities) and ``nabla_1`` (through the gates)
    for top-k sequential sampling, by enumerating every ordered tuple. ``top_k = 1`` equals
    :func:`exact_gradient`. ``sample_probs_fn``: the distribution the experts are drawn from
    when it is not the gates' (a selection bias); the tuple's probability is then
    ``prod_t q^(t)_{D_t}``. ``gates_fn(theta, tuple) -> [k]``: the gates when they are not the
    step probabilities ``pi^(t)_{D_t}`` (sigmoid scores: ``c s_{D_t} / sum_u s_{D_u}``; then
    ``probs_fn`` may be None)."""
    tuples = jnp.asarray(ordered_tuples(problem.logits.shape[-1], top_k))
    sampling = probs_fn if sample_probs_fn is None else sample_probs_fn
    if gates_fn is None:
        def gates_fn(logits, chosen):
            return tuple_gates(probs_fn, logits, chosen)

    def loss(prob_logits, gate_logits):
        def one(chosen):
            prob = jnp.prod(tuple_gates(sampling, prob_logits, chosen))
            gates = gates_fn(gate_logits, chosen)
            return prob * problem.downstream(gates @ problem.expert_outputs[chosen])

        return jnp.sum(jax.vmap(one)(tuples))

    z = problem.logits
    value, (nabla0, nabla1) = jax.value_and_grad(loss, argnums=(0, 1))(z, z)
    return ExactGradient(loss=value, nabla0=nabla0, nabla1=nabla1)


def topk_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    top_k: int,
    *,
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    backward_scale: float | None = None,
    sample_probs_fn: ProbsFn | None = None,
) -> jax.Array:
    """Exact expectation ``[N]`` of the logits gradient of ``sparsemixer_route(top_k=k)``.

    With ``sample_probs_fn`` (a selection bias: expert ``t`` drawn from ``q^(t)``, gate
    ``pi^(t)_{D_t}``, the coin's argmax that of ``q^(t)``) see
    :func:`topk_selection_bias_expected_gradient`.

    For a tuple ``D`` and coin outcomes ``c`` (``c_t`` = expert ``t`` took the reduced-weight
    branch, chance ``q_t``: the estimator's coin probability, 0 on the argmax of ``pi^(t)``
    unless the rule applies there too), the output is ``y = sum_t w(c_t) pi^(t)_{D_t} f_{D_t}``
    and the router's backward sends ``s * g'(y) . f_{D_t}`` to ``pi^(t)_{D_t}`` (``s`` the
    backward scale). The expectation sums this over every tuple and coin outcome, weighted by
    their probabilities. Written from that description, not from the router's code, so the
    Monte-Carlo tests compare two implementations.
    """
    if sample_probs_fn is not None:
        return topk_selection_bias_expected_gradient(
            problem, probs_fn, sample_probs_fn, top_k, estimator=estimator,
            midpoint_prob=midpoint_prob)
    rule = ESTIMATORS[estimator]
    reduced_prob = rule.reduced_prob if midpoint_prob is None else midpoint_prob
    scale = rule.backward_scale if backward_scale is None else backward_scale
    tuples = jnp.asarray(ordered_tuples(problem.logits.shape[-1], top_k))
    coins = jnp.asarray(list(itertools.product([False, True], repeat=top_k)))  # [2^k, k]
    z = problem.logits

    def one(chosen):
        probs = step_probs(probs_fn, z, chosen)  # [k, N]
        gates = probs[jnp.arange(top_k), chosen]
        jac = jax.jacobian(tuple_gates, argnums=1)(probs_fn, z, chosen)  # [k, N]
        is_top = jnp.argmax(probs, axis=-1) == chosen
        if estimator == "euler":
            q = jnp.zeros(top_k)
        elif rule.on_argmax:
            q = jnp.full(top_k, reduced_prob)
        else:
            q = jnp.where(is_top, 0.0, reduced_prob)
        outputs = problem.expert_outputs[chosen]  # [k, d]

        def per_coin(c):
            weight = jnp.where(c, rule.reduced_weight, 1.0)
            y = (weight * gates) @ outputs
            slopes = jax.vmap(lambda f: jax.jvp(problem.downstream, (y,), (f,))[1])(outputs)
            chance = jnp.prod(jnp.where(c, q, 1.0 - q))
            return chance * (scale * slopes) @ jac

        return jnp.prod(gates) * jnp.sum(jax.vmap(per_coin)(coins), axis=0)

    return jnp.sum(jax.vmap(one)(tuples), axis=0)


def topk_selection_bias_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    sample_probs_fn: ProbsFn,
    top_k: int,
    *,
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
) -> jax.Array:
    """Exact expectation ``[N]`` of the logits gradient of ``sparsemixer_route(top_k=k,
    selection_bias=b)``: expert ``t`` drawn from ``q^(t) = sample_probs_fn`` of the logits with
    the experts chosen before removed, gate ``pi^(t)_{D_t}`` (``pi = probs_fn``).

    For a tuple and its coin outcomes the forward is ``y = sum_t w_t pi^(t)_{D_t} f_{D_t}``
    and, with ``c_t = g'(y) . f_{D_t}``, the backward sends ``a_t c_t`` along
    ``grad pi^(t)_{D_t}`` and ``b_t c_t pi^(t)_{D_t}`` along ``grad log q^(t)_{D_t}``
    (``routers.TWO_PATH_RULES``: the branch's ``(a, b)``). Summed over every tuple and coin
    outcome with their probabilities ``prod_t q^(t)_{D_t}`` times the coins'.
    """
    rule, two_path = ESTIMATORS[estimator], TWO_PATH_RULES[estimator]
    r = rule.reduced_prob if midpoint_prob is None else midpoint_prob
    tuples = jnp.asarray(ordered_tuples(problem.logits.shape[-1], top_k))
    coins = jnp.asarray(list(itertools.product([False, True], repeat=top_k)))  # [2^k, k]
    z = problem.logits
    split = 0.0 < r < 1.0

    def one(chosen):
        sample = step_probs(sample_probs_fn, z, chosen)  # [k, N]
        chances = sample[jnp.arange(top_k), chosen]
        gates = tuple_gates(probs_fn, z, chosen)
        gate_jac = jax.jacobian(tuple_gates, argnums=1)(probs_fn, z, chosen)  # [k, N]
        # grad log q = grad q / q; a tuple with a masked expert has probability 0 and adds 0.
        log_jac = jax.jacobian(tuple_gates, argnums=1)(sample_probs_fn, z, chosen) * jnp.where(
            chances > 0, 1.0 / jnp.where(chances > 0, chances, 1.0), 0.0)[:, None]
        off_top = jnp.argmax(sample, axis=-1) != chosen
        if estimator == "euler":
            flipped, chance_reduced = jnp.zeros(top_k, bool), jnp.zeros(top_k)
        elif estimator == "midpoint":
            flipped, chance_reduced = jnp.zeros(top_k, bool), jnp.ones(top_k)
        else:
            flipped = off_top if split else jnp.zeros(top_k, bool)
            chance_reduced = jnp.where(off_top, r, 0.0)
        outputs = problem.expert_outputs[chosen]  # [k, d]

        def per_coin(c):
            weight = jnp.where(c, rule.reduced_weight, 1.0)
            y = (weight * gates) @ outputs
            slopes = jax.vmap(lambda f: jax.jvp(problem.downstream, (y,), (f,))[1])(outputs)
            if split:
                a = jnp.where(c, 0.0, two_path.gate / (1.0 - r))
                b = jnp.where(c, two_path.quadrature[1] / r, two_path.quadrature[0] / (1.0 - r))
            else:
                a = b = jnp.zeros(top_k)
            a = jnp.where(flipped, a, two_path.sure[0])
            b = jnp.where(flipped, b, two_path.sure[1])
            chance = jnp.prod(jnp.where(c, chance_reduced, 1.0 - chance_reduced))
            return chance * ((a * slopes) @ gate_jac + (b * slopes * gates) @ log_jac)

        return jnp.prod(chances) * jnp.sum(jax.vmap(per_coin)(coins), axis=0)

    return jnp.sum(jax.vmap(one)(tuples), axis=0)


DENSE_ESTIMATORS = ("densemixer", "densemixer_blog", "default_moe", "default_moe_st")


def topk_dense_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    top_k: int,
    estimator: str,
    defaults: jax.Array | None = None,
) -> jax.Array:
    """Exact expectation ``[N]`` of the router gradient of an estimator of
    :data:`DENSE_ESTIMATORS` under top-k sequential sampling.

    For an ordered tuple ``D`` (probability ``P(D) = prod_t pi^(t)_{D_t}``) the forward is
    ``y = sum_t pi^(t)_{D_t} f_{D_t}``, plus ``sum_{j not in D} pi_j v_j`` for ``default_moe``
    (``pi`` the first-step distribution ``pi^(1)``, ``v = defaults [N, d]``, oracle ``v = f``
    when ``None``). The backward sends the ordinary ``g'(y) . f_{D_t}`` to gate ``t`` (through
    ``pi^(t)_{D_t}``, as :func:`topk_expected_gradient`) and in addition

    * ``densemixer``: ``sum_{j not in D} g'(y) . f_j dpi_j``;
    * ``densemixer_blog``: ``sum_{all j} pi_j g'(y) . f_j dpi_j``;
    * ``default_moe``, ``default_moe_st``: ``sum_{j not in D} g'(y) . v_j dpi_j``.

    Weighted by ``P(D)`` and summed over every tuple. ``top_k = 1`` gives the top-1 functions
    (:func:`densemixer_gradient` and the others). The forward is sampled here; the published
    methods use the deterministic top-k forward, and DenseMixer's code sends a chosen expert's
    gradient to ``pi_j`` rather than to the sequential gate ``pi^(t)_{D_t}`` (the same at k=1).
    """
    if estimator not in DENSE_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {DENSE_ESTIMATORS}")
    num_experts = problem.logits.shape[-1]
    tuples = jnp.asarray(ordered_tuples(num_experts, top_k))
    z = problem.logits
    f = problem.expert_outputs
    defaults = f if defaults is None else defaults
    directions = f if estimator.startswith("densemixer") else defaults
    probs, jac = probs_and_jacobian(problem, probs_fn)

    def one(chosen):
        gates = tuple_gates(probs_fn, z, chosen)
        gate_jac = jax.jacobian(tuple_gates, argnums=1)(probs_fn, z, chosen)  # [k, N]
        unchosen = ~jnp.any(jnp.arange(num_experts)[:, None] == chosen[None, :], axis=1)
        y = gates @ f[chosen]
        if estimator == "default_moe":
            y = y + (unchosen * probs) @ defaults
        slope = jax.grad(problem.downstream)(y)  # g'(y) [d]
        ordinary = (f[chosen] @ slope) @ gate_jac
        extra = directions @ slope  # [N]
        extra = probs * extra if estimator == "densemixer_blog" else unchosen * extra
        return jnp.prod(gates) * (ordinary + jac.T @ extra)

    return jnp.sum(jax.vmap(one)(tuples), axis=0)
