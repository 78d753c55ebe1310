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

Selection bias (top-1): ``D ~ q`` with ``q`` the masked softmax of ``theta + b`` and the gate
``pi_D`` (:func:`sparsemixer_jax.routers.selection_probs`): ``L = sum_i q_i g(pi_i f_i)``,
``nabla_0 = sum_i g(pi_i f_i) dq_i``, ``nabla_1 = sum_i q_i g'(pi_i f_i) . f_i dpi_i``
(:func:`exact_gradient` with ``sample_probs_fn``); the router's two-path estimators' expectations
and the released single path's: :func:`selection_bias_expected_gradient`.

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

Names of the Default MoE oracles: :func:`default_moe_gradient` (row ``default_moe`` of the
tables) has the defaults in the forward, the router ``default_moe_forward``;
:func:`default_moe_st_gradient` (row ``default_moe_st``) has them in the backward only, the
router ``default_moe`` (also called ``default_moe_st``).

Sigmoid scores (:mod:`~sparsemixer_jax.exact.sigmoid`): ``D`` drawn from ``q`` proportional
to ``sigmoid(theta) + b`` (:func:`sparsemixer_jax.routers.sigmoid_sample_probs`), gates
``c s_{D_t} / sum_u s_{D_u}``: :func:`exact_sigmoid_gradient`, the router's expectation and two
wrong variants' (:func:`sigmoid_expected_gradient`), and the mid-point rule on every tuple
(:func:`sigmoid_midpoint_rule_gradient`).

One module per concern; import the names from this package: ``top1`` (the problem, the exact
gradient, SparseMixer's expectations, the measures), ``dense`` (DenseMixer, Default MoE) and
``topk`` (ordered tuples).

The accuracy experiment (the sweeps: :func:`lab.exact_experiment.accuracy_experiment`, ``python
-m experiments.gradient_accuracy``; part of the repository's lab, not of the library) scales the
expert outputs by ``s`` from 1 down to ``min_scale`` on random problems: the slope of
log(relative error) against log(s) is an estimator's order of accuracy (the paper claims 1 for
forward Euler and 2 for the mid-point rule); top-k, the norm ratio, cosine and bias against the
exact top-k gradient.
"""

from __future__ import annotations

from sparsemixer_jax.exact.dense import (
    default_moe_gradient,
    default_moe_st_gradient,
    densemixer_blog_gradient,
    densemixer_gradient,
    noisy_defaults,
    outcome_slopes,
)
from sparsemixer_jax.exact.sigmoid import (
    exact_sigmoid_gradient,
    greedy_set,
    sigmoid_expected_gradient,
    sigmoid_gates_fn,
    sigmoid_midpoint_rule_gradient,
    sigmoid_sampling_fn,
    tuple_terms,
)
from sparsemixer_jax.exact.top1 import (
    Downstream,
    ExactGradient,
    ProbsFn,
    RoutingProblem,
    cosine_similarity,
    directional_slopes,
    estimator_coefficients,
    exact_gradient,
    loglog_slope,
    midpoint_rule_gradient,
    probs_and_jacobian,
    random_problem,
    relative_error,
    router_expected_gradient,
    selection_bias_expected_gradient,
)
from sparsemixer_jax.exact.topk import (
    DENSE_ESTIMATORS,
    exact_topk_gradient,
    ordered_tuples,
    step_probs,
    topk_dense_expected_gradient,
    topk_expected_gradient,
    topk_selection_bias_expected_gradient,
    tuple_gates,
)

__all__ = [
    "DENSE_ESTIMATORS",
    "Downstream",
    "ExactGradient",
    "ProbsFn",
    "RoutingProblem",
    "cosine_similarity",
    "default_moe_gradient",
    "default_moe_st_gradient",
    "densemixer_blog_gradient",
    "densemixer_gradient",
    "directional_slopes",
    "estimator_coefficients",
    "exact_gradient",
    "exact_sigmoid_gradient",
    "exact_topk_gradient",
    "greedy_set",
    "loglog_slope",
    "midpoint_rule_gradient",
    "noisy_defaults",
    "ordered_tuples",
    "outcome_slopes",
    "probs_and_jacobian",
    "random_problem",
    "relative_error",
    "router_expected_gradient",
    "selection_bias_expected_gradient",
    "sigmoid_expected_gradient",
    "sigmoid_gates_fn",
    "sigmoid_midpoint_rule_gradient",
    "sigmoid_sampling_fn",
    "step_probs",
    "topk_dense_expected_gradient",
    "topk_expected_gradient",
    "topk_selection_bias_expected_gradient",
    "tuple_gates",
    "tuple_terms",
]
