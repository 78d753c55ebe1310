"""From histories to results: per-arm JSON summaries, paired tables against Switch, and plots.

Every summary keeps the per-seed values that the paired statistics need, so the tables can be
rebuilt from the JSON alone (``python -m experiments.router_bench --report-only``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from lab.router_bench import metrics
from lab.router_bench.arms import Arm, baseline_of, robustness_table
from lab.router_bench.train import History, TrainConfig
from sparsemixer_jax.routers import UNCHOSEN_EXPERT_RULES

THRESHOLD_FACTOR = 1.5  # steps to reach 1.5x the baseline's geometric-mean final eval MSE


def _agreement(confusion: np.ndarray, fn) -> np.ndarray:
    """``[S, E]`` mean over layers of ``fn`` applied to ``confusion [S, E, L, N, K]``."""
    s, e, layers = confusion.shape[:3]
    out = np.empty((s, e))
    for i in range(s):
        for j in range(e):
            out[i, j] = np.mean([fn(confusion[i, j, layer]) for layer in range(layers)])
    return out


def _rounded(a: np.ndarray, digits: int = 5) -> list:
    return np.round(np.asarray(a, np.float64), digits).tolist()


def _measured_mean(a: np.ndarray, axis: int) -> np.ndarray:
    """Mean of ``a`` along ``axis`` over its finite entries; NaN where there is none.

    Some measures are NaN by design: the training-mode measures at step 0 (no step yet) and the
    gradient cosine of arms that do not measure it, so an all-NaN slice is expected, not an
    error."""
    finite = np.isfinite(a)
    count = finite.sum(axis)
    total = np.where(finite, a, 0.0).sum(axis)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def summarise(arm: Arm, history: History, timings: dict) -> dict:
    """JSON-able summary of one arm: config, per-seed finals, per-seed curves (eval MSE,
    agreement) and mean curves of the other measures."""
    agreement = _agreement(history.confusion, metrics.partition_agreement)
    purity = _agreement(history.confusion, metrics.partition_purity)
    nanmean = lambda a: _measured_mean(a[:, 1:], axis=1)
    return {
        "arm": dataclasses.asdict(arm),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "steps": history.steps.tolist(),
        "acceptance": _rounded(history.acceptance, 4),
        "per_seed": {
            "final_eval_mse": _rounded(history.eval_mse[:, -1], 6),
            "final_train_mse": _rounded(history.train_mse[:, -1], 6),
            "mean_log_eval_mse": _rounded(np.mean(np.log(history.eval_mse[:, 1:]), axis=1)),
            "final_agreement": _rounded(agreement[:, -1], 4),
            "final_purity": _rounded(purity[:, -1], 4),
            "final_zero_grad": _rounded(history.zero_grad[:, -1], 4),
            "final_non_argmax": _rounded(history.non_argmax[:, -1], 4),
            "final_load_max": _rounded(history.load_max[:, -1], 4),
            "mean_grad_cos": _rounded(nanmean(history.grad_cos), 4),
            **({} if history.load_imbalance is None else {
                "mean_load_imbalance": _rounded(nanmean(history.load_imbalance), 4),
                "final_load_imbalance": _rounded(history.load_imbalance[:, -1], 4)}),
            "mean_grad_norm_ratio": _rounded(nanmean(history.grad_norm_ratio), 4),
        },
        "curves_per_seed": {
            "eval_mse": _rounded(history.eval_mse, 6),
            "agreement": _rounded(agreement, 4),
        },
        "curves_mean": {
            name: _rounded(_measured_mean(getattr(history, name), axis=0), 4)
            if np.isfinite(getattr(history, name)).any() else None
            for name in ("train_mse", "zero_grad", "non_argmax", "load_max", "grad_cos",
                         "grad_norm_ratio")
        },
    }


def _arms(results: dict) -> dict[str, Arm]:
    return {name: Arm(**r["arm"]) for name, r in results.items()}


def paired_rows(results: dict, versus: str | None = None) -> list[dict]:
    """One row per arm: its own means ± SE and the paired differences against its baseline
    (:func:`~lab.router_bench.arms.baseline_of`, or the arm ``versus`` for every
    arm with the same teacher setting).

    ``dlog_mse``: mean over seeds of ``ln(final eval MSE) - ln(baseline's)`` (negative: the arm
    is better; ``exp`` of it is the geometric-mean ratio). ``d_agree``: difference of final
    partition agreement. ``steps``: median over seeds of the first logged step with eval MSE
    at or below ``THRESHOLD_FACTOR`` times the baseline's geometric-mean final MSE, and how many
    seeds reach it.
    """
    arms = _arms(results)
    rows = []
    for name, r in results.items():
        ps = r["per_seed"]
        base = baseline_of(arms[name], arms)
        if versus is not None:
            same = versus in arms and arms[versus].setting() == arms[name].setting()
            base = versus if same and name != versus else None
        row = {"arm": name, "baseline": base, "seeds": len(ps["final_eval_mse"])}
        for key in ("final_eval_mse", "final_agreement", "final_purity", "final_zero_grad",
                    "final_non_argmax", "mean_grad_cos", "mean_grad_norm_ratio"):
            row[key] = metrics.mean_se(np.asarray(ps[key], np.float64))
        if base is not None:
            bs = results[base]["per_seed"]
            row["dlog_mse"] = metrics.paired(np.log(ps["final_eval_mse"]),
                                             np.log(bs["final_eval_mse"]))
            row["dlog_auc"] = metrics.paired(ps["mean_log_eval_mse"], bs["mean_log_eval_mse"])
            row["d_agree"] = metrics.paired(ps["final_agreement"], bs["final_agreement"])
            threshold = THRESHOLD_FACTOR * math.exp(np.mean(np.log(bs["final_eval_mse"])))
            steps = np.asarray(r["steps"])
            mine = metrics.steps_to_threshold(np.asarray(r["curves_per_seed"]["eval_mse"]),
                                              steps, threshold)
            theirs = metrics.steps_to_threshold(
                np.asarray(results[base]["curves_per_seed"]["eval_mse"]), steps, threshold)
            row["steps_to_thr"] = (_median(mine), int(np.isfinite(mine).sum()),
                                   _median(theirs), int(np.isfinite(theirs).sum()))
        rows.append(row)
    return rows


def _median(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.median(a)) if a.size else math.nan


def _ms(pair, digits: int = 3) -> str:
    mean, se = pair
    return "–" if not math.isfinite(mean) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def markdown_table(results: dict, versus: str | None = None) -> str:
    """The paired table as Markdown (means ± standard errors over seeds)."""
    head = ("| arm | vs | final eval MSE | Δ ln MSE (paired) | better seeds | Δ ln MSE, "
            "mean over run | agreement | Δ agreement | zero-grad share | off-argmax share | "
            "grad cos | grad norm ratio | steps to thr (arm / base, seeds reaching) |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in paired_rows(results, versus):
        paired_cols = ["–", "–", "–", "–", "–"]
        if "dlog_mse" in row:
            d = row["dlog_mse"]
            st = row["steps_to_thr"]
            paired_cols = [d.fmt(), f"{d.below}/{d.n}", row["dlog_auc"].fmt(),
                           row["d_agree"].fmt(), f"{st[0]:.0f} / {st[2]:.0f} ({st[1]}, {st[3]})"]
        lines.append(
            f"| {row['arm']} | {row['baseline'] or '–'} | {_ms(row['final_eval_mse'], 4)} | "
            f"{paired_cols[0]} | {paired_cols[1]} | {paired_cols[2]} | "
            f"{_ms(row['final_agreement'])} | {paired_cols[3]} | {_ms(row['final_zero_grad'])} | "
            f"{_ms(row['final_non_argmax'])} | {_ms(row['mean_grad_cos'])} | "
            f"{_ms(row['mean_grad_norm_ratio'], 2)} | {paired_cols[4]} |")
    return "\n".join(lines)


def plot(results: dict, names: list[str], path: str, title: str = "") -> None:
    """Curves with bands (mean ± SE over seeds): ln eval MSE, partition agreement and the
    zero-gradient share, for the arms ``names``; a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for name in names:
        if name not in results:
            continue
        r = results[name]
        steps = np.asarray(r["steps"])
        for ax, curves in ((axes[0], np.log(np.asarray(r["curves_per_seed"]["eval_mse"]))),
                           (axes[1], np.asarray(r["curves_per_seed"]["agreement"]))):
            mean = curves.mean(0)
            se = curves.std(0, ddof=1) / np.sqrt(curves.shape[0])
            (line,) = ax.plot(steps, mean, label=name, lw=1.2)
            ax.fill_between(steps, mean - se, mean + se, color=line.get_color(), alpha=0.25)
        zero = r["curves_mean"]["zero_grad"]
        axes[2].plot(steps[1:], zero[1:], lw=1.2)
    axes[0].set_ylabel("ln eval MSE (clean labels)")
    axes[1].set_ylabel("partition agreement")
    axes[2].set_ylabel("share of tokens without router gradient")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if any(name in results for name in names):  # nothing to label otherwise
        axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def train_flops_per_token(arm: Arm, emb: int, mlp: int) -> int:
    """Analytic training FLOPs per token of the arm's MoE layers (forward and backward).

    A multiply-add counts 2; the backward of a matmul costs twice its forward. Per layer, with
    ``E = 2 (2 emb mlp)`` the forward of one row through one expert:

    * every router: ``3 (2 emb N + k E)`` (the router's linear map and the ``k`` chosen rows);
    * DenseMixer adds the dense pass ``N E`` (forward only: no gradient flows into it) and the
      unchosen-expert term ``sum_j c_j pi_j v_j``: ``2 N emb`` forward and ``2 N emb`` for its
      backward to ``pi``;
    * Default MoE adds the same term (``4 N emb``) and the EMA update of the defaults
      (``k emb`` per token, a segment sum of the chosen rows).

    Elementwise work (softmax, jitter, mask, gate, ``omega``, losses) is left out. Dense arms
    are one expert of their width.
    """
    if arm.dense is not None:
        n, k = 1, 1
        mlp = mlp * (arm.num_experts if arm.dense == "params" else 1)
    else:
        n, k = arm.num_experts, arm.top_k
    expert = 2 * (2 * emb * mlp)
    flops = 3 * (2 * emb * n + k * expert)
    rule = UNCHOSEN_EXPERT_RULES.get(arm.router) if arm.dense is None else None
    if rule is not None:
        flops += 2 * (2 * n * emb)
        flops += n * expert if rule.values == "outputs" else k * emb
    return flops * arm.depth


