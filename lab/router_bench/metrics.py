"""What is measured: partition agreement with the teacher, the exact router gradient of the
student's objective (for its cosine with the realised one), and paired statistics over seeds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import linear_sum_assignment

# The exact-gradient oracle. Imported here only, so that renaming the module is one line.
from sparsemixer_jax import exact as oracle
from sparsemixer_jax.moe.dispatch import expert_ffn
from sparsemixer_jax.routers import ROUTERS, router_probs, switch_route


def confusion(student: jax.Array, teacher: jax.Array, n: int, k: int) -> jax.Array:
    """Counts ``[N, K]`` of (student, teacher) expert pairs over tokens ``student, teacher [B]``."""
    return jax.nn.one_hot(student, n, dtype=jnp.float32).T @ jax.nn.one_hot(
        teacher, k, dtype=jnp.float32)


def partition_agreement(counts: np.ndarray) -> float:
    """Share of tokens on which student and teacher agree under the best one-to-one matching of
    experts (Hungarian, ``linear_sum_assignment``) of a confusion matrix ``[N, K]``, N >= K."""
    counts = np.asarray(counts, np.float64)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return float(counts[rows, cols].sum() / max(counts.sum(), 1.0))


def partition_purity(counts: np.ndarray) -> float:
    """Share of tokens whose student expert's majority teacher expert is their own: the best
    many-to-one matching. With N > K a student may split a teacher region among experts at no
    cost; purity counts that as agreement, the one-to-one matching does not."""
    counts = np.asarray(counts, np.float64)
    return float(counts.max(axis=1).sum() / max(counts.sum(), 1.0))


class MSEProblem(oracle.RoutingProblem):
    """The oracle's routing problem with the student's per-token loss as the downstream
    function: ``g(y) = mean((omega * y - target)^2)``, ``omega`` in ``weight`` (diagonal) and
    ``target`` in ``bias``."""

    def downstream(self, y: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(self.weight @ y - self.bias))


def oracle_probs_fn(router: str, jitter_eps: float) -> oracle.ProbsFn:
    """The distribution the arm's objective samples from, ``logits [N] -> probs [N]``: the masked
    softmax with the arm's mask for SparseMixer; the plain softmax for every router with Switch's
    forward (``switch_route``: Switch, DenseMixer, Default MoE), whose jittered argmax has no
    closed form."""
    route, options = ROUTERS[router]
    mask = "none" if route is switch_route else options.get("mask", "reference")
    return lambda z: router_probs(z, jitter_eps, mask)


def exact_router_grad(logits: jax.Array, x: jax.Array, target: jax.Array,
                      expert_params: tuple, omega: jax.Array | None, probs_fn
                      ) -> tuple[jax.Array, jax.Array]:
    """Exact gradient of ``mean_tokens E_{D ~ pi} g(pi_D f_D(x))`` w.r.t. the router's kernel
    ``[d, N]`` and bias ``[N]``, every expert evaluated (top-1, one layer).

    Args: ``logits [B, N]``, ``x [B, d]``, ``target [B, d]``, ``expert_params`` the layer's
    ``(wi, bi, wo, bo)``, ``omega [d]`` or None.
    """
    batch, dim = x.shape
    n = logits.shape[-1]
    rows = jnp.repeat(x, n, axis=0)  # row b * n + i: token b through expert i
    group = jnp.tile(jnp.arange(n, dtype=jnp.int32), batch)
    outputs = expert_ffn(rows, group, jnp.arange(batch * n, dtype=jnp.int32), expert_params,
                         dispatch="padded").reshape(batch, n, dim)
    weight = jnp.diag(jnp.ones((dim,)) if omega is None else omega)

    def per_token(z, f, t):
        return oracle.exact_gradient(MSEProblem(z, f, weight, t), probs_fn).full

    grad_z = jax.vmap(per_token)(logits, outputs, target) / batch  # mean over tokens
    return x.T @ grad_z, jnp.sum(grad_z, axis=0)


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine of two flattened gradients (0 when either is zero)."""
    return oracle.cosine_similarity(a.reshape(-1), b.reshape(-1))


class Paired(NamedTuple):
    """Mean of per-seed differences ``arm - baseline``, its standard error, how many seeds the
    difference is negative, and how many seeds."""

    mean: float
    se: float
    below: int
    n: int

    def fmt(self, digits: int = 3) -> str:
        return f"{self.mean:+.{digits}f} ± {self.se:.{digits}f}"


def paired(arm: np.ndarray, baseline: np.ndarray) -> Paired:
    """Paired difference over seeds (same teacher, data and init per seed); NaN pairs dropped.
    ``se = std(d, ddof=1) / sqrt(n)``."""
    d = np.asarray(arm, np.float64) - np.asarray(baseline, np.float64)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return Paired(math.nan, math.nan, 0, 0)
    se = float(np.std(d, ddof=1) / np.sqrt(d.size)) if d.size > 1 else math.nan
    return Paired(float(d.mean()), se, int((d < 0).sum()), int(d.size))


def mean_se(values: np.ndarray) -> tuple[float, float]:
    """Mean and standard error over seeds (finite values only)."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan
    return float(v.mean()), float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size > 1 else math.nan


def steps_to_threshold(curves: np.ndarray, steps: np.ndarray, threshold: float) -> np.ndarray:
    """First logged step at which each seed's curve ``[S, E]`` is ``<= threshold``: ``[S]``,
    NaN for seeds that never reach it."""
    hit = np.asarray(curves) <= threshold
    first = np.argmax(hit, axis=1)
    return np.where(hit.any(axis=1), np.asarray(steps)[first], np.nan)
