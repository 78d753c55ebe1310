"""Convergence study: Switch, Switch+SparseMixer and the dense baseline, several seeds, one budget.

    python -m experiments.compare --root /tmp/compare --experts 4 --seeds 0 1 2 \
        --out-json docs/compare.json --out-md docs/compare.md --plot docs/convergence.png

Every run is ``sparsemixer_jax.train.train_and_evaluate(config, workdir)`` on
``configs/multi30k_compare.py`` (override with ``--config``), with ``router.name``,
``model.num_experts`` and ``seed`` set per arm, sequentially in this process (runs of one model
structure share their compilations). Runs are interleaved seed by seed (switch, sparsemixer,
dense for seed 0, then seed 1, ...) so that a study cut short still compares the arms on the same
seeds.

Resuming: a run whose workdir holds ``results.json`` is skipped; a partial one resumes from its
last checkpoint (the training loop does that). A run whose loss became non-finite gets a
``diverged.json`` and is not retried (from its last checkpoint it would diverge again); the tables
count it per arm. ``--summarize-only`` reads what is there and writes the tables and the plot
without training. The tables and the plot go to ``--root`` unless ``--out-json``, ``--out-md``
and ``--plot`` say otherwise.

Summary (JSON, markdown, PNG), mean ± std over seeds (sample std, ``ddof=1``) for each arm:
validation loss at fixed update counts, updates needed to reach Switch's final validation loss
(linear interpolation between evaluations; the target is the mean over seeds of Switch's final
validation loss), BLEU of the last and of the best checkpoint, training tokens per second.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.plot import read_run, smooth

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- arms


def arm_names(experts: Sequence[int], dense: bool = True) -> list[str]:
    """``switch_n4``, ``sparsemixer_n4``, ... for each N, then ``dense`` (N does not apply)."""
    names = [f"{router}_n{n}" for n in experts for router in ("switch", "sparsemixer")]
    return [*names, "dense"] if dense else names


def arm_settings(arm: str) -> tuple[str, int]:
    """``(router.name, model.num_experts)`` of an arm name."""
    if arm == "dense":
        return "switch", 0  # the router is unused without experts
    router, n = arm.rsplit("_n", 1)
    return router, int(n)


DIVERGED = "diverged.json"


def run_dir(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, f"{arm}_s{seed}")


ARM_FIELDS = ("router.name", "model.num_experts", "seed")  # set per run by the study itself


def make_config(config_path: str, arm: str, seed: int, steps: int | None,
                overrides: Sequence[str] = ()) -> Any:
    """The config of one run: ``config_path``'s ``get_config()`` with the arm, seed and budget."""
    for item in overrides:
        if item.split("=", 1)[0] in ARM_FIELDS:
            raise ValueError(
                f"--override {item}: {', '.join(ARM_FIELDS)} are set per run by the study; use "
                "--experts and --seeds"
            )
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_config", config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    router, n = arm_settings(arm)
    config.router.name = router
    config.model.num_experts = n
    config.seed = seed
    if steps is not None:
        config.train_steps = steps
    for item in overrides:  # "model.emb_dim=64": same syntax as --config.FIELD=VALUE
        key, value = item.split("=", 1)
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], bool) else (
            value.lower() in ("1", "true", "yes"))
    return config


