"""The arms of a convergence study and the summary of its finished runs (no training here).

Arm names say what they change, so a run directory names its own config:

* ``{router}_n{N}``: ``router.name`` (a key of ``sparsemixer_jax.routing.ROUTERS``) with
  ``model.num_experts = N``, e.g. ``switch_n4``, ``sparsemixer_1st_n8``;
* ``dense``: no experts;
* either, followed by modifiers ``_lr{peak_lr}``, ``_eps{jitter_eps}``, ``_bal{balance_weight}``,
  ``_z{z_loss_weight}``, e.g. ``sparsemixer_n4_lr2e-3``, ``sparsemixer_n4_eps0.5``.

Each arm is compared with its *target arm*: the Switch arm of the same N and the same
modifiers if the study has it (so a learning-rate arm meets Switch at that rate), else the
plain ``switch_n{N}``; the dense arm meets the Switch arm of the smallest N.

The summary reads, per finished run (``results.json`` present), ``metrics.jsonl`` or, once only
the small files are kept, ``curves.json`` (:func:`experiments.plot.write_curves`). Mean ± std
over seeds (sample std, ``ddof=1``); paired differences by seed against the target arm (same
seed: same initial weights where shapes agree, same data order, so seed-to-seed variation partly
cancels); updates to reach the target arm's final validation loss (linear interpolation between
evaluations; the target is the mean over seeds of that arm's final validation loss).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.plot import read_run, smooth

DIVERGED = "diverged.json"

#: Arm-name modifier -> the config field it sets.
MODIFIERS = {"lr": "optim.peak_lr", "eps": "router.jitter_eps", "bal": "router.balance_weight",
             "z": "router.z_loss_weight"}
_ARM = re.compile(
    r"^(?:(?P<router>[a-z0-9_]+?)_n(?P<n>\d+)|dense)(?P<mods>(?:_[a-z]+[-+.e0-9]+)*)$")
_MOD = re.compile(r"_([a-z]+)([-+.e0-9]+)")

#: Named groups of arms for ``--study`` (N from ``--experts`` where it says ``{n}``).
STUDIES = {
    "main": ["switch_n{n}", "sparsemixer_n{n}", "dense"],
    "ablations": ["switch_n{n}", "sparsemixer_1st_n{n}", "sparsemixer_2nd_n{n}",
                  "sparsemixer_nomask_n{n}", "sparsemixer_n{n}_eps0.5"],
    # multi30k_n4's peak rate is 1e-3: half and double it.
    "lr": ["switch_n{n}_lr5e-4", "sparsemixer_n{n}_lr5e-4", "switch_n{n}_lr2e-3",
           "sparsemixer_n{n}_lr2e-3"],
    # The reference adds alpha * balance loss to a loss *summed* over tokens (docs/science.md):
    # per token that is about alpha / (tokens per batch), 0.01 / 6.5k at 8192 padded tokens.
    "refbalance": ["switch_n{n}_bal1.5e-6", "sparsemixer_n{n}_bal1.5e-6"],
}


def arm_names(experts: Sequence[int], dense: bool = True) -> list[str]:
    """``switch_n4``, ``sparsemixer_n4``, ... for each N, then ``dense`` (N does not apply)."""
    names = [f"{router}_n{n}" for n in experts for router in ("switch", "sparsemixer")]
    return [*names, "dense"] if dense else names


def study_arms(studies: Sequence[str], experts: Sequence[int], dense: bool = True) -> list[str]:
    """The arms of the named ``STUDIES`` for each N, in order, without repeats."""
    arms: list[str] = []
    for study in studies:
        if study not in STUDIES:
            raise ValueError(f"unknown study {study!r}; choose from {sorted(STUDIES)}")
        for n in experts:
            for template in STUDIES[study]:
                arm = template.format(n=n)
                if arm not in arms and (dense or arm != "dense"):
                    arms.append(arm)
    return arms


def parse_arm(arm: str) -> dict[str, Any]:
    """The config fields an arm sets: ``{"router.name", "model.num_experts", ...modifiers}``."""
    match = _ARM.match(arm)
    if match is None:
        raise ValueError(f"arm {arm!r} is not '{{router}}_n{{N}}' or 'dense' followed by "
                         f"modifiers _{{{','.join(MODIFIERS)}}}VALUE")
    fields: dict[str, Any] = {"router.name": match["router"] or "switch",
                              "model.num_experts": int(match["n"] or 0)}
    for key, value in _MOD.findall(match["mods"]):
        if key not in MODIFIERS:
            raise ValueError(f"arm {arm!r}: unknown modifier {key!r}; known: {sorted(MODIFIERS)}")
        try:
            fields[MODIFIERS[key]] = float(value)
        except ValueError:
            raise ValueError(f"arm {arm!r}: modifier {key!r} needs a number, got {value!r}") \
                from None
    return fields


def arm_settings(arm: str) -> tuple[str, int]:
    """``(router.name, model.num_experts)`` of an arm name (dense: ``("switch", 0)``)."""
    fields = parse_arm(arm)
    return fields["router.name"], fields["model.num_experts"]


def _modifiers(arm: str) -> str:
    match = _ARM.match(arm)
    return match["mods"] if match else ""


def target_arm(arm: str, arms: Sequence[str]) -> str:
    """The Switch arm ``arm`` is measured against (module docstring)."""
    n = arm_settings(arm)[1]
    if n == 0:
        sizes = sorted(arm_settings(a)[1] for a in arms if arm_settings(a)[1])
        n = sizes[0] if sizes else 0
    same_mods = f"switch_n{n}{_modifiers(arm)}"
    return same_mods if same_mods in arms else f"switch_n{n}"


def run_dir(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, f"{arm}_s{seed}")


def run_state(workdir: str) -> str:
    """``"finished"``, ``"diverged"``, ``"partial"`` (started) or ``"new"``."""
    if os.path.exists(os.path.join(workdir, "results.json")):
        return "finished"
    if os.path.exists(os.path.join(workdir, DIVERGED)):
        return "diverged"
    return "partial" if os.path.isdir(workdir) else "new"


# ---------------------------------------------------------------------------------- summary


def _mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and sample std (ddof=1) of the values that exist; n counts them."""
    xs = np.asarray([v for v in values if v is not None and math.isfinite(v)], float)
    if xs.size == 0:
        return {"mean": None, "std": None, "n": 0, "values": list(values)}
    std = float(xs.std(ddof=1)) if xs.size > 1 else None
    return {"mean": float(xs.mean()), "std": std, "n": int(xs.size), "values": list(values)}


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


