"""The top-1 routing problem and its exact gradient, by enumeration; SparseMixer's expected
gradients; the accuracy measures (see :mod:`sparsemixer_jax.exact`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.routers import Estimator, router_probs

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


def directional_slopes(problem: RoutingProblem, probs: jax.Array, at: float) -> jax.Array:
    """``g'(at * pi_i f_i) . f_i`` for every expert: ``[N]``."""

    def slope(point, direction):
        return jax.jvp(problem.downstream, (point,), (direction,))[1]

    points = at * probs[:, None] * problem.expert_outputs
    return jax.vmap(slope)(points, problem.expert_outputs)


def probs_and_jacobian(problem: RoutingProblem, probs_fn: ProbsFn) -> tuple[jax.Array, jax.Array]:
    """``pi [N]`` and ``J = dpi/dtheta [N, N]`` (row i is ``dpi_i/dtheta``)."""
    return probs_fn(problem.logits), jax.jacobian(probs_fn)(problem.logits)


def exact_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn = lambda z: router_probs(z, mask="none"),
    sample_probs_fn: ProbsFn | None = None,
) -> ExactGradient:
    """``L``, ``nabla_0`` and ``nabla_1`` by enumerating every expert.

    ``sample_probs_fn`` is the distribution ``q`` that ``D`` is drawn from when it is not the
    gates' ``pi = probs_fn`` (a selection-only bias): ``L = sum_i q_i g(pi_i f_i)``,
    ``nabla_0 = sum_i g(pi_i f_i) dq_i``, ``nabla_1 = sum_i q_i g'(pi_i f_i) . f_i dpi_i``.
    """
    probs, jac = probs_and_jacobian(problem, probs_fn)
    sample, sample_jac = (probs, jac) if sample_probs_fn is None else probs_and_jacobian(
        problem, sample_probs_fn)
    values = jax.vmap(problem.downstream)(probs[:, None] * problem.expert_outputs)
    return ExactGradient(
        loss=jnp.sum(sample * values),
        nabla0=sample_jac.T @ values,
        nabla1=jac.T @ (sample * directional_slopes(problem, probs, 1.0)),
    )


def estimator_coefficients(
    problem: RoutingProblem, probs_fn: ProbsFn
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(e, m, is_top, J)``: Euler and mid-point coefficients ``[N]``, argmax mask, Jacobian."""
    probs, jac = probs_and_jacobian(problem, probs_fn)
    euler = probs * directional_slopes(problem, probs, 1.0)
    midpoint = probs * directional_slopes(problem, probs, 0.5)
    is_top = jnp.arange(probs.shape[-1]) == jnp.argmax(probs)
    return euler, midpoint, is_top, jac


def midpoint_chance(estimator: str, is_top: jax.Array, midpoint_prob: float) -> jax.Array:
    """Each expert's chance ``[N]`` of the mid-point branch under a top-1 ``estimator``: 0
    (``"euler"``), 1 (``"midpoint"``), or ``midpoint_prob`` off the argmax and 0 on it
    (``"mix"``); ``is_top`` bool ``[N]`` marks the argmax."""
    if estimator == "euler":
        return jnp.zeros(is_top.shape)
    if estimator == "midpoint":
        return jnp.ones(is_top.shape)
    if estimator == "mix":
        return jnp.where(is_top, 0.0, midpoint_prob)
    raise ValueError(f"unknown estimator {estimator!r}; expected 'mix', 'euler' or 'midpoint'")


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
    q = midpoint_chance(estimator, is_top, midpoint_prob)
    return jac.T @ (backward_scale * ((1.0 - q) * euler + q * midpoint))


def selection_bias_expected_gradient(
    problem: RoutingProblem,
    probs_fn: ProbsFn,
    sample_probs_fn: ProbsFn,
    *,
    estimator: Estimator = "mix",
    midpoint_prob: float = 0.5,
    single_path: bool = False,
) -> jax.Array:
    """Exact expectation of the logits gradient of ``sparsemixer_route(...,
    selection_bias=b)``: ``D ~ q = sample_probs_fn``, gate ``pi_D``, ``pi = probs_fn``.

    With ``u_i(w) = g'(w pi_i f_i) . f_i`` and ``r_i`` the chance of the mid-point branch
    (as in :func:`router_expected_gradient`; the argmax is that of ``q``), the two-path
    estimator's expectation is (docs/routing.md)

        J_pi^T (q * a) + J_q^T (pi * m),
        a_i = u_i(1) unless r_i = 1 (then u_i(1/2)),  m_i = u_i(1) if r_i = 0 else u_i(1/2):

    exact ``nabla_1`` and the mid-point estimate of ``nabla_0`` wherever a coin is flipped.
    ``single_path=True``: the released backward applied under the bias (both terms along
    ``grad pi_D``, scale 2), ``J_pi^T (q * 2 ((1 - r) u(1) + r u(1/2)))``, which is wrong.
    """
    probs, jac = probs_and_jacobian(problem, probs_fn)
    sample, sample_jac = probs_and_jacobian(problem, sample_probs_fn)
    full = directional_slopes(problem, probs, 1.0)
    half = directional_slopes(problem, probs, 0.5)
    is_top = jnp.arange(sample.shape[-1]) == jnp.argmax(sample)
    r = midpoint_chance(estimator, is_top, midpoint_prob)
    if single_path:
        return jac.T @ (sample * 2.0 * ((1.0 - r) * full + r * half))
    gate_term = jnp.where(r == 1.0, half, full)
    selection_term = jnp.where(r == 0.0, full, half)
    return jac.T @ (sample * gate_term) + sample_jac.T @ (probs * selection_term)


def midpoint_rule_gradient(problem: RoutingProblem, probs_fn: ProbsFn) -> jax.Array:
    """``nabla_1 + `` the mid-point estimate of ``nabla_0`` on every expert (argmax included).

    This is the paper's second-order claim in isolation: its ``nabla_0`` part, ``J^T m``, is the
    mid-point rule of Section 3.4; ``nabla_1`` is what ordinary backpropagation gives. The
    reference mix computes exactly this on non-argmax tokens.
    """
    euler, midpoint, _, jac = estimator_coefficients(problem, probs_fn)
    return jac.T @ (euler + midpoint)


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
