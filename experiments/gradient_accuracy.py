"""How accurate is each router-gradient estimator? Exact answers on small problems.

For random routing problems (``sparsemixer_jax.exact.random_problem``) the expert
outputs are scaled by ``s`` from 1 down to 1e-3; for each estimator the exact expected gradient
is compared with the exact ``nabla_0`` (its ``nabla_0`` part: estimate minus ``nabla_1``) and
with the exact full gradient ``nabla_0 + nabla_1``. The slope of log(relative error) against
log(s) is the estimator's order of accuracy: the paper claims 1 for forward Euler and 2 for the
mid-point rule.

Top-k (``--top-k``, default 1 and 2): the same problems routed to ``k`` experts by sequential
sampling; for plain backpropagation, SparseMixer's mix, GRIN's SparseMixer-v2 and the corrected
v2star, the norm ratio ``|E| / |exact|``, the cosine and the relative error (the bias) of the
exact expected gradient against the exact top-k gradient
(``lab.exact_experiment.topk_accuracy_sweep``). GRIN's Appendix A reports v2 at about 0.5x the
exact norm and its correction at about 1.0x.

Both tables also hold DenseMixer (as released and as its blog writes it) and Default MoE (row
``default_moe``: the defaults also in the forward, the router ``default_moe_forward``; row
``default_moe_st``: in the backward only, the router ``default_moe``),
which also send the router a gradient for experts the token did not choose. Default MoE's
default vectors are the expert outputs plus noise (``--default-noise``, relative to each
output's norm); the ``*_oracle`` rows use the expert outputs themselves.

    python -m experiments.gradient_accuracy     # runs/gradient_accuracy.json and .png
    python -m experiments.gradient_accuracy --num-groups 4 --top-groups 2   # group-limited
    python -m experiments.gradient_accuracy --score sigmoid --selection-bias 0.1  # sigmoid
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from lab.exact_experiment import SweepSettings, accuracy_experiment
from lab.studies.gradient_accuracy import plot, print_table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Under the git-ignored runs/, as every command's default output.
    parser.add_argument("--out", default="runs/gradient_accuracy.json", help="JSON results file")
    parser.add_argument("--plot", default="runs/gradient_accuracy.png",
                        help="log-log plot (PNG; empty: none)")
    default = SweepSettings()
    add = parser.add_argument
    add("--num-problems", type=int, default=default.num_problems)
    add("--num-experts", type=int, default=default.num_experts)
    add("--dim", type=int, default=default.dim, help="expert output dimension")
    add("--mask", choices=("none", "reference", "paper"), default=default.mask)
    add("--jitter-eps", type=float, default=default.jitter_eps)
    add("--min-scale", type=float, default=default.min_scale)
    add("--num-scales", type=int, default=default.num_scales)
    add("--fit-below", type=float, default=default.fit_below,
        help="fit the slope on scales <= this (the asymptotic regime)")
    add("--seed", type=int, default=default.seed)
    add("--top-k", type=int, nargs="*", default=default.top_k,
        help="also sweep top-k routing for these k (none: skip)")
    add("--default-noise", type=float, default=default.default_noise,
        help="noise of Default MoE's default vectors, relative to each expert output's norm")
    add("--num-groups", type=int, default=default.num_groups,
        help="group-limited routing: the experts in this many groups (1: none)")
    add("--top-groups", type=int, default=default.top_groups,
        help="group-limited routing: the groups each token keeps")
    add("--selection-bias", type=float, default=default.selection_bias,
        help="std of a random selection-only bias per expert (SparseMixer's rows; 0: none)")
    add("--score", choices=("softmax", "sigmoid"), default=default.score,
        help="sigmoid: SparseMixer under sigmoid scores (the bias is added to the scores)")
    add("--routed-scaling-factor", type=float, default=default.routed_scaling_factor,
        help="the sigmoid gates' scale c (only with --score sigmoid)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = SweepSettings(**{f.name: getattr(args, f.name)
                                    for f in dataclasses.fields(SweepSettings)})
    except ValueError as err:
        parser.error(str(err))
    results = accuracy_experiment(settings)
    print_table(results)
    for path in (args.out, args.plot):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return results


if __name__ == "__main__":
    main()
