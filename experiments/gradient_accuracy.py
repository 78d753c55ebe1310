"""How accurate is each router-gradient estimator? Exact answers on small problems.

For random routing problems (``sparsemixer_jax.analysis.random_problem``) the expert outputs are
scaled by ``s`` from 1 down to 1e-3; for each estimator the exact expected gradient is compared
with the exact ``nabla_0`` (its ``nabla_0`` part: estimate minus ``nabla_1``) and with the exact
full gradient ``nabla_0 + nabla_1``. The slope of log(relative error) against log(s) is the
estimator's order of accuracy: the paper claims 1 for forward Euler and 2 for the mid-point rule.

Top-k (``--top-k``, default 1 and 2): the same problems routed to ``k`` experts by sequential
sampling; for plain backpropagation, SparseMixer's mix, GRIN's SparseMixer-v2 and the corrected
v2star, the norm ratio ``|E| / |exact|``, the cosine and the relative error (the bias) of the
exact expected gradient against the exact top-k gradient (``analysis.topk_accuracy_sweep``).
GRIN's Appendix A reports v2 at about 0.5x the exact norm and its correction at about 1.0x.

    python -m experiments.gradient_accuracy --out results.json --plot gradient_accuracy.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import numpy as np

from sparsemixer_jax import analysis
from sparsemixer_jax.routing import router_probs

ESTIMATOR_NOTES = {
    "switch": "backprop only (nabla_0 dropped)",
    "euler": "SparseMixer-1st (forward Euler)",
    "midpoint": "mid-point rule for nabla_0 + exact nabla_1",
    "sparsemixer_2nd": "router estimator='midpoint' (mid-point on both terms)",
    "sparsemixer": "router default: reference mix, fair coin",
    "sparsemixer_paper": "router midpoint_prob=1 (paper's text)",
}
METRICS = ("relerr_nabla0", "cos_nabla0", "relerr_full", "cos_full")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gradient_accuracy.json", help="JSON results file")
    parser.add_argument("--plot", default="gradient_accuracy.png", help="log-log plot (PNG)")
    parser.add_argument("--num-problems", type=int, default=16)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16, help="expert output dimension")
    parser.add_argument("--mask", choices=("none", "reference", "paper"), default="none")
    parser.add_argument("--jitter-eps", type=float, default=0.1)
    parser.add_argument("--min-scale", type=float, default=1e-3)
    parser.add_argument("--num-scales", type=int, default=13)
    parser.add_argument(
        "--fit-below",
        type=float,
        default=0.1,
        help="fit the slope on scales <= this (the asymptotic regime)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-k", type=int, nargs="*", default=[1, 2],
                        help="also sweep top-k routing for these k (none: skip)")
    args = parser.parse_args(argv)
    if args.num_problems < 1 or args.num_experts < 2 or args.dim < 1:
        parser.error("need --num-problems >= 1, --num-experts >= 2 and --dim >= 1")
    if not 0 < args.min_scale < 1 or args.num_scales < 3:
        parser.error("need 0 < --min-scale < 1 and --num-scales >= 3")
    if any(not 1 <= k <= args.num_experts for k in args.top_k):
        parser.error(f"--top-k values must lie in [1, --num-experts={args.num_experts}]")
    return args


def run(args: argparse.Namespace) -> dict:
    """Sweep every problem; summarise with geometric means and per-problem slopes."""
    scales = np.logspace(0.0, math.log10(args.min_scale), args.num_scales)
    fit = scales <= args.fit_below * (1 + 1e-9)
    if fit.sum() < 2:
        raise SystemExit(f"--fit-below {args.fit_below} leaves fewer than 2 scales to fit")

    def probs_fn(z):
        return router_probs(z, args.jitter_eps, args.mask)

    keys = jax.random.split(jax.random.key(args.seed), args.num_problems)
    sweeps = [
        analysis.accuracy_sweep(
            analysis.random_problem(k, args.num_experts, args.dim), scales, probs_fn
        )
        for k in keys
    ]
    summary = {}
    for name in sweeps[0]:
        entry = {"note": ESTIMATOR_NOTES.get(name, "")}
        for metric in METRICS:
            values = np.array([s[name][metric] for s in sweeps])  # [problems, scales]
            if metric.startswith("relerr"):
                entry[metric] = np.exp(np.log(values).mean(0)).tolist()  # geometric mean
                slopes = [analysis.loglog_slope(scales[fit], v[fit]) for v in values]
                term = metric.removeprefix("relerr_")
                entry[f"slope_{term}"] = float(np.mean(slopes))
                entry[f"slope_{term}_std"] = float(np.std(slopes))
            else:
                entry[metric] = values.mean(0).tolist()
        summary[name] = entry
    problems = [analysis.random_problem(k, args.num_experts, args.dim) for k in keys]
    return {
        "scales": scales.tolist(),
        "fit_scales": scales[fit].tolist(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "estimators": summary,
        "topk": {str(k): _topk_summary(problems, scales, fit, probs_fn, k) for k in args.top_k},
    }


def _topk_summary(problems, scales, fit, probs_fn, top_k: int) -> dict:
    """Per estimator: mean norm ratio and cosine, geometric-mean bias and its slope."""
    sweeps = [analysis.topk_accuracy_sweep(p, scales, probs_fn, top_k) for p in problems]
    summary = {}
    for name in sweeps[0]:
        norm = np.array([s[name]["norm_ratio"] for s in sweeps])  # [problems, scales]
        cos = np.array([s[name]["cos"] for s in sweeps])
        err = np.array([s[name]["relerr"] for s in sweeps])
        slopes = [analysis.loglog_slope(scales[fit], e[fit]) for e in err]
        summary[name] = {
            "norm_ratio": norm.mean(0).tolist(),
            "norm_ratio_std": norm.std(0).tolist(),
            "cos": cos.mean(0).tolist(),
            "relerr": np.exp(np.log(err).mean(0)).tolist(),
            "slope": float(np.mean(slopes)),
            "slope_std": float(np.std(slopes)),
        }
    return summary


def print_table(results: dict) -> None:
    scales = results["scales"]
    shown = [0, len(scales) // 2, len(scales) - 1]
    head = "".join(f"  relerr0@{scales[i]:.0e}" for i in shown)
    print(f"{'estimator':18s}{head}  slope(nabla0)  slope(full)  cos0@s=1  cosF@s=1")
    for name, e in results["estimators"].items():
        errs = "".join(f"  {e['relerr_nabla0'][i]:>14.2e}" for i in shown)
        print(
            f"{name:18s}{errs}  {e['slope_nabla0']:5.2f} ± {e['slope_nabla0_std']:.2f}"
            f"  {e['slope_full']:5.2f} ± {e['slope_full_std']:.2f}"
            f"  {e['cos_nabla0'][0]:8.5f}  {e['cos_full'][0]:8.5f}   {e['note']}"
        )
    print(
        f"(relative errors: geometric mean over {results['settings']['num_problems']} problems;"
        f" slopes: mean ± std over problems, fitted on scales {results['fit_scales'][0]:.0e}"
        f"..{results['fit_scales'][-1]:.0e})"
    )
    lo = scales[-1]
    for k, table in results.get("topk", {}).items():
        print(f"\ntop-{k}: against the exact top-{k} gradient (norm ratio, cosine: mean"
              f" [± std] over problems; bias = relative error, geometric mean)")
        print(f"{'estimator':10s}  norm@s=1  norm@s={lo:.0e}        cos@s=1  cos@s={lo:.0e}"
              f"  bias@s=1  bias@s={lo:.0e}  slope(bias)")
        for name, e in table.items():
            print(
                f"{name:10s}  {e['norm_ratio'][0]:8.3f}  {e['norm_ratio'][-1]:6.3f} ± "
                f"{e['norm_ratio_std'][-1]:.3f}  {e['cos'][0]:8.4f}  {e['cos'][-1]:10.4f}"
                f"  {e['relerr'][0]:8.2e}  {e['relerr'][-1]:10.2e}  {e['slope']:5.2f} ± "
                f"{e['slope_std']:.2f}"
            )


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, term, title in (
        (axes[0], "nabla0", r"$\nabla_0$ part vs exact $\nabla_0$"),
        (axes[1], "full", r"full estimate vs exact $\nabla_0 + \nabla_1$"),
    ):
        for name, e in results["estimators"].items():
            if name == "switch" and term == "nabla0":
                continue  # relative error 1 at every scale: nabla_0 is dropped
            ax.loglog(
                results["scales"],
                e[f"relerr_{term}"],
                marker="o",
                ms=3,
                label=f"{name} (slope {e[f'slope_{term}']:.2f})",
            )
        ax.set_title(title)
        ax.set_xlabel("expert output scale s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("relative error (geometric mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with jax.enable_x64(True):  # errors reach 1e-9; float32 would hide the mid-point's order
        results = run(args)
    print_table(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return results


if __name__ == "__main__":
    main()
