"""The summary of a convergence study's finished runs: statistics over seeds and markdown tables.

The summary reads, per finished run (``results.json`` present), ``metrics.jsonl`` or, once only
the small files are kept, ``curves.json`` (:func:`lab.studies.curves.write_curves`).
Mean ± std over seeds (sample std, ``ddof=1``); paired differences by seed against the target
arm (:func:`lab.studies.arms.target_arm`; same seed: same initial weights where
shapes agree, same data order, so seed-to-seed variation partly cancels) as mean ± standard
error (``std / sqrt(n)``) with the seeds where the arm is better; updates to reach the target
arm's final validation loss (linear interpolation between evaluations; the target is the mean
over seeds of that arm's final validation loss).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lab.studies.arms import arm_settings, parse_arm, run_dir, run_state, target_arm
from lab.studies.curves import read_run

#: Final results a run writes that the summary reports, by key of ``results.json``:
#: ``(column title, digits, which sign is better)``. Translation writes BLEU, the language model
#: perplexities; a study shows the ones its runs have.
RESULT_METRICS = {
    "bleu": ("BLEU last", 2, "positive"),
    "bleu_best": ("BLEU best", 2, "positive"),
    "valid_ppl": ("valid ppl", 2, "negative"),
    "wikitext_test_ppl": ("WikiText-2 test ppl", 2, "negative"),
}


def _mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std (ddof=1) and standard error of the values that exist; n counts them,
    ``negative``/``positive`` count the values below/above zero (for paired differences)."""
    xs = np.asarray([v for v in values if v is not None and math.isfinite(v)], float)
    if xs.size == 0:
        return {"mean": None, "std": None, "se": None, "n": 0, "values": list(values)}
    std = float(xs.std(ddof=1)) if xs.size > 1 else None
    return {"mean": float(xs.mean()), "std": std,
            "se": None if std is None else std / math.sqrt(xs.size), "n": int(xs.size),
            "negative": int((xs < 0).sum()), "positive": int((xs > 0).sum()),
            "values": list(values)}


def updates_to_reach(steps: np.ndarray, losses: np.ndarray, target: float) -> float | None:
    """First update count at which the validation curve reaches ``target`` (linear interpolation
    between evaluations; the curve starts at update 0 only if it was evaluated there), or None
    if it never does within the run."""
    below = np.flatnonzero(losses <= target)
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        return float(steps[0])
    s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
    return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1)) if l0 != l1 else float(s1)


def loss_at(steps: np.ndarray, losses: np.ndarray, step: int) -> float | None:
    """Validation loss evaluated exactly at ``step`` (None if the run was not evaluated there)."""
    hit = np.flatnonzero(steps == step)
    return float(losses[hit[0]]) if hit.size else None