def _timed_step_s(r: dict) -> float:
    """Seconds per training step from the interleaved timing (the fastest round), else NaN."""
    timed = r.get("step_time_s")
    return min(timed["rounds"]) if timed else math.nan


def _run_step_s(r: dict) -> float:
    """Seconds per step of the training run itself (its logged evaluations included)."""
    return r.get("timings_s", {}).get("run_s", math.nan) / r["steps"][-1]


def cost_rows(results: dict, emb: int, mlp: int, versus: str | None = None) -> list[dict]:
    """Quality and cost per arm: :func:`paired_rows` plus ``flops`` (training FLOPs per token,
    :func:`train_flops_per_token`) and, each with its ratio to the baseline's (``*_ratio``):
    ``step_ms``, the wall time of one training step of every seed at once after compilation
    from the interleaved timing (``--time-rounds``; the fastest round), and ``run_step_ms``,
    the training run's own time per step (its logged evaluations included; one run per arm, at
    whatever load the machine had then); NaN where not recorded. ``compile_s``: the arm's XLA
    compilation. ``equal_flops``: ``(step, Paired)``, the arm's ln eval MSE at the last logged
    step whose training FLOPs do not exceed the baseline's whole run, paired by seed against the
    baseline's final ln eval MSE (absent without a baseline)."""
    arms = _arms(results)
    rows = paired_rows(results, versus)
    for row in rows:
        r = results[row["arm"]]
        row["flops"] = train_flops_per_token(arms[row["arm"]], emb, mlp)
        row["step_ms"] = 1e3 * _timed_step_s(r)
        row["run_step_ms"] = 1e3 * _run_step_s(r)
        row["compile_s"] = r.get("timings_s", {}).get("compile_s", math.nan)
        base = row["baseline"]
        if base is None:
            row["flops_ratio"] = row["step_ratio"] = row["run_step_ratio"] = 1.0
        else:
            b = results[base]
            row["flops_ratio"] = row["flops"] / train_flops_per_token(arms[base], emb, mlp)
            row["step_ratio"] = _timed_step_s(r) / _timed_step_s(b)
            row["run_step_ratio"] = _run_step_s(r) / _run_step_s(b)
            steps = np.asarray(r["steps"])
            budget = b["steps"][-1] / row["flops_ratio"]
            at = int(np.flatnonzero(steps <= budget + 1e-9)[-1])
            mine = np.asarray(r["curves_per_seed"]["eval_mse"])[:, at]
            row["equal_flops"] = (int(steps[at]), metrics.paired(
                np.log(mine), np.log(b["per_seed"]["final_eval_mse"])))
    return rows


