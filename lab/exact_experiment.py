"""The accuracy experiment: every estimator against the exact gradient as the expert outputs
shrink (``python -m experiments.gradient_accuracy``; the oracle it measures against is
:mod:`sparsemixer_jax.exact`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.exact.dense import (
    default_moe_gradient,
    default_moe_st_gradient,
    densemixer_blog_gradient,
    densemixer_gradient,
    noisy_defaults,
)
from sparsemixer_jax.exact.sigmoid import (
    exact_sigmoid_gradient,
    sigmoid_expected_gradient,
    sigmoid_midpoint_rule_gradient,
    sigmoid_sampling_fn,
    tuple_terms,
)
from sparsemixer_jax.exact.top1 import (
    ProbsFn,
    RoutingProblem,
    cosine_similarity,
    directional_slopes,
    exact_gradient,
    loglog_slope,
    midpoint_rule_gradient,
    random_problem,
    relative_error,
    router_expected_gradient,
    selection_bias_expected_gradient,
)
from sparsemixer_jax.exact.topk import (
    DENSE_ESTIMATORS,
    exact_topk_gradient,
    topk_dense_expected_gradient,
    topk_expected_gradient,
)
from sparsemixer_jax.routers import limit_to_groups, router_probs, selection_probs


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


def selection_bias_table(
    problem: RoutingProblem, probs_fn: ProbsFn, sampling_fn: ProbsFn
) -> dict[str, jax.Array]:
    """Expected full router gradient ``[N]`` of SparseMixer's estimators under a selection bias
    (``D ~ q = sampling_fn``, gate ``pi_D``, ``pi = probs_fn``), by name: the rows of
    :func:`estimator_table` that sample (DenseMixer and Default MoE route deterministically),
    with the two-path backward, and ``sparsemixer_single_path``, the released backward under the
    bias. ``midpoint`` is exact ``nabla_1`` plus the mid-point rule on every expert."""
    exact = exact_gradient(problem, probs_fn, sampling_fn)
    probs = probs_fn(problem.logits)
    selection = jax.jacobian(sampling_fn)(problem.logits).T @ (
        probs * directional_slopes(problem, probs, 0.5))

    def two_path(estimator, **options):
        return selection_bias_expected_gradient(problem, probs_fn, sampling_fn,
                                                estimator=estimator, **options)

    return {
        "switch": exact.nabla1,
        "euler": two_path("euler"),
        "midpoint": exact.nabla1 + selection,
        "sparsemixer_2nd": two_path("midpoint"),
        "sparsemixer": two_path("mix"),
        "sparsemixer_paper": two_path("mix", midpoint_prob=1.0),
        "sparsemixer_single_path": two_path("mix", single_path=True),
    }


def sigmoid_table(problem: RoutingProblem, sampling_fn: ProbsFn, top_k: int,
                  scale: float) -> dict[str, jax.Array]:
    """Expected full router gradient ``[N]`` of SparseMixer's estimators under sigmoid scores
    (``D ~ q = sampling_fn``, gates ``scale * s_D / sum_chosen s``, top-k sequential), by
    name: :func:`estimator_table`'s sampled rows with the two-path backward over the set, GRIN's
    ``v2`` and ``v2star``, and two wrong variants: ``sparsemixer_per_step`` (each gate's share
    along its own step's ``grad log q^(t)`` only) and ``sparsemixer_single_path`` (the released
    backward: everything along the gates)."""
    exact = exact_sigmoid_gradient(problem, sampling_fn, top_k, scale)
    terms = tuple_terms(problem, sampling_fn, top_k, scale)  # shared by every row

    def two_path(estimator="mix", **options):
        return sigmoid_expected_gradient(problem, sampling_fn, top_k, estimator=estimator,
                                         scale=scale, terms=terms, **options)

    return {
        "switch": exact.nabla1,
        "euler": two_path("euler"),
        "midpoint": sigmoid_midpoint_rule_gradient(problem, sampling_fn, top_k, scale, terms),
        "sparsemixer_2nd": two_path("midpoint"),
        "sparsemixer": two_path(),
        "sparsemixer_paper": two_path(midpoint_prob=1.0),
        "v2": two_path("v2"),
        "v2star": two_path("v2star"),
        "sparsemixer_per_step": two_path(variant="per_step"),
        "sparsemixer_single_path": two_path(variant="single_path"),
    }


TOPK_ESTIMATORS = ("backprop", "mix", "v2", "v2star")


ORACLE_DEFAULT_ESTIMATORS = ("default_moe_oracle", "default_moe_st_oracle")


TOPK_TABLE = TOPK_ESTIMATORS + DENSE_ESTIMATORS + ORACLE_DEFAULT_ESTIMATORS


def _per_scale(measure, scales) -> dict[str, dict[str, list[float]]]:
    """``measure(scale) -> {estimator: {metric: value}}`` over ``scales``, as
    ``{estimator: {metric: [one value per scale]}}``."""
    rows = [jax.device_get(measure(s)) for s in scales]
    return {
        name: {metric: [float(r[name][metric]) for r in rows] for metric in rows[0][name]}
        for name in rows[0]
    }


def topk_accuracy_sweep(
    problem: RoutingProblem, scales, probs_fn: ProbsFn, top_k: int,
    estimators=TOPK_TABLE, defaults: jax.Array | None = None,
    sampling_fn: ProbsFn | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Norm ratio, cosine and relative error (the bias) of each estimator's expected gradient
    against the exact top-k gradient as the expert outputs shrink.

    ``backprop`` is plain backpropagation through the gates of the sampled experts (its
    expectation is exactly ``nabla_1``). The Default MoE rows use ``defaults [N, d]`` (at scale
    1, scaled with the outputs; ``None``: oracle), their ``*_oracle`` rows ``v = f``. Returns
    ``{estimator: {metric: [one per scale]}}`` with metrics ``norm_ratio`` (``|E| / |exact|``),
    ``cos`` and ``relerr`` (``|E - exact| / |exact|``). ``sampling_fn``: a selection bias's
    sampling distribution (SparseMixer's rows and ``backprop`` only).
    """
    defaults = problem.expert_outputs if defaults is None else defaults
    if sampling_fn is not None:
        estimators = TOPK_ESTIMATORS

    @jax.jit
    def measure(scale):
        scaled = problem.scaled(scale)
        exact = exact_topk_gradient(scaled, probs_fn, top_k, sampling_fn)
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
                estimate = topk_expected_gradient(scaled, probs_fn, top_k, estimator=name,
                                                  sample_probs_fn=sampling_fn)
            out[name] = {
                "norm_ratio": jnp.linalg.norm(estimate) / jnp.linalg.norm(exact.full),
                "cos": cosine_similarity(estimate, exact.full),
                "relerr": relative_error(estimate, exact.full),
            }
        return out

    return _per_scale(measure, scales)


