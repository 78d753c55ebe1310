"""Exact-gradient oracles for top-1 and top-k routing on small problems, by enumeration.

The problem is the paper's simplified MoE (Section 2): router logits ``theta [N]``, expert
outputs ``f [N, d]`` (fixed vectors), router probabilities ``pi = probs_fn(theta)``, a known
downstream function ``g: R^d -> R`` and the loss

    L(theta) = E_{D ~ pi} g(pi_D f_D) = sum_i pi_i g(pi_i f_i).

Its gradient splits into ``nabla_0 = sum_i g(pi_i f_i) dpi_i`` (from sampling ``D``) and
``nabla_1 = sum_i pi_i g'(pi_i f_i) . f_i dpi_i`` (through the gate, what backpropagation
gives). Every estimator considered here has an expectation of the form ``sum_i c_i dpi_i`` for
a coefficient vector ``c [N]``, so each is computed exactly as ``J^T c`` with ``J = dpi/dtheta``.

Coefficients, per expert ``i`` (``e_i`` forward Euler, ``m_i`` mid-point):

    e_i = pi_i g'(pi_i f_i) . f_i          (equals the nabla_1 coefficient)
    m_i = pi_i g'(pi_i f_i / 2) . f_i

The gradients are with respect to the logits; the gradient with respect to router weights
``W_r`` is the same vector times ``x^T``, so it has the same accuracy.

Top-k (:func:`exact_topk_gradient`, :func:`topk_expected_gradient`): the router draws ``k``
distinct experts one after another, expert ``t`` from ``pi^(t)``, the router probabilities of
the logits with the experts already chosen removed; the gate of expert ``t`` is its
probability ``pi^(t)_{D_t}`` (not renormalised). Enumerating every ordered tuple
``(D_1, ..., D_k)`` (``N! / (N - k)!`` of them) gives the loss
``L = sum P(tuple) g(sum_t pi^(t)_{D_t} f_{D_t})`` with ``P(tuple) = prod_t pi^(t)_{D_t}``, and
every estimator's expectation by also enumerating its ``2^k`` coin outcomes.

Estimators that also send a gradient to experts the token did not choose (DenseMixer, Yao et
al. 2025; Default MoE, Panda et al. 2025): :func:`densemixer_gradient`,
:func:`densemixer_blog_gradient`, :func:`default_moe_gradient`, :func:`default_moe_st_gradient`
(top-1) and :func:`topk_dense_expected_gradient` (top-k). They keep the sparse forward of the
chosen experts; here that forward is sampled (``D ~ pi``), like every other estimator on this
page, whereas the published methods route with the deterministic top-k (Switch-style) forward.

The accuracy experiment (:func:`accuracy_experiment`, ``python -m
experiments.gradient_accuracy``) scales the expert outputs by ``s`` from 1 down to
``min_scale`` on random problems: the slope of log(relative error) against log(s) is an
estimator's order of accuracy (the paper claims 1 for forward Euler and 2 for the mid-point
rule); top-k, the norm ratio, cosine and bias against the exact top-k gradient.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.routing import ESTIMATORS, Estimator, router_probs

Downstream = Callable[[jax.Array], jax.Array]  # g: [d] -> scalar
ProbsFn = Callable[[jax.Array], jax.Array]  # theta [N] -> pi [N]


class RoutingProblem(NamedTuple):
    """A small routing problem with a known downstream function ``g(y) = sum(sin(A y + b))``.

    Attributes: ``logits [N]``, ``expert_outputs [N, d]``, ``weight [d, d]`` (A), ``bias [d]``.
    """

    logits: jax.Array
    expert_outputs: jax.Array
    weight: jax.Array
    bias: jax.Array

    def downstream(self, y: jax.Array) -> jax.Array:
        """``g(y) = sum(sin(A y + b))``: smooth, with nonzero second and third derivatives."""
        return jnp.sum(jnp.sin(self.weight @ y + self.bias))

    def scaled(self, scale: float) -> RoutingProblem:
        """The same problem with expert outputs multiplied by ``scale``."""
        return self._replace(expert_outputs=self.expert_outputs * scale)


def random_problem(
    key: jax.Array, num_experts: int = 8, dim: int = 16, logit_scale: float = 1.0
) -> RoutingProblem:
    """A random :class:`RoutingProblem` in the default float dtype (float64 under x64)."""
    k_logits, k_f, k_a, k_b = jax.random.split(key, 4)
    dtype = jnp.zeros(()).dtype  # float64 when x64 is enabled
    return RoutingProblem(
        logits=logit_scale * jax.random.normal(k_logits, (num_experts,), dtype),
        expert_outputs=jax.random.normal(k_f, (num_experts, dim), dtype),
        weight=jax.random.normal(k_a, (dim, dim), dtype) / jnp.sqrt(dim),
        bias=jax.random.uniform(k_b, (dim,), dtype, minval=-jnp.pi, maxval=jnp.pi),
    )


class ExactGradient(NamedTuple):
    """``loss`` (scalar) and the two terms of its gradient with respect to the logits, ``[N]``."""

    loss: jax.Array
    nabla0: jax.Array
    nabla1: jax.Array

    @property
    def full(self) -> jax.Array:
        return self.nabla0 + self.nabla1


def _directional_slopes(problem: RoutingProblem, probs: jax.Array, at: float) -> jax.Array:
    """``g'(at * pi_i f_i) . f_i`` for every expert: ``[N]``."""

    def slope(point, direction):
        return jax.jvp(problem.downstream, (point,), (direction,))[1]

    points = at * probs[:, None] * problem.expert_outputs
    return jax.vmap(slope)(points, problem.expert_outputs)