def summarize(root: str, arms: Sequence[str], seeds: Sequence[int],
              checkpoints: Sequence[int] | None = None) -> dict[str, Any]:
    """The study's numbers from the finished runs under ``root``; unfinished ones are listed per
    arm and left out, so every figure is at the full budget.

    ``checkpoints``: update counts at which validation losses are tabulated; default: every
    evaluation step that all finished runs share.
    """
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
        for key in ("bleu", "bleu_best", "best_valid_loss", "tokens_per_second"):
            entry[key] = _mean_std([r["results"].get(key) for r in per_seed.values()])
        finals = [_final_diagnostics(r["curves"]["moe"]) for r in per_seed.values()]
        entry["final_router"] = {k: _mean_std([f.get(k) for f in finals])
                                 for k in sorted({k for f in finals for k in f})}
        summary["arms"][arm] = entry

    for arm in arms:
        entry = summary["arms"][arm]
        reference = target_arm(arm, arms)
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
        diffs: dict[str, list[float | None]] = {"final_valid_loss": [], "bleu": [],
                                                "bleu_best": []}
        for seed, run in runs.get(arm, {}).items():
            other = runs[reference].get(seed)
            if other is None:
                continue
            diffs["final_valid_loss"].append(float(run["curves"]["valid"][1][-1])
                                             - float(other["curves"]["valid"][1][-1]))
            for key in ("bleu", "bleu_best"):
                a, b = run["results"].get(key), other["results"].get(key)
                diffs[key].append(None if a is None or b is None else a - b)
        entry["paired_minus_target_arm"] = {k: _mean_std(v) for k, v in diffs.items()}
    return summary


def _fmt(stat: dict[str, Any], digits: int = 3, seeds: int = 3) -> str:
    if stat.get("mean") is None:
        return "–"
    text = f"{stat['mean']:.{digits}f}"
    if stat.get("std") is not None:
        text += f" ± {stat['std']:.{digits}f}"
    return text + (f" (n={stat['n']})" if stat["n"] != seeds else "")