def read_results(workdir: str) -> dict[str, Any] | None:
    import json

    path = os.path.join(workdir, "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _final_diagnostics(moe: dict) -> dict[str, float]:
    """Mean over MoE layers of a few router diagnostics at the last logged step."""
    if not moe:
        return {}
    layers = moe[max(moe)].values()
    out = {}
    for key, metric in (("num_unmasked", lambda m: m["num_unmasked"]),
                        ("one_eligible_share", lambda m: m["eligible_fraction"][0]),
                        ("max_logit", lambda m: m["max_logit"]),
                        ("z_loss", lambda m: m["z_loss"]),
                        ("load_max", lambda m: m["load_max"]),
                        ("load_min", lambda m: m["load_min"]),
                        ("non_argmax_share", lambda m: m["non_argmax_share"])):
        try:
            out[key] = float(np.mean([metric(m) for m in layers]))
        except (KeyError, IndexError, TypeError):
            continue
    return out


def load_imbalance(moe: dict, num_experts: int) -> float | None:
    """Max load over mean load (``load_max x N``: a micro-batch's largest expert share, as the
    layers log it), mean over the logged steps and MoE layers of a run's router log; None if it
    logged no loads."""
    per_step = [np.mean([m["load_max"] for m in layers.values()])
                for layers in moe.values() if layers and
                all("load_max" in m for m in layers.values())]
    return float(np.mean(per_step)) * num_experts if per_step else None


def summarize(root: str, arms: Sequence[str], seeds: Sequence[int],
              checkpoints: Sequence[int] | None = None,
              versus: str | None = None) -> dict[str, Any]:
    """The study's numbers from the finished runs under ``root``; unfinished ones are listed per
    arm and left out, so every figure is at the full budget.

    ``checkpoints``: update counts at which validation losses are tabulated; default: every
    evaluation step that all finished runs share. ``versus``: an arm of ``arms`` that every
    other arm is compared with, instead of its Switch arm (``target_arm``).
    """
    if versus is not None and versus not in arms:
        raise ValueError(f"versus={versus!r} is not one of the arms {list(arms)}")
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    partial: dict[str, list[int]] = {}
    diverged: dict[str, list[int]] = {}
    for arm in arms:
        for seed in seeds:
            workdir = run_dir(root, arm, seed)
            state = run_state(workdir)
            if state == "diverged":
                diverged.setdefault(arm, []).append(seed)
            elif state == "partial":  # counted, left out of every statistic
                partial.setdefault(arm, []).append(seed)
            elif state == "finished":
                runs.setdefault(arm, {})[seed] = {"curves": read_run(workdir),
                                                  "results": read_results(workdir)}
    if checkpoints is None:
        shared = None
        for per_seed in runs.values():
            for run in per_seed.values():
                steps = set(run["curves"]["valid"][0].tolist())
                shared = steps if shared is None else shared & steps
        checkpoints = sorted(shared or [])

    summary: dict[str, Any] = {"root": root, "seeds": list(seeds), "checkpoints": list(checkpoints),
                               "arms": {}}
    for arm in arms:
        per_seed = runs.get(arm, {})
        router, n = arm_settings(arm)
        entry: dict[str, Any] = {"router": router if n else "dense", "num_experts": n,
                                 "settings": parse_arm(arm), "finished": len(per_seed),
                                 "finished_seeds": list(per_seed),
                                 "unfinished_seeds": partial.get(arm, []),
                                 "diverged_seeds": diverged.get(arm, [])}
        entry["valid_loss_at"] = {
            str(c): _mean_std([loss_at(*r["curves"]["valid"], c) for r in per_seed.values()])
            for c in checkpoints
        }
        valid = [r["curves"]["valid"] for r in per_seed.values()]
        entry["final_valid_loss"] = _mean_std([float(v[1][-1]) if len(v[1]) else None
                                               for v in valid])
        entry["final_step"] = _mean_std([float(v[0][-1]) if len(v[0]) else None for v in valid])
        for key in (*RESULT_METRICS, "best_valid_loss", "tokens_per_second",
                    "tokens_per_second_median_step"):
            entry[key] = _mean_std([r["results"].get(key) for r in per_seed.values()])
        entry["load_imbalance"] = _mean_std([load_imbalance(r["curves"]["moe"], n)
                                             for r in per_seed.values()] if n else [])
        finals = [_final_diagnostics(r["curves"]["moe"]) for r in per_seed.values()]
        entry["final_router"] = {k: _mean_std([f.get(k) for f in finals])
                                 for k in sorted({k for f in finals for k in f})}
        summary["arms"][arm] = entry

    for arm in arms:
        entry = summary["arms"][arm]
        reference = versus if versus is not None else target_arm(arm, arms)
        target = summary["arms"].get(reference, {}).get("final_valid_loss", {}).get("mean")
        entry["target_arm"] = reference
        entry["target_valid_loss"] = target
        if target is None:
            entry["updates_to_target"] = _mean_std([])
            continue
        reached = [updates_to_reach(*r["curves"]["valid"], target)
                   for r in runs.get(arm, {}).values()]
        entry["updates_to_target"] = _mean_std(reached)
        entry["updates_to_target"]["not_reached"] = sum(v is None for v in reached)

    for arm in arms:  # paired by seed: arm minus its target arm
        entry = summary["arms"][arm]
        reference = entry["target_arm"]
        if arm == reference or reference not in runs:
            continue
        diffs: dict[str, list[float | None]] = {"final_valid_loss": [],
                                                **{key: [] for key in RESULT_METRICS}}
        at: dict[str, list[float | None]] = {str(c): [] for c in summary["checkpoints"]}
        for seed, run in runs.get(arm, {}).items():
            other = runs[reference].get(seed)
            if other is None:
                continue
            for c in summary["checkpoints"]:
                a, b = loss_at(*run["curves"]["valid"], c), loss_at(*other["curves"]["valid"], c)
                at[str(c)].append(None if a is None or b is None else a - b)
            diffs["final_valid_loss"].append(float(run["curves"]["valid"][1][-1])
                                             - float(other["curves"]["valid"][1][-1]))
            for key in RESULT_METRICS:
                a, b = run["results"].get(key), other["results"].get(key)
                diffs[key].append(None if a is None or b is None else a - b)
        entry["paired_minus_target_arm"] = {k: _mean_std(v) for k, v in diffs.items()}
        entry["paired_valid_loss_at"] = {c: _mean_std(v) for c, v in at.items()}
    return summary


def _fmt(stat: dict[str, Any], digits: int = 3, seeds: int = 3) -> str:
    if stat.get("mean") is None:
        return "–"
    text = f"{stat['mean']:.{digits}f}"
    if stat.get("std") is not None:
        text += f" ± {stat['std']:.{digits}f}"
    return text + (f" (n={stat['n']})" if stat["n"] != seeds else "")


def _fmt_paired(stat: dict[str, Any], digits: int, better: str) -> str:
    """``mean ± SE (k/n better)``: ``better`` is ``"negative"`` (a loss) or ``"positive"``."""
    if stat.get("mean") is None:
        return "–"
    text = f"{stat['mean']:+.{digits}f}"
    if stat.get("se") is not None:
        text += f" ± {stat['se']:.{digits}f}"
    return text + f" ({stat[better]}/{stat['n']})"


def markdown(summary: dict[str, Any]) -> str:
    """Markdown tables: validation loss at fixed update counts; the final figures; paired
    differences; the routers at the end of training."""
    arms = list(summary["arms"])
    fmt = functools.partial(_fmt, seeds=len(summary["seeds"]))
    checkpoints = summary["checkpoints"]
    stride = max(1, -(-len(checkpoints) // 6))  # at most 6 columns, evenly spaced, last kept
    shown = checkpoints[::-1][::stride][::-1]
    # The spread of an arm and the uncertainty of a paired difference are different numbers;
    # the caption says which "±" is which.
    lines = ["Per arm: mean ± standard deviation over its seeds (sample, n − 1). Differences "
             "paired by seed: mean ± standard error (standard deviation / √n).", "",
             "| arm | " + " | ".join(f"valid loss @ {c}" for c in shown) + " |",
             "| --- |" + " --- |" * len(shown)]
    for arm in arms:
        e = summary["arms"][arm]
        lines.append(f"| {arm} | " + " | ".join(fmt(e["valid_loss_at"][str(c)]) for c in shown)
                     + " |")
    # The results each task's runs write: BLEU (translation) or perplexities (language model).
    shown_metrics = [key for key in RESULT_METRICS
                     if any(summary["arms"][a][key].get("mean") is not None for a in arms)]
    shown_metrics = shown_metrics or ["bleu", "bleu_best"]
    titles = " | ".join(RESULT_METRICS[key][0] for key in shown_metrics)
    lines += ["", "| arm | runs finished | final valid loss | updates to the target's final loss "
                  f"| {titles} | train tokens/s |",
              "| --- | --- | --- | --- |" + " --- |" * len(shown_metrics) + " --- |"]
    for arm in arms:
        e = summary["arms"][arm]
        reach = fmt(e["updates_to_target"], 0)
        missed = e["updates_to_target"].get("not_reached", 0)
        if missed:
            reach += f"; {missed} run(s) never reached it"
        diverged = f" ({len(e['diverged_seeds'])} diverged)" if e["diverged_seeds"] else ""
        if e["target_valid_loss"] is not None:
            reach += f" (target {e['target_arm']} {e['target_valid_loss']:.3f})"
        lines.append(
            f"| {arm} | {e['finished']}{diverged} | {fmt(e['final_valid_loss'])} | {reach} | "
            + "".join(f"{fmt(e[key], RESULT_METRICS[key][1])} | " for key in shown_metrics)
            + f"{fmt(e['tokens_per_second'], 0)} |")
    paired = [a for a in arms if "paired_minus_target_arm" in summary["arms"][a]]
    if paired:
        lines += ["", "| arm minus its target arm, same seed: mean ± standard error (seeds "
                      f"where the arm is better / seeds) | final valid loss | {titles} |",
                  "| --- | --- |" + " --- |" * len(shown_metrics)]
        for arm in paired:
            e = summary["arms"][arm]
            d = e["paired_minus_target_arm"]
            cells = [_fmt_paired(d["final_valid_loss"], 3, "negative")]
            cells += [_fmt_paired(d[key], *RESULT_METRICS[key][1:]) for key in shown_metrics]
            lines.append(f"| {arm} − {e['target_arm']} | " + " | ".join(cells) + " |")
    if paired:
        lines += ["", "| arm minus its target arm, same seed: valid loss | "
                  + " | ".join(f"@ {c}" for c in shown) + " |", "| --- |" + " --- |" * len(shown)]
        for arm in paired:
            e = summary["arms"][arm]
            lines.append(f"| {arm} − {e['target_arm']} | " + " | ".join(
                _fmt_paired(e["paired_valid_loss_at"][str(c)], 3, "negative") for c in shown)
                + " |")
    balanced = [a for a in arms if summary["arms"][a]["load_imbalance"]["mean"]]
    if balanced:
        lines += ["", "| arm | load imbalance over training (max load / mean load) |",
                  "| --- | --- |"]
        lines += [f"| {a} | {fmt(summary['arms'][a]['load_imbalance'], 2)} |" for a in balanced]
    routed = [a for a in arms if summary["arms"][a]["final_router"]]
    if routed:
        keys = ("num_unmasked", "one_eligible_share", "max_logit", "z_loss", "load_max",
                "load_min", "non_argmax_share")
        lines += ["", "| routers at the last logged step (mean over MoE layers) | "
                  + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
        for arm in routed:
            r = summary["arms"][arm]["final_router"]
            lines.append(f"| {arm} | " + " | ".join(fmt(r.get(k, {}), 2) for k in keys) + " |")
    return "\n".join(lines) + "\n"