def run_all(args: argparse.Namespace) -> None:
    """Trains every (seed, arm) run that has no ``results.json`` yet, in interleaved order."""
    from sparsemixer_jax import train

    arms = arm_names(args.experts, dense=not args.no_dense)
    for seed in args.seeds:
        for arm in arms:
            workdir = run_dir(args.root, arm, seed)
            if os.path.exists(os.path.join(workdir, "results.json")):
                logger.info("%s: finished, skipped", workdir)
                continue
            if os.path.exists(os.path.join(workdir, DIVERGED)):
                logger.info("%s: diverged earlier, skipped (delete it to retry)", workdir)
                continue
            config = make_config(args.config, arm, seed, args.steps, args.override)
            logger.info("%s: training (%s)", workdir,
                        "resuming" if os.path.isdir(workdir) else "fresh")
            started = time.time()
            try:
                train.train_and_evaluate(config, workdir)
            except train.TrainingDiverged as err:  # the study goes on without this run
                logger.error("%s diverged: %s", workdir, err)
                with open(os.path.join(workdir, DIVERGED), "w") as f:
                    json.dump({"error": str(err)}, f)
            logger.info("%s: %.0f s", workdir, time.time() - started)
            # Rewrite the summary after every run, so a study cut short still has its tables.
            summarize_and_write(args)


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
    path = os.path.join(workdir, "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def summarize(root: str, arms: Sequence[str], seeds: Sequence[int],
              checkpoints: Sequence[int] | None = None) -> dict[str, Any]:
    """The study's numbers from the finished runs (``results.json`` present) under ``root``;
    unfinished ones are listed per arm and left out, so every figure is at the full budget.

    ``checkpoints``: update counts at which validation losses are tabulated; default: every
    evaluation step that all runs present share.
    """
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    partial: dict[str, list[int]] = {}
    diverged: dict[str, list[int]] = {}
    for arm in arms:
        for seed in seeds:
            workdir = run_dir(root, arm, seed)
            if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
                continue
            if os.path.exists(os.path.join(workdir, DIVERGED)):
                diverged.setdefault(arm, []).append(seed)
                continue
            results = read_results(workdir)
            if results is None:  # unfinished: counted, left out of every statistic
                partial.setdefault(arm, []).append(seed)
                continue
            runs.setdefault(arm, {})[seed] = {"curves": read_run(workdir), "results": results}
    if checkpoints is None:
        shared = None
        for per_seed in runs.values():
            for run in per_seed.values():
                steps = set(run["curves"]["valid"][0].tolist())
                shared = steps if shared is None else shared & steps
        checkpoints = sorted(shared or [])

    # Target: mean over seeds of the final validation loss of the Switch arm of the same N.
    summary: dict[str, Any] = {"root": root, "seeds": list(seeds), "checkpoints": list(checkpoints),
                               "arms": {}}
    for arm in arms:
        per_seed = runs.get(arm, {})
        router, n = arm_settings(arm)
        entry: dict[str, Any] = {"router": router if n else "dense", "num_experts": n,
                                 "finished": len(per_seed),
                                 "unfinished_seeds": partial.get(arm, []),
                                 "diverged_seeds": diverged.get(arm, [])}
        entry["valid_loss_at"] = {
            str(c): _mean_std([loss_at(*r["curves"]["valid"], c) for r in per_seed.values()])
            for c in checkpoints
        }
        finals = [float(r["curves"]["valid"][1][-1]) if len(r["curves"]["valid"][1]) else None
                  for r in per_seed.values()]
        entry["final_valid_loss"] = _mean_std(finals)
        entry["final_step"] = _mean_std([float(r["curves"]["valid"][0][-1])
                                         if len(r["curves"]["valid"][0]) else None
                                         for r in per_seed.values()])
        for key in ("bleu", "bleu_best", "best_valid_loss", "tokens_per_second"):
            entry[key] = _mean_std([r["results"].get(key) if r["results"] else None
                                    for r in per_seed.values()])
        summary["arms"][arm] = entry

    for arm in arms:
        entry = summary["arms"][arm]
        n = entry["num_experts"]
        moe_sizes = sorted(a["num_experts"] for a in summary["arms"].values() if a["num_experts"])
        # The dense arm is measured against the Switch arm of the smallest N in the study.
        reference = f"switch_n{n or (moe_sizes[0] if moe_sizes else 0)}"
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

    # Paired by seed against Switch of the same N (same data order and initial weights, so the
    # seed-to-seed variation partly cancels): arm minus Switch, mean ± std over seeds.
    for arm in arms:
        entry = summary["arms"][arm]
        reference = entry["target_arm"]
        if arm == reference or reference not in runs:
            continue
        diffs: dict[str, list[float | None]] = {"final_valid_loss": [], "bleu": [],
                                                "bleu_best": []}
        for seed, run in runs.get(arm, {}).items():
            other = runs[reference].get(seed)
            if other is None or run["results"] is None or other["results"] is None:
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
    """Two markdown tables: validation loss at fixed update counts; the final figures."""
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
            reach += f" (target {e['target_valid_loss']:.3f})"
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
    return "\n".join(lines) + "\n"