def accuracy_sweep(
    problem: RoutingProblem, scales, probs_fn: ProbsFn | None,
    defaults: jax.Array | None = None, sampling_fn: ProbsFn | None = None,
    sigmoid: tuple[int, float] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Cosine similarity and relative error of every estimator as the expert outputs shrink.

    Returns ``{estimator: {metric: [one value per scale]}}`` for the metrics ``cos_nabla0``,
    ``relerr_nabla0``, ``cos_full`` and ``relerr_full``.
    The ``nabla_0`` columns compare ``estimate - nabla_1`` with ``nabla_0``. Default MoE's
    ``defaults [N, d]`` are given at scale 1 and scaled with the outputs (``None``: oracle).
    ``sampling_fn``: a selection bias's sampling distribution (:func:`selection_bias_table`).
    ``sigmoid = (top_k, c)``: sigmoid scores, ``sampling_fn`` their ``q`` (:func:`sigmoid_table`).
    """
    defaults = problem.expert_outputs if defaults is None else defaults

    @jax.jit
    def measure(scale):
        scaled = problem.scaled(scale)
        if sigmoid is not None:
            exact = exact_sigmoid_gradient(scaled, sampling_fn, *sigmoid)
            table = sigmoid_table(scaled, sampling_fn, *sigmoid)
        else:
            exact = exact_gradient(scaled, probs_fn, sampling_fn)
            table = (estimator_table(scaled, probs_fn, scale * defaults) if sampling_fn is None
                     else selection_bias_table(scaled, probs_fn, sampling_fn))
        out = {}
        for name, estimate in table.items():
            part0 = estimate - exact.nabla1
            out[name] = {
                "cos_nabla0": cosine_similarity(part0, exact.nabla0),
                "relerr_nabla0": relative_error(part0, exact.nabla0),
                "cos_full": cosine_similarity(estimate, exact.full),
                "relerr_full": relative_error(estimate, exact.full),
            }
        return out

    return _per_scale(measure, scales)


ESTIMATOR_NOTES = {
    "switch": "backprop only (nabla_0 dropped)",
    "euler": "SparseMixer-1st (forward Euler)",
    "midpoint": "mid-point rule for nabla_0 + exact nabla_1",
    "sparsemixer_2nd": "router estimator='midpoint' (mid-point on both terms)",
    "sparsemixer": "router default: reference mix, fair coin",
    "sparsemixer_paper": "router midpoint_prob=1 (paper's text)",
    "densemixer": "DenseMixer as released: g'(y).f_j to every pi_j",
    "densemixer_blog": "DenseMixer's blog: (pi_j + TopK_j) on f_j",
    "default_moe": "Default MoE, defaults in the forward (router default_moe_forward); noisy",
    "default_moe_st": "Default MoE, defaults in the backward only (router default_moe); noisy",
    "default_moe_oracle": "default_moe with oracle defaults v = f",
    "default_moe_st_oracle": "default_moe_st with oracle defaults (= densemixer)",
    "sparsemixer_single_path": "released single-path backward under the bias (wrong)",
    "v2": "GRIN's v2 (Heun's rule alone, no nabla_1)",
    "v2star": "v2* (exact nabla_1 + Heun's rule)",
    "sparsemixer_per_step": "each gate's share along its own step only (wrong at k > 1)",
}


METRICS = ("relerr_nabla0", "cos_nabla0", "relerr_full", "cos_full")


@dataclasses.dataclass


class SweepSettings:
    """The problems and scales of :func:`accuracy_experiment`: ``num_problems`` random problems
    of ``num_experts`` experts with outputs of dimension ``dim``, router probabilities under
    ``mask`` with ``jitter_eps``; ``num_scales`` output scales from 1 down to ``min_scale``,
    slopes fitted on the scales <= ``fit_below`` (the asymptotic regime); top-k sweeps for each
    ``top_k`` (empty: none); Default MoE's defaults with noise ``default_noise``
    (:func:`noisy_defaults`); group-limited routing over ``num_groups`` groups keeping
    ``top_groups`` (1, 1: none; the experts outside the kept groups are excluded, as the router
    excludes them, and the exact gradient holds that choice fixed, as it holds the mask); a
    selection-only bias ``b ~ selection_bias * N(0, 1)`` per expert and problem (0: none;
    :func:`selection_bias_table`); ``score="sigmoid"``: sigmoid scores with gate scale
    ``routed_scaling_factor`` (:func:`sigmoid_table`, top-1 and each ``top_k``; the bias is
    added to the scores)."""

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
    num_groups: int = 1
    top_groups: int = 1
    selection_bias: float = 0.0
    score: str = "softmax"
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.score not in ("softmax", "sigmoid") or (
                self.score == "sigmoid" and self.num_groups > 1):
            raise ValueError("need --score softmax or sigmoid, and no --num-groups with sigmoid")
        if not self.routed_scaling_factor > 0 or (
                self.score == "softmax" and self.routed_scaling_factor != 1.0):
            raise ValueError("need --routed-scaling-factor > 0, and only with --score sigmoid")
        if not self.selection_bias >= 0 or (self.selection_bias > 0 and self.num_groups > 1):
            raise ValueError("need --selection-bias >= 0, and no --num-groups with it")
        if self.num_problems < 1 or self.num_experts < 2 or self.dim < 1:
            raise ValueError("need --num-problems >= 1, --num-experts >= 2 and --dim >= 1")
        if not 0 < self.min_scale < 1 or self.num_scales < 3:
            raise ValueError("need 0 < --min-scale < 1 and --num-scales >= 3")
        if any(not 1 <= k <= self.num_experts for k in self.top_k):
            raise ValueError(f"--top-k values must lie in [1, --num-experts={self.num_experts}]")
        if not self.default_noise >= 0:
            raise ValueError(f"--default-noise must be >= 0, got {self.default_noise}")
        if self.num_groups < 1 or self.num_experts % self.num_groups or not (
                1 <= self.top_groups <= self.num_groups):
            raise ValueError("need --num-groups >= 1 dividing --num-experts and --top-groups in "
                             "[1, --num-groups]")
        kept = self.top_groups * self.num_experts // self.num_groups
        if any(k > kept for k in self.top_k) or kept < 2:
            raise ValueError(f"--top-groups={self.top_groups} keeps {kept} experts: need at "
                             f"least 2 and every --top-k")
        if (self.scales() <= self.fit_below * (1 + 1e-9)).sum() < 2:
            raise ValueError(f"--fit-below {self.fit_below} leaves fewer than 2 scales to fit")

    def scales(self) -> np.ndarray:
        return np.logspace(0.0, math.log10(self.min_scale), self.num_scales)


def grouped_probs_fn(probs_fn, logits: jax.Array, num_groups: int, top_groups: int):
    """``probs_fn`` restricted to the experts of the groups that ``logits`` (a problem's, all
    experts) keep: the router chooses the groups once, on every expert's logit, before it draws
    any expert, so the top-k steps (which call this with the chosen experts at ``-inf``) must
    not choose them again. No gradient flows through the choice, as through the mask."""
    keep = jnp.isfinite(limit_to_groups(jax.lax.stop_gradient(logits), num_groups, top_groups))

    def grouped(z):
        return probs_fn(jnp.where(keep, z, -jnp.inf))

    return grouped


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
    if settings.score == "sigmoid":
        return _sigmoid_experiment(settings, problems, keys, scales, fit)
    probs_fns = [probs_fn] * len(problems)
    if settings.num_groups > 1:
        probs_fns = [grouped_probs_fn(probs_fn, p.logits, settings.num_groups,
                                      settings.top_groups) for p in problems]
    sampling_fns = [None] * len(problems)
    if settings.selection_bias > 0:
        biases = [settings.selection_bias * jax.random.normal(
            jax.random.fold_in(k, 2), (settings.num_experts,)) for k in keys]
        probs_fns, sampling_fns = zip(*[_biased_probs_fns(b, settings) for b in biases],
                                      strict=True)
    defaults = [
        noisy_defaults(p.expert_outputs, jax.random.fold_in(k, 1), settings.default_noise)
        for p, k in zip(problems, keys, strict=True)
    ]
    sweeps = [accuracy_sweep(p, scales, fn, v, q)
              for p, fn, v, q in zip(problems, probs_fns, defaults, sampling_fns, strict=True)]
    return {
        "scales": scales.tolist(),
        "fit_scales": scales[fit].tolist(),
        "settings": dataclasses.asdict(settings),
        "estimators": _summary(sweeps, scales, fit),
        "topk": {
            str(k): _topk_summary(problems, defaults, scales, fit, probs_fns, k, sampling_fns)
            for k in settings.top_k
        },
    }


def _sigmoid_experiment(settings: SweepSettings, problems, keys, scales, fit) -> dict:
    """The sigmoid-score rows at top-1 (``estimators``) and at each ``top_k > 1``
    (``sigmoid_topk``), with the nabla_0 and full-gradient errors and slopes of
    :func:`accuracy_sweep`: the estimators are consistent at every k under sigmoid scores."""
    biases = [settings.selection_bias * jax.random.normal(jax.random.fold_in(k, 2),
                                                          (settings.num_experts,))
              for k in keys]
    samplings = [sigmoid_sampling_fn(b, settings.jitter_eps, settings.mask) for b in biases]

    def table(top_k):
        return _summary([accuracy_sweep(p, scales, None, sampling_fn=q,
                                        sigmoid=(top_k, settings.routed_scaling_factor))
                         for p, q in zip(problems, samplings, strict=True)], scales, fit)

    return {
        "scales": scales.tolist(),
        "fit_scales": scales[fit].tolist(),
        "settings": dataclasses.asdict(settings),
        "estimators": table(1),
        "topk": {},
        "sigmoid_topk": {str(k): table(k) for k in settings.top_k if k > 1},
    }


def _summary(sweeps, scales, fit) -> dict:
    """Per estimator of :func:`accuracy_sweep`'s ``sweeps`` (one per problem): geometric-mean
    errors with their per-problem slopes, mean cosines."""
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
    return summary


def _biased_probs_fns(bias: jax.Array, settings: SweepSettings) -> tuple[ProbsFn, ProbsFn]:
    """The gates' ``pi`` and the sampling ``q`` under a selection-only ``bias``."""
    def gates(z):
        return selection_probs(z, bias, settings.jitter_eps, settings.mask)[1]

    def sampling(z):
        return selection_probs(z, bias, settings.jitter_eps, settings.mask)[0]

    return gates, sampling


def _topk_summary(problems, defaults, scales, fit, probs_fns, top_k: int,
                  sampling_fns) -> dict:
    """Per estimator: mean norm ratio and cosine, geometric-mean bias and its slope."""
    sweeps = [
        topk_accuracy_sweep(p, scales, fn, top_k, defaults=v, sampling_fn=q)
        for p, fn, v, q in zip(problems, probs_fns, defaults, sampling_fns, strict=True)
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