def markdown(summary: dict[str, Any]) -> str:
    """Markdown tables: validation loss at fixed update counts; the final figures; paired
    differences; the routers at the end of training."""
    arms = list(summary["arms"])
    fmt = functools.partial(_fmt, seeds=len(summary["seeds"]))
    checkpoints = summary["checkpoints"]
    stride = max(1, -(-len(checkpoints) // 6))  # at most 6 columns, evenly spaced, last kept
    shown = checkpoints[::-1][::stride][::-1]
    lines = ["| arm | " + " | ".join(f"valid loss @ {c}" for c in shown) + " |",
             "| --- |" + " --- |" * len(shown)]
    for arm in arms:
        e = summary["arms"][arm]
        lines.append(f"| {arm} | " + " | ".join(fmt(e["valid_loss_at"][str(c)]) for c in shown)
                     + " |")
    lines += ["", "| arm | runs finished | final valid loss | updates to Switch's final loss "
                  "| BLEU last | BLEU best | train tokens/s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
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
            f"{fmt(e['bleu'], 2)} | {fmt(e['bleu_best'], 2)} | "
            f"{fmt(e['tokens_per_second'], 0)} |")
    paired = [a for a in arms if "paired_minus_target_arm" in summary["arms"][a]]
    if paired:
        lines += ["", "| arm minus its Switch arm, same seed | final valid loss | BLEU last "
                      "| BLEU best |", "| --- | --- | --- | --- |"]
        for arm in paired:
            e = summary["arms"][arm]
            d = e["paired_minus_target_arm"]
            lines.append(f"| {arm} − {e['target_arm']} | {fmt(d['final_valid_loss'])} | "
                         f"{fmt(d['bleu'], 2)} | {fmt(d['bleu_best'], 2)} |")
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


def plot(root: str, summary: dict[str, Any], out: str, window: int = 20) -> None:
    """Training (moving average) and validation loss against updates: mean over seeds, band
    from min to max; and the validation loss minus the target arm's, same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, arm in enumerate(summary["arms"]):
        color = f"C{i % 10}"
        style = "-" if i < 10 else "--"
        curves = [read_run(run_dir(root, arm, s)) for s in summary["seeds"]
                  if run_state(run_dir(root, arm, s)) == "finished"]
        for ax, kind in ((ax_train, "train"), (ax_valid, "valid")):
            pairs = [c[kind] for c in curves if len(c[kind][0])]
            if not pairs:
                continue
            length = min(len(p[0]) for p in pairs)  # the common prefix
            steps = pairs[0][0][:length]
            values = np.stack([p[1][:length] for p in pairs])
            if kind == "train":
                values = np.stack([smooth(v, window) for v in values])
            ax.plot(steps, values.mean(0), color=color, ls=style,
                    label=f"{arm} (n={len(pairs)})", marker="o" if kind == "valid" else None,
                    ms=3)
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
        reference = summary["arms"][arm].get("target_arm")
        diffs = []
        for seed in summary["seeds"]:
            mine, other = run_dir(root, arm, seed), run_dir(root, reference or "", seed)
            if arm == reference or run_state(mine) != "finished" or \
                    run_state(other) != "finished":
                continue
            (s_a, v_a), (s_b, v_b) = read_run(mine)["valid"], read_run(other)["valid"]
            common = np.intersect1d(s_a, s_b)
            diffs.append((common, v_a[np.isin(s_a, common)] - v_b[np.isin(s_b, common)]))
        if diffs:
            length = min(len(d[0]) for d in diffs)
            values = np.stack([d[1][:length] for d in diffs])
            ax_diff.plot(diffs[0][0][:length], values.mean(0), color=color, ls=style,
                         marker="o", ms=3, label=f"{arm} − {reference} (n={len(diffs)})")
            ax_diff.fill_between(diffs[0][0][:length], values.min(0), values.max(0),
                                 color=color, alpha=0.2)
    ax_diff.axhline(0.0, color="k", lw=0.8)
    ax_diff.set_title("validation loss minus the target Switch arm's, same seed")
    ax_train.set_title(f"training loss (moving average, {window} updates)")
    ax_valid.set_title("validation loss (mean over seeds, band = min..max)")
    for ax in (ax_train, ax_valid, ax_diff):
        ax.set_xlabel("updates")
        ax.set_ylabel("label-smoothed cross entropy (nats)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_valid.set_ylim(top=min(ax_valid.get_ylim()[1], 7.0))
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_router(root: str, summary: dict[str, Any], out: str) -> None:
    """The router diagnostics of every MoE arm (mean over seeds and layers)."""
    from experiments.plot import plot_diagnostics

    groups = {}
    for arm, entry in summary["arms"].items():
        if not entry["num_experts"]:
            continue
        runs = [read_run(run_dir(root, arm, s)) for s in summary["seeds"]
                if run_state(run_dir(root, arm, s)) == "finished"]
        if runs:
            groups[arm] = runs
    if groups:
        plot_diagnostics(groups, out)