def plot(root: str, summary: dict[str, Any], out: str, window: int = 20) -> None:
    """Training (moving average) and validation loss against updates: mean over seeds, band
    from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, arm in enumerate(summary["arms"]):
        color = f"C{i}"
        curves = [read_run(run_dir(root, arm, s)) for s in summary["seeds"]
                  if read_results(run_dir(root, arm, s)) is not None]
        for ax, kind in ((ax_train, "train"), (ax_valid, "valid")):
            pairs = [c[kind] for c in curves if len(c[kind][0])]
            if not pairs:
                continue
            length = min(len(p[0]) for p in pairs)  # partial runs: the common prefix
            steps = pairs[0][0][:length]
            values = np.stack([p[1][:length] for p in pairs])
            if kind == "train":
                values = np.stack([smooth(v, window) for v in values])
            ax.plot(steps, values.mean(0), color=color, label=f"{arm} (n={len(pairs)})",
                    marker="o" if kind == "valid" else None, ms=3)
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
        # Paired by seed: validation loss minus the Switch arm's of the same seed.
        reference = summary["arms"][arm].get("target_arm")
        diffs = []
        for seed in summary["seeds"]:
            mine, other = run_dir(root, arm, seed), run_dir(root, reference or "", seed)
            if arm == reference or read_results(mine) is None or read_results(other) is None:
                continue
            (s_a, v_a), (s_b, v_b) = read_run(mine)["valid"], read_run(other)["valid"]
            common = np.intersect1d(s_a, s_b)
            diffs.append((common, v_a[np.isin(s_a, common)] - v_b[np.isin(s_b, common)]))
        if diffs:
            length = min(len(d[0]) for d in diffs)
            values = np.stack([d[1][:length] for d in diffs])
            ax_diff.plot(diffs[0][0][:length], values.mean(0), color=color, marker="o", ms=3,
                         label=f"{arm} − {reference} (n={len(diffs)})")
            ax_diff.fill_between(diffs[0][0][:length], values.min(0), values.max(0),
                                 color=color, alpha=0.2)
    ax_diff.axhline(0.0, color="k", lw=0.8)
    ax_diff.set_title("validation loss minus Switch's, same seed")
    ax_train.set_title(f"training loss (moving average, {window} updates)")
    ax_valid.set_title("validation loss (mean over seeds, band = min..max)")
    for ax in (ax_train, ax_valid, ax_diff):
        ax.set_xlabel("updates")
        ax.set_ylabel("label-smoothed cross entropy (nats)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_valid.set_ylim(top=min(ax_valid.get_ylim()[1], 7.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summarize_and_write(args: argparse.Namespace) -> dict[str, Any]:
    arms = arm_names(args.experts, dense=not args.no_dense)
    summary = summarize(args.root, arms, args.seeds)
    table = markdown(summary)
    print(table, flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(table)
    if args.plot:
        plot(args.root, summary, args.plot)
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/multi30k_compare.py")
    parser.add_argument("--root", default="/tmp/compare", help="one workdir per run under it")
    parser.add_argument("--experts", type=int, nargs="+", default=[4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="train_steps (default: config)")
    parser.add_argument("--no-dense", action="store_true", help="leave out the dense arm")
    parser.add_argument("--override", action="append", default=[],
                        help="FIELD=VALUE applied to every run's config, e.g. model.emb_dim=64")
    parser.add_argument("--out-json", help="summary JSON (default: ROOT/compare.json)")
    parser.add_argument("--out-md", help="markdown tables (default: ROOT/compare.md)")
    parser.add_argument("--plot", help="curves PNG (default: ROOT/convergence.png)")
    parser.add_argument("--summarize-only", action="store_true")
    args = parser.parse_args(argv)
    for field, name in (("out_json", "compare.json"), ("out_md", "compare.md"),
                        ("plot", "convergence.png")):
        if getattr(args, field) is None:
            setattr(args, field, os.path.join(args.root, name))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
    if not args.summarize_only:
        from experiments.wmt import enable_compilation_cache

        enable_compilation_cache()
        run_all(args)
    summarize_and_write(args)


if __name__ == "__main__":
    main()
