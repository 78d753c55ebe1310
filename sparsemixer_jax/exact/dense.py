"""Exact expected router gradients of DenseMixer and Default MoE, top-1, under a sampled forward
(see :mod:`sparsemixer_jax.exact`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparsemixer_jax.exact.top1 import ProbsFn, RoutingProblem, probs_and_jacobian


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


def outcome_slopes(
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
    probs, jac = probs_and_jacobian(problem, probs_fn)
    f = problem.expert_outputs
    slopes = outcome_slopes(problem, probs[:, None] * f, f)  # [D, j]
    return jac.T @ (probs @ slopes)


def densemixer_blog_gradient(problem: RoutingProblem, probs_fn: ProbsFn) -> jax.Array:
    """Exact expectation ``[N]`` of DenseMixer's router gradient as its blog writes it.

    The blog's straight-through rule gives ``E_j(x)`` the coefficient ``pi_j + TopK_j`` on
    ``dpi_j``: a chosen expert gets the ordinary ``g'(y) . f_j`` plus ``pi_j g'(y) . f_j``, an
    unchosen one ``pi_j g'(y) . f_j``. With ``D ~ pi`` (top-1, sampled) and ``y = pi_D f_D``:

        c_j = pi_j sum_D pi_D g'(pi_D f_D) . f_j + pi_j g'(pi_j f_j) . f_j,   gradient J^T c.
    """
    probs, jac = probs_and_jacobian(problem, probs_fn)
    f = problem.expert_outputs
    slopes = outcome_slopes(problem, probs[:, None] * f, f)  # [D, j]
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
    own = jnp.diagonal(outcome_slopes(problem, outputs, f))  # g'(y_j) . f_j
    to_defaults = outcome_slopes(problem, outputs, defaults)  # [D, j]: g'(y_D) . v_j
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
    probs, jac = probs_and_jacobian(problem, probs_fn)
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
    probs, jac = probs_and_jacobian(problem, probs_fn)
    return jac.T @ _default_moe_coefficients(problem, probs, defaults, add_defaults=False)