def _jacobian(problem: RoutingProblem, probs_fn: ProbsFn) -> tuple[jax.Array, jax.Array]:
    """``pi [N]`` and ``J = dpi/dtheta [N, N]`` (row i is ``dpi_i/dtheta``)."""
    return probs_fn(problem.logits), jax.jacobian(probs_fn)(problem.logits)


def exact_gradient(
    problem: RoutingProblem, probs_fn: ProbsFn = lambda z: router_probs(z, mask="none")
) -> ExactGradient:
    """``L``, ``nabla_0`` and ``nabla_1`` by enumerating every expert."""
    probs, jac = _jacobian(problem, probs_fn)
    values = jax.vmap(problem.downstream)(probs[:, None] * problem.expert_outputs)
    return ExactGradient(
        loss=jnp.sum(probs * values),
        nabla0=jac.T @ values,
        nabla1=jac.T @ (probs * _directional_slopes(problem, probs, 1.0)),
    )


def estimator_coefficients(
    problem: RoutingProblem, probs_fn: ProbsFn
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(e, m, is_top, J)``: Euler and mid-point coefficients ``[N]``, argmax mask, Jacobian."""
    probs, jac = _jacobian(problem, probs_fn)
    euler = probs * _directional_slopes(problem, probs, 1.0)
    midpoint = probs * _directional_slopes(problem, probs, 0.5)
    is_top = jnp.arange(probs.shape[-1]) == jnp.argmax(probs)
    return euler, midpoint, is_top, jac


def router_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    *,
    estimator: Estimator = "mix",
    midpoint_prob: float = 0.5,
    backward_scale: float = 2.0,
) -> jax.Array:
    """Exact expectation of the logits gradient of ``sparsemixer_route`` with these options.

    Per token with sampled ``D = i`` the router sends ``backward_scale * g'(s pi_i f_i) . f_i``
    to ``pi_i``, with ``s = 1`` on the Euler branch and ``s = 1/2`` on the mid-point branch.
    Averaging over ``D ~ pi`` and the coin gives
    ``c_i = backward_scale * ((1 - q_i) e_i + q_i m_i)`` with ``q_i`` the chance of the
    mid-point branch: 0 (``"euler"``), 1 (``"midpoint"``), or ``midpoint_prob`` off the argmax
    and 0 on it (``"mix"``). ``estimator="euler", backward_scale=1`` is plain backpropagation
    with ``D ~ pi``: the expectation is exactly ``nabla_1`` (Switch-style training).
    """
    euler, midpoint, is_top, jac = estimator_coefficients(problem, probs_fn)
    if estimator == "euler":
        q = jnp.zeros_like(euler)
    elif estimator == "midpoint":
        q = jnp.ones_like(euler)
    elif estimator == "mix":
        q = jnp.where(is_top, 0.0, midpoint_prob)
    else:
        raise ValueError(f"unknown estimator {estimator!r}")
    return jac.T @ (backward_scale * ((1.0 - q) * euler + q * midpoint))


def midpoint_rule_gradient(problem: RoutingProblem, probs_fn: ProbsFn) -> jax.Array:
    """``nabla_1 + `` the mid-point estimate of ``nabla_0`` on every expert (argmax included).

    This is the paper's second-order claim in isolation: its ``nabla_0`` part, ``J^T m``, is the
    mid-point rule of Section 3.4; ``nabla_1`` is what ordinary backpropagation gives. The
    reference mix computes exactly this on non-argmax tokens.
    """
    euler, midpoint, _, jac = estimator_coefficients(problem, probs_fn)
    return jac.T @ (euler + midpoint)


def estimator_table(
    problem: RoutingProblem, probs_fn: ProbsFn, defaults: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Expected full router gradient ``[N]`` of each estimator, by name.

    * ``switch``: plain backpropagation (``nabla_1`` only, ``nabla_0`` dropped).
    * ``euler``: SparseMixer-1st, forward Euler for ``nabla_0`` (``2 J^T e``).
    * ``midpoint``: mid-point rule for ``nabla_0`` plus exact ``nabla_1``
      (:func:`midpoint_rule_gradient`).
    * ``sparsemixer_2nd``: the router's ``estimator="midpoint"`` as implemented (halved output,
      doubled backward): ``2 J^T m``, the mid-point rule applied to both terms.
    * ``sparsemixer``: the router's default, the reference mix (fair coin).
    * ``sparsemixer_paper``: the paper's text, mid-point on every non-argmax token.
    * ``densemixer``, ``densemixer_blog``: DenseMixer as released and as its blog writes it
      (:func:`densemixer_gradient`, :func:`densemixer_blog_gradient`).
    * ``default_moe``, ``default_moe_st``: Default MoE with the defaults ``defaults [N, d]``
      (:func:`default_moe_gradient`, :func:`default_moe_st_gradient`); ``*_oracle``: the same
      with oracle defaults ``v = f``. ``defaults=None`` means oracle defaults.

    The ``nabla_0`` part of each is its value minus ``nabla_1``.
    """
    oracle = problem.expert_outputs
    defaults = oracle if defaults is None else defaults
    nabla1 = exact_gradient(problem, probs_fn).nabla1
    return {
        "switch": nabla1,
        "euler": router_expected_gradient(problem, probs_fn, estimator="euler"),
        "midpoint": midpoint_rule_gradient(problem, probs_fn),
        "sparsemixer_2nd": router_expected_gradient(problem, probs_fn, estimator="midpoint"),
        "sparsemixer": router_expected_gradient(problem, probs_fn, estimator="mix"),
        "sparsemixer_paper": router_expected_gradient(
            problem, probs_fn, estimator="mix", midpoint_prob=1.0
        ),
        "densemixer": densemixer_gradient(problem, probs_fn),
        "densemixer_blog": densemixer_blog_gradient(problem, probs_fn),
        "default_moe": default_moe_gradient(problem, probs_fn, defaults),
        "default_moe_st": default_moe_st_gradient(problem, probs_fn, defaults),
        "default_moe_oracle": default_moe_gradient(problem, probs_fn, oracle),
        "default_moe_st_oracle": default_moe_st_gradient(problem, probs_fn, oracle),
    }


# ---------------------------------------- estimators that also reach experts not chosen


def noisy_defaults(expert_outputs: jax.Array, key: jax.Array, noise_level: float) -> jax.Array:
    """Default MoE's default vectors ``[N, d]`` as a real layer would have them.

    ``v_j = f_j + noise_level * ||f_j|| * xi_j / sqrt(d)`` with ``xi_j ~ N(0, I)`` drawn from
    ``key``. A real default is the running mean of the expert's outputs over many tokens, not
    this token's output ``f_j``; the noise stands for that difference. ``noise_level = 0`` gives
    the oracle defaults ``v = f``. Linear in ``expert_outputs`` for a fixed ``key``, so the
    defaults of the problem scaled by ``s`` are ``s`` times these.
    """
    dim = expert_outputs.shape[-1]
    xi = jax.random.normal(key, expert_outputs.shape, expert_outputs.dtype)
    norms = jnp.linalg.norm(expert_outputs, axis=-1, keepdims=True)
    return expert_outputs + noise_level * norms * xi / math.sqrt(dim)


def _outcome_slopes(
    problem: RoutingProblem, outputs: jax.Array, directions: jax.Array
) -> jax.Array:
    """``S [M, K]``, ``S[D, j] = g'(outputs_D) . directions_j``: ``outputs [M, d]`` are the MoE
    outputs of the outcomes ``D``, ``directions [K, d]`` the vectors the router is sent."""
    return jax.vmap(jax.grad(problem.downstream))(outputs) @ directions.T


def densemixer_gradient(problem: RoutingProblem, probs_fn: ProbsFn) -> jax.Array:
    """Exact expectation ``[N]`` of DenseMixer's router gradient as its released code computes it.

    The code evaluates every expert and outputs ``sparse.detach() + dense - dense.detach()`` with
    ``dense = sum_j pi_j E_j(x)``: the forward is the sparse output, and ``pi_j`` receives
    ``g'(y) . f_j`` for every expert ``j``, chosen or not. With ``D ~ pi`` (top-1, sampled;
    the released code uses the deterministic top-k forward) and ``y = pi_D f_D``:

        c_j = sum_D pi_D g'(pi_D f_D) . f_j,   gradient J^T c.
    """
    probs, jac = _jacobian(problem, probs_fn)
    f = problem.expert_outputs
    slopes = _outcome_slopes(problem, probs[:, None] * f, f)  # [D, j]
    return jac.T @ (probs @ slopes)


def densemixer_blog_gradient(problem: RoutingProblem, probs_fn: ProbsFn) -> jax.Array:
    """Exact expectation ``[N]`` of DenseMixer's router gradient as its blog writes it.

    The blog's straight-through rule gives ``E_j(x)`` the coefficient ``pi_j + TopK_j`` on
    ``dpi_j``: a chosen expert gets the ordinary ``g'(y) . f_j`` plus ``pi_j g'(y) . f_j``, an
    unchosen one ``pi_j g'(y) . f_j``. With ``D ~ pi`` (top-1, sampled) and ``y = pi_D f_D``:

        c_j = pi_j sum_D pi_D g'(pi_D f_D) . f_j + pi_j g'(pi_j f_j) . f_j,   gradient J^T c.
    """
    probs, jac = _jacobian(problem, probs_fn)
    f = problem.expert_outputs
    slopes = _outcome_slopes(problem, probs[:, None] * f, f)  # [D, j]
    return jac.T @ (probs * (probs @ slopes) + probs * jnp.diagonal(slopes))


def _default_moe_coefficients(
    problem: RoutingProblem, probs: jax.Array, defaults: jax.Array, add_defaults: bool
) -> jax.Array:
    """Default MoE's expected coefficients ``c [N]`` (top-1, ``D ~ pi``); see
    :func:`default_moe_gradient` and :func:`default_moe_st_gradient`."""
    f = problem.expert_outputs
    outputs = probs[:, None] * f  # [D, d]
    if add_defaults:  # + sum_{i != D} pi_i v_i
        outputs = outputs + (probs @ defaults)[None, :] - probs[:, None] * defaults
    own = jnp.diagonal(_outcome_slopes(problem, outputs, f))  # g'(y_j) . f_j
    to_defaults = _outcome_slopes(problem, outputs, defaults)  # [D, j]: g'(y_D) . v_j
    unchosen = probs @ to_defaults - probs * jnp.diagonal(to_defaults)  # sum over D != j
    return probs * own + unchosen


def default_moe_gradient(
    problem: RoutingProblem, probs_fn: ProbsFn, defaults: jax.Array
) -> jax.Array:
    """Exact expectation ``[N]`` of Default MoE's router gradient, forward as in the paper.

    Each expert keeps a default vector ``v_j`` (``defaults [N, d]``, an EMA of its outputs);
    the forward adds the defaults of the experts not chosen, ``y_D = pi_D f_D +
    sum_{i != D} pi_i v_i``, so ``pi_j`` receives ``g'(y_D) . v_j`` for ``j != D`` and the
    ordinary ``g'(y_D) . f_D`` for ``j = D``. With ``D ~ pi`` (top-1, sampled; the paper uses the
    deterministic top-k forward):

        c_j = pi_j g'(y_j) . f_j + sum_{D != j} pi_D g'(y_D) . v_j,   gradient J^T c.

    The output ``y_D`` is not the problem's ``pi_D f_D``; the result is still compared with the
    exact gradient of the problem's loss.
    """
    probs, jac = _jacobian(problem, probs_fn)
    return jac.T @ _default_moe_coefficients(problem, probs, defaults, add_defaults=True)


def default_moe_st_gradient(
    problem: RoutingProblem, probs_fn: ProbsFn, defaults: jax.Array
) -> jax.Array:
    """Exact expectation ``[N]`` of straight-through Default MoE's router gradient.

    The forward is the ordinary ``y = pi_D f_D``; ``pi_j`` receives ``g'(y) . v_j`` for every
    unchosen ``j`` (``defaults [N, d]``) and the ordinary ``g'(y) . f_D`` for ``j = D``. With
    ``D ~ pi`` (top-1, sampled):

        c_j = pi_j g'(pi_j f_j) . f_j + sum_{D != j} pi_D g'(pi_D f_D) . v_j,   gradient J^T c.

    With oracle defaults ``v = f`` this is :func:`densemixer_gradient`.
    """
    probs, jac = _jacobian(problem, probs_fn)
    return jac.T @ _default_moe_coefficients(problem, probs, defaults, add_defaults=False)


# ---------------------------------------------------------------------------------- top-k


def ordered_tuples(num_experts: int, top_k: int) -> np.ndarray:
    """int32 ``[N! / (N - k)!, k]``: every ordered tuple of ``k`` distinct experts."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts}], got {top_k}")
    return np.array(list(itertools.permutations(range(num_experts), top_k)), np.int32)


def _step_probs(probs_fn: ProbsFn, logits: jax.Array, chosen: jax.Array) -> jax.Array:
    """``pi^(t)`` ``[k, N]`` for one ordered tuple ``chosen [k]``: row ``t`` is the router
    distribution with the experts ``chosen[:t]`` removed (logit ``-inf``)."""
    num_experts = logits.shape[-1]
    rows = []
    excluded = jnp.zeros((num_experts,), bool)
    for expert in chosen:
        rows.append(probs_fn(jnp.where(excluded, -jnp.inf, logits)))
        excluded = excluded | (jnp.arange(num_experts) == expert)
    return jnp.stack(rows)


def _tuple_gates(probs_fn: ProbsFn, logits: jax.Array, chosen: jax.Array) -> jax.Array:
    """Gates ``[k]`` of one ordered tuple: ``pi^(t)_{D_t}``; their product is its probability."""
    return _step_probs(probs_fn, logits, chosen)[jnp.arange(chosen.shape[0]), chosen]


def exact_topk_gradient(problem: RoutingProblem, probs_fn: ProbsFn, top_k: int) -> ExactGradient:
    """``L``, ``nabla_0`` (through the tuple probabilities) and ``nabla_1`` (through the gates)
    for top-k sequential sampling, by enumerating every ordered tuple. ``top_k = 1`` equals
    :func:`exact_gradient`."""
    tuples = jnp.asarray(ordered_tuples(problem.logits.shape[-1], top_k))

    def loss(prob_logits, gate_logits):
        def one(chosen):
            prob = jnp.prod(_tuple_gates(probs_fn, prob_logits, chosen))
            gates = _tuple_gates(probs_fn, gate_logits, chosen)
            return prob * problem.downstream(gates @ problem.expert_outputs[chosen])

        return jnp.sum(jax.vmap(one)(tuples))

    z = problem.logits
    return ExactGradient(
        loss=loss(z, z),
        nabla0=jax.grad(loss, argnums=0)(z, z),
        nabla1=jax.grad(loss, argnums=1)(z, z),
    )


def topk_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    top_k: int,
    *,
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    backward_scale: float | None = None,
) -> jax.Array:
    """Exact expectation ``[N]`` of the logits gradient of ``sparsemixer_route(top_k=k)``.

    For a tuple ``D`` and coin outcomes ``c`` (``c_t`` = expert ``t`` took the reduced-weight
    branch, chance ``q_t``: the estimator's coin probability, 0 on the argmax of ``pi^(t)``
    unless the rule applies there too), the output is ``y = sum_t w(c_t) pi^(t)_{D_t} f_{D_t}``
    and the router's backward sends ``s * g'(y) . f_{D_t}`` to ``pi^(t)_{D_t}`` (``s`` the
    backward scale). The expectation sums this over every tuple and coin outcome, weighted by
    their probabilities. Written from that description, not from the router's code, so the
    Monte-Carlo tests compare two implementations.
    """
    rule = ESTIMATORS[estimator]
    reduced_prob = rule.reduced_prob if midpoint_prob is None else midpoint_prob
    scale = rule.backward_scale if backward_scale is None else backward_scale
    tuples = jnp.asarray(ordered_tuples(problem.logits.shape[-1], top_k))
    coins = jnp.asarray(list(itertools.product([False, True], repeat=top_k)))  # [2^k, k]
    z = problem.logits

    def one(chosen):
        step_probs = _step_probs(probs_fn, z, chosen)  # [k, N]
        gates = step_probs[jnp.arange(top_k), chosen]
        jac = jax.jacobian(_tuple_gates, argnums=1)(probs_fn, z, chosen)  # [k, N]
        is_top = jnp.argmax(step_probs, axis=-1) == chosen
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
    probs, jac = _jacobian(problem, probs_fn)

    def one(chosen):
        gates = _tuple_gates(probs_fn, z, chosen)
        gate_jac = jax.jacobian(_tuple_gates, argnums=1)(probs_fn, z, chosen)  # [k, N]
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


TOPK_ESTIMATORS = ("backprop", "mix", "v2", "v2star")
ORACLE_DEFAULT_ESTIMATORS = ("default_moe_oracle", "default_moe_st_oracle")
TOPK_TABLE = TOPK_ESTIMATORS + DENSE_ESTIMATORS + ORACLE_DEFAULT_ESTIMATORS


def topk_accuracy_sweep(
    problem: RoutingProblem, scales, probs_fn: ProbsFn, top_k: int,
    estimators=TOPK_TABLE, defaults: jax.Array | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Norm ratio, cosine and relative error (the bias) of each estimator's expected gradient
    against the exact top-k gradient as the expert outputs shrink.

    ``backprop`` is plain backpropagation through the gates of the sampled experts (its
    expectation is exactly ``nabla_1``). The Default MoE rows use ``defaults [N, d]`` (at scale
    1, scaled with the outputs; ``None``: oracle), their ``*_oracle`` rows ``v = f``. Returns
    ``{estimator: {metric: [one per scale]}}`` with metrics ``norm_ratio`` (``|E| / |exact|``),
    ``cos`` and ``relerr`` (``|E - exact| / |exact|``).
    """
    defaults = problem.expert_outputs if defaults is None else defaults

    @jax.jit
    def measure(scale):
        scaled = problem.scaled(scale)
        exact = exact_topk_gradient(scaled, probs_fn, top_k)
        out = {}
        for name in estimators:
            if name == "backprop":
                estimate = exact.nabla1
            elif name in ORACLE_DEFAULT_ESTIMATORS:
                estimate = topk_dense_expected_gradient(
                    scaled, probs_fn, top_k, name.removesuffix("_oracle"))
            elif name in DENSE_ESTIMATORS:
                estimate = topk_dense_expected_gradient(
                    scaled, probs_fn, top_k, name, scale * defaults)
            else:
                estimate = topk_expected_gradient(scaled, probs_fn, top_k, estimator=name)
            out[name] = {
                "norm_ratio": jnp.linalg.norm(estimate) / jnp.linalg.norm(exact.full),
                "cos": cosine_similarity(estimate, exact.full),
                "relerr": relative_error(estimate, exact.full),
            }
        return out

    rows = [jax.device_get(measure(s)) for s in scales]
    return {
        name: {metric: [float(r[name][metric]) for r in rows] for metric in rows[0][name]}
        for name in rows[0]
    }


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine of the angle between two gradient vectors (0 when either is zero)."""
    denom = jnp.linalg.norm(a) * jnp.linalg.norm(b)
    return jnp.where(denom > 0, jnp.dot(a, b) / jnp.where(denom > 0, denom, 1.0), 0.0)


def relative_error(estimate: jax.Array, target: jax.Array) -> jax.Array:
    """``||estimate - target|| / ||target||``."""
    return jnp.linalg.norm(estimate - target) / jnp.linalg.norm(target)


def loglog_slope(scales, errors) -> float:
    """Least-squares slope of ``log(error)`` against ``log(scale)``: the order of accuracy."""
    x = np.log(np.asarray(scales, dtype=np.float64))
    y = np.log(np.asarray(errors, dtype=np.float64))
    x_c = x - x.mean()
    return float(np.sum(x_c * (y - y.mean())) / np.sum(x_c * x_c))


def accuracy_sweep(
    problem: RoutingProblem, scales, probs_fn: ProbsFn, defaults: jax.Array | None = None
) -> dict[str, dict[str, list[float]]]:
    """Cosine similarity and relative error of every estimator as the expert outputs shrink.

    Returns ``{estimator: {metric: [one value per scale]}}`` for the metrics ``cos_nabla0``,
    ``relerr_nabla0``, ``cos_full`` and ``relerr_full``.
    The ``nabla_0`` columns compare ``estimate - nabla_1`` with ``nabla_0``. Default MoE's
    ``defaults [N, d]`` are given at scale 1 and scaled with the outputs (``None``: oracle).
    """
    defaults = problem.expert_outputs if defaults is None else defaults

    @jax.jit
    def measure(scale):
        scaled = problem.scaled(scale)
        exact = exact_gradient(scaled, probs_fn)
        out = {}
        for name, estimate in estimator_table(scaled, probs_fn, scale * defaults).items():
            part0 = estimate - exact.nabla1
            out[name] = {
                "cos_nabla0": cosine_similarity(part0, exact.nabla0),
                "relerr_nabla0": relative_error(part0, exact.nabla0),
                "cos_full": cosine_similarity(estimate, exact.full),
                "relerr_full": relative_error(estimate, exact.full),
            }
        return out

    rows = [jax.device_get(measure(s)) for s in scales]
    return {
        name: {metric: [float(r[name][metric]) for r in rows] for metric in rows[0][name]}
        for name in rows[0]
    }


# ------------------------------------------------------- the accuracy experiment over problems

ESTIMATOR_NOTES = {
    "switch": "backprop only (nabla_0 dropped)",
    "euler": "SparseMixer-1st (forward Euler)",
    "midpoint": "mid-point rule for nabla_0 + exact nabla_1",
    "sparsemixer_2nd": "router estimator='midpoint' (mid-point on both terms)",
    "sparsemixer": "router default: reference mix, fair coin",
    "sparsemixer_paper": "router midpoint_prob=1 (paper's text)",
    "densemixer": "DenseMixer as released: g'(y).f_j to every pi_j",
    "densemixer_blog": "DenseMixer's blog: (pi_j + TopK_j) on f_j",
    "default_moe": "Default MoE, defaults added to the output; noisy defaults",
    "default_moe_st": "Default MoE straight-through; noisy defaults",
    "default_moe_oracle": "default_moe with oracle defaults v = f",
    "default_moe_st_oracle": "default_moe_st with oracle defaults (= densemixer)",
}
METRICS = ("relerr_nabla0", "cos_nabla0", "relerr_full", "cos_full")


@dataclasses.dataclass
class SweepSettings:
    """The problems and scales of :func:`accuracy_experiment`: ``num_problems`` random problems
    of ``num_experts`` experts with outputs of dimension ``dim``, router probabilities under
    ``mask`` with ``jitter_eps``; ``num_scales`` output scales from 1 down to ``min_scale``,
    slopes fitted on the scales <= ``fit_below`` (the asymptotic regime); top-k sweeps for each
    ``top_k`` (empty: none); Default MoE's defaults with noise ``default_noise``
    (:func:`noisy_defaults`)."""

    num_problems: int = 16
    num_experts: int = 8
    dim: int = 16
    mask: str = "none"
    jitter_eps: float = 0.1
    min_scale: float = 1e-3
    num_scales: int = 13
    fit_below: float = 0.1
    seed: int = 0
    top_k: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    default_noise: float = 0.5

    def __post_init__(self) -> None:
        if self.num_problems < 1 or self.num_experts < 2 or self.dim < 1:
            raise ValueError("need --num-problems >= 1, --num-experts >= 2 and --dim >= 1")
        if not 0 < self.min_scale < 1 or self.num_scales < 3:
            raise ValueError("need 0 < --min-scale < 1 and --num-scales >= 3")
        if any(not 1 <= k <= self.num_experts for k in self.top_k):
            raise ValueError(f"--top-k values must lie in [1, --num-experts={self.num_experts}]")
        if not self.default_noise >= 0:
            raise ValueError(f"--default-noise must be >= 0, got {self.default_noise}")
        if (self.scales() <= self.fit_below * (1 + 1e-9)).sum() < 2:
            raise ValueError(f"--fit-below {self.fit_below} leaves fewer than 2 scales to fit")

    def scales(self) -> np.ndarray:
        return np.logspace(0.0, math.log10(self.min_scale), self.num_scales)


def accuracy_experiment(settings: SweepSettings) -> dict:
    """Every estimator's accuracy on ``settings.num_problems`` random problems as the expert
    outputs shrink (:func:`accuracy_sweep`), and on the same problems routed top-k
    (:func:`topk_accuracy_sweep`) for each ``settings.top_k``; summarised with geometric means
    and per-problem slopes. Computed in float64: errors reach 1e-9, where float32 would hide the
    mid-point's order."""
    with jax.enable_x64(True):
        return _accuracy_experiment(settings)


def _accuracy_experiment(settings: SweepSettings) -> dict:
    scales = settings.scales()
    fit = scales <= settings.fit_below * (1 + 1e-9)

    def probs_fn(z):
        return router_probs(z, settings.jitter_eps, settings.mask)

    keys = jax.random.split(jax.random.key(settings.seed), settings.num_problems)
    problems = [random_problem(k, settings.num_experts, settings.dim) for k in keys]
    defaults = [
        noisy_defaults(p.expert_outputs, jax.random.fold_in(k, 1), settings.default_noise)
        for p, k in zip(problems, keys, strict=True)
    ]
    sweeps = [accuracy_sweep(p, scales, probs_fn, v) for p, v in zip(problems, defaults,
                                                                      strict=True)]
    summary = {}
    for name in sweeps[0]:
        entry = {"note": ESTIMATOR_NOTES.get(name, "")}
        for metric in METRICS:
            values = np.array([s[name][metric] for s in sweeps])  # [problems, scales]
            if metric.startswith("relerr"):
                entry[metric] = np.exp(np.log(values).mean(0)).tolist()  # geometric mean
                slopes = [loglog_slope(scales[fit], v[fit]) for v in values]
                term = metric.removeprefix("relerr_")
                entry[f"slope_{term}"] = float(np.mean(slopes))
                entry[f"slope_{term}_std"] = float(np.std(slopes))
            else:
                entry[metric] = values.mean(0).tolist()
        summary[name] = entry
    return {
        "scales": scales.tolist(),
        "fit_scales": scales[fit].tolist(),
        "settings": dataclasses.asdict(settings),
        "estimators": summary,
        "topk": {
            str(k): _topk_summary(problems, defaults, scales, fit, probs_fn, k)
            for k in settings.top_k
        },
    }


def _topk_summary(problems, defaults, scales, fit, probs_fn, top_k: int) -> dict:
    """Per estimator: mean norm ratio and cosine, geometric-mean bias and its slope."""
    sweeps = [
        topk_accuracy_sweep(p, scales, probs_fn, top_k, defaults=v)
        for p, v in zip(problems, defaults, strict=True)
    ]
    summary = {}
    for name in sweeps[0]:
        norm = np.array([s[name]["norm_ratio"] for s in sweeps])  # [problems, scales]
        cos = np.array([s[name]["cos"] for s in sweeps])
        err = np.array([s[name]["relerr"] for s in sweeps])
        slopes = [loglog_slope(scales[fit], e[fit]) for e in err]
        summary[name] = {
            "norm_ratio": norm.mean(0).tolist(),
            "norm_ratio_std": norm.std(0).tolist(),
            "cos": cos.mean(0).tolist(),
            "relerr": np.exp(np.log(err).mean(0)).tolist(),
            "slope": float(np.mean(slopes)),
            "slope_std": float(np.std(slopes)),
        }
    return summary