def markdown_cost_table(results: dict, emb: int, mlp: int, versus: str | None = None) -> str:
    """Quality beside cost, one row per arm (means ± standard errors over seeds; Δ paired by
    seed against the "vs" arm): :func:`cost_rows` as Markdown."""
    head = ("| arm | vs | final eval MSE | Δ ln MSE (paired) | better seeds | agreement | "
            "Δ agreement | grad cos | grad norm ratio | train FLOPs/token (× vs) | "
            "Δ ln MSE at equal FLOPs (arm's step) | step ms, timed (× vs) | "
            "step ms in the run (× vs) | compile s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in cost_rows(results, emb, mlp, versus):
        paired_cols = ["–", "–", "–"]
        if "dlog_mse" in row:
            d = row["dlog_mse"]
            paired_cols = [d.fmt(), f"{d.below}/{d.n}", row["d_agree"].fmt()]
        step, run_step = (
            "–" if not math.isfinite(row[key]) else f"{row[key]:.1f} ({row[ratio]:.2f}×)"
            for key, ratio in (("step_ms", "step_ratio"), ("run_step_ms", "run_step_ratio")))
        compile_s = "–" if not math.isfinite(row["compile_s"]) else f"{row['compile_s']:.0f}"
        equal = "–"
        if "equal_flops" in row:
            at, d = row["equal_flops"]
            equal = f"{d.fmt()} ({at})"
        lines.append(
            f"| {row['arm']} | {row['baseline'] or '–'} | {_ms(row['final_eval_mse'], 4)} | "
            f"{paired_cols[0]} | {paired_cols[1]} | {_ms(row['final_agreement'])} | "
            f"{paired_cols[2]} | {_ms(row['mean_grad_cos'])} | "
            f"{_ms(row['mean_grad_norm_ratio'], 2)} | {row['flops']:,} "
            f"({row['flops_ratio']:.2f}×) | {equal} | {step} | {run_step} | {compile_s} |")
    return "\n".join(lines)


def markdown_robustness_table(results: dict, routers: tuple[str, ...] = (
        "sparsemixer", "densemixer", "default_moe")) -> str:
    """One row per setting of the robustness table (the arm name without its router): Switch's
    final eval MSE and agreement, then for each of ``routers`` its Δ ln MSE against Switch
    (paired by seed, ± SE), the seeds where it is better and its Δ agreement; last, the share
    of training tokens each sends off its argmax expert (end of training). Settings in the
    order of :func:`~lab.router_bench.arms.robustness_table`."""
    rows = {row["arm"]: row for row in paired_rows(results)}
    settings: list[str] = []
    order = {arm.name: i for i, arm in enumerate(robustness_table())}
    for name in sorted(results, key=lambda n: order.get(n, len(order))):
        setting = name.partition("_")[2]
        if setting not in settings:
            settings.append(setting)
    head = "| setting | switch: MSE, agreement | " + " | ".join(
        f"{r}: Δ ln MSE | better | Δ agreement" for r in routers) + " | off-argmax share: " + (
        " / ".join(("switch", *routers))) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for setting in settings:
        # Switch of this setting; for a change Switch ignores (omega), the corner's Switch.
        bases = [rows[f"{r}_{setting}"]["baseline"] for r in ("switch", *routers)
                 if f"{r}_{setting}" in rows]
        base_name = f"switch_{setting}" if f"switch_{setting}" in rows else next(
            (b for b in bases if b is not None), None)
        if base_name is None:
            continue
        base = rows[base_name]
        cols = [f"{_ms(base['final_eval_mse'])}, {base['final_agreement'][0]:.3f}"]
        for router in routers:
            row = rows.get(f"{router}_{setting}")
            if row is None or "dlog_mse" not in row:
                cols += ["–", "–", "–"]
                continue
            d = row["dlog_mse"]
            cols += [d.fmt(2), f"{d.below}/{d.n}", row["d_agree"].fmt(2)]
        shares = [rows.get(n, {}).get("final_non_argmax", (math.nan,))[0]
                  for n in (base_name, *(f"{r}_{setting}" for r in routers))]
        cols.append(" / ".join("–" if not math.isfinite(x) else f"{x:.3f}" for x in shares))
        lines.append(f"| {setting} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _same_training(a: Arm, b: Arm) -> bool:
    """Whether ``a`` and ``b`` train identically (the gradient measurement is read-only)."""
    strip = dict(name="", measure_gradient=False)
    return dataclasses.replace(a, **strip) == dataclasses.replace(b, **strip)


def reused(path: str, arms: list[Arm], cfg: TrainConfig, num_seeds: int) -> dict:
    """Results in the JSON ``path`` of arms trained exactly as some of ``arms`` (same run
    settings and seeds), under the names of ``arms``."""
    with open(path) as f:
        saved = json.load(f)
    if saved.get("config") != cfg._asdict():
        return {}
    out = {}
    for name, r in saved["arms"].items():
        theirs = Arm(**r["arm"])
        if len(r["per_seed"]["final_eval_mse"]) != num_seeds:
            continue
        for arm in arms:
            if _same_training(arm, theirs):
                out[arm.name] = {**r, "arm": dataclasses.asdict(arm), "reused_from": name}
    return out
