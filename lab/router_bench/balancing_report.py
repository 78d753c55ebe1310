"""The balancing tables' report: every estimator under every balancing, paired by seed.

Each arm is compared with two others of the same seeds: top-k (Switch) under the same balancing
(does the estimator's gain survive this balancing?) and the same estimator under its reference
balancing (:data:`~lab.router_bench.arms.BALANCING_REFERENCE`: the micro-batch balance loss for
the balancing table; what does the balancing itself do?).
"""

from __future__ import annotations

import math

import numpy as np

from lab.router_bench import metrics
from lab.router_bench.arms import BALANCING_REFERENCE, Arm, balancing_table

BALANCING_NAMES = {"mb": "micro-batch loss", "gb": "global-batch loss", "bias": "bias, no loss",
                   "none": "none", "mb8": "micro-batch loss, 8 micro-batches",
                   "gb8": "global-batch loss, 8 micro-batches",
                   "bias0.001": "bias at rate 0.001, no loss",
                   "bias0.1": "bias at rate 0.1, no loss",
                   "sig": "sigmoid scores, micro-batch loss",
                   "sigbias": "sigmoid scores, bias, no loss"}


def _split(name: str) -> tuple[str, str]:
    """``(prefix, balancing)`` of ``{router}_k{k}_n{N}_{balancing}``."""
    prefix, _, balancing = name.rpartition("_")
    return prefix, balancing


def _ln_mse(r: dict) -> np.ndarray:
    return np.log(np.asarray(r["per_seed"]["final_eval_mse"], np.float64))


def _ms(pair: tuple[float, float], digits: int = 3) -> str:
    mean, se = pair
    return "–" if not math.isfinite(mean) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def _paired(a: dict, b: dict | None) -> str:
    if b is None:
        return "–"
    d = metrics.paired(_ln_mse(a), _ln_mse(b))
    mark = " *" if math.isfinite(d.se) and abs(d.mean) > 2 * d.se else ""
    return f"{d.fmt()} ({d.below}/{d.n}){mark}"


def balancing_rows(results: dict, refused: dict[str, str], arms: list[Arm] | None = None
                   ) -> list[dict]:
    """One row per arm of ``arms`` (default: the balancing table) that was trained or refused,
    in their order: its quality (ln final eval MSE), the paired differences, the load
    imbalance (max load over mean load of a step's batch in training, per seed the mean over
    the logged steps and the value at the end) and the step time (the training run's seconds
    per step, its logged evaluations included, and the machine's load when it ended)."""
    rows = []
    for arm in balancing_table() if arms is None else arms:
        if arm.name in refused:
            rows.append({"arm": arm, "refused": refused[arm.name]})
            continue
        r = results.get(arm.name)
        if r is None:
            continue
        prefix, balancing = _split(arm.name)
        topk = results.get(f"switch_k{arm.top_k}_n{arm.num_experts}_{balancing}")
        reference = BALANCING_REFERENCE.get(balancing)
        same_estimator = results.get(f"{prefix}_{reference}") if reference else None
        ps = r["per_seed"]
        timings = r.get("timings_s", {})
        rows.append({
            "arm": arm,
            "seeds": len(ps["final_eval_mse"]),
            "ln_mse": metrics.mean_se(_ln_mse(r)),
            "vs_topk": _paired(r, topk) if arm.router != "switch" else "–",
            "reference": BALANCING_NAMES[reference] if reference else "–",
            "vs_reference": _paired(r, same_estimator),
            "imbalance": metrics.mean_se(np.asarray(ps.get("mean_load_imbalance", [math.nan]))),
            "final_imbalance": metrics.mean_se(
                np.asarray(ps.get("final_load_imbalance", [math.nan]))),
            "ms_per_step": 1e3 * timings.get("run_s", math.nan) / r["steps"][-1],
            "load_1m": timings.get("load_1m", math.nan),
        })
    return rows


def markdown_balancing_table(results: dict, refused: dict[str, str],
                             arms: list[Arm] | None = None) -> str:
    """The balancing table (or ``arms``) as Markdown: means ± standard errors over seeds;
    paired differences of ln final eval MSE with how many seeds the arm is lower, marked ``*``
    where they separate from zero by more than 2 standard errors."""
    head = ("| k | N | estimator | balancing | seeds | ln eval MSE | Δ vs top-k, same balancing | "
            "Δ vs reference balancing, same estimator | max/mean load (mean over training) | "
            "max/mean load (end) | ms per step (load) |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in balancing_rows(results, refused, arms):
        arm: Arm = row["arm"]
        balancing = BALANCING_NAMES[_split(arm.name)[1]]
        cells = [str(arm.top_k), str(arm.num_experts), arm.router, balancing]
        if "refused" in row:
            cells += ["refused"] + ["–"] * 6
        else:
            vs_reference = (f"{row['vs_reference']} vs {row['reference']}"
                            if row["vs_reference"] != "–" else "–")
            cells += [str(row["seeds"]), _ms(row["ln_mse"]), row["vs_topk"], vs_reference,
                      _ms(row["imbalance"], 2), _ms(row["final_imbalance"], 2),
                      f"{row['ms_per_step']:.1f} ({row['load_1m']:.0f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def refusals(arms: list[Arm]) -> dict[str, str]:
    """Arm name -> the router config's one-line refusal, for the arms that do not compose."""
    return {arm.name: why for arm in arms if (why := arm.refusal()) is not None}

