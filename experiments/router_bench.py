"""Router-learning benchmark: where does SparseMixer's router gradient pay off against Switch?

A student MoE (the project's ``MoEFeedForward``) learns a teacher MoE's labels; every arm is
trained on all seeds at once and compared with Switch seed by seed (docs/router_bench.md).

    python -m experiments.router_bench                   # main table, 20 seeds
    python -m experiments.router_bench --table depth     # 3 stacked residual MoE layers
    python -m experiments.router_bench --table gate      # a soft-gated (Switch-family) teacher
    python -m experiments.router_bench --table successors  # DenseMixer, Default MoE vs Switch
    python -m experiments.router_bench --table robustness  # which setup choices decide the sign
    python -m experiments.router_bench --table balancing   # every estimator x every balancing
    python -m experiments.router_bench --table balancing_settings \
        --merge docs/results/router_bench_balancing.json   # 8 micro-batches, other bias rates
    python -m experiments.router_bench --table scores \
        --merge docs/results/router_bench_balancing.json   # sigmoid scores, with and without bias
    python -m experiments.router_bench --quick           # 3 arms, 4 seeds, 200 steps
    python -m experiments.router_bench --report-only     # tables and plot from the JSON

Results are written to the JSON (default ``runs/router_bench/<table>.json``, outside the
tracked files) after every arm; a rerun skips arms already there. ``--reuse`` takes the results
of arms trained before under other names (the same configuration and run settings). Arms the
router's config refuses are not trained: the JSON lists them under ``refused`` with the reason.
``--time-rounds R`` then times one training step of every arm after compilation (R interleaved
rounds of ``--time-steps`` steps); the cost table reports it beside the quality columns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lab.router_bench import report
from lab.router_bench.arms import PLOT_ARMS, TABLES
from lab.router_bench.balancing_report import markdown_balancing_table, refusals
from lab.router_bench.report import reused
from lab.router_bench.train import TrainConfig, time_steps, train_arm


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", choices=sorted(TABLES), default="main")
    p.add_argument("--quick", action="store_true", help="quick table, 4 seeds, 200 steps")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--arms", nargs="*", help="only these arms of the table")
    p.add_argument("--out", help="JSON (default runs/router_bench/<table>.json)")
    p.add_argument("--plot", help="PNG (default: the JSON's name with .png)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--versus", help="compare every arm of its setting with this arm instead")
    p.add_argument("--time-rounds", type=int, default=0,
                   help="then time one training step of every arm after compilation, this many "
                        "interleaved rounds (with --report-only: without training)")
    p.add_argument("--time-steps", type=int, default=200, help="steps of each timed run")
    p.add_argument("--merge", nargs="*", default=[],
                   help="JSONs of other runs whose arms join the report (same config)")
    p.add_argument("--reuse", nargs="*", default=[],
                   help="JSONs of other tables: an arm of this table configured exactly as one "
                        "of theirs (name and gradient measurement aside; same run settings) "
                        "takes its result instead of training again")
    args = p.parse_args(argv)
    if args.quick:
        args.table, args.seeds, args.steps = "quick", min(args.seeds, 4), min(args.steps, 200)
    args.out = args.out or os.path.join("runs", "router_bench", f"{args.table}.json")
    args.plot = args.plot or args.out.rsplit(".", 1)[0] + ".png"
    if args.steps % args.eval_every:
        p.error("--steps must be a multiple of --eval-every")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig(steps=args.steps, eval_every=args.eval_every)
    if args.quick:
        cfg = cfg._replace(train_size=2048, eval_size=512, grad_tokens=128)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            saved = json.load(f)
        if saved.get("config") == cfg._asdict():
            results = saved["arms"]
    arms = [a for a in TABLES[args.table]() if not args.arms or a.name in args.arms]
    refused = refusals(arms)
    for name, why in refused.items():
        print(f"{name}: refused: {why}", flush=True)
    arms = [a for a in arms if a.name not in refused]

    def save() -> None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": cfg._asdict(), "arms": results, "refused": refused}, f)

    if refused and not args.report_only:  # the refusals are results too
        save()
    seeds = list(range(args.seeds))
    for path in args.reuse:
        results = {**reused(path, arms, cfg, len(seeds)), **results}
    cache: dict = {}
    for arm in arms if not args.report_only else []:
        if arm.name in results and len(results[arm.name]["per_seed"]["final_eval_mse"]) == len(
                seeds):
            continue
        t0 = time.perf_counter()
        history, timings = train_arm(arm, cfg, seeds, cache)
        timings["total_s"] = time.perf_counter() - t0
        results[arm.name] = report.summarise(arm, history, timings)
        print(f"{arm.name}: {timings['total_s']:.0f} s", flush=True)
        save()
    if args.time_rounds > 0:
        timed = [a for a in arms if a.name in results]
        load_before = os.getloadavg()[0]
        times = time_steps(timed, cfg, seeds, args.time_steps, args.time_rounds, cache)
        load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        for name, per_round in times.items():
            results[name]["step_time_s"] = {"steps": args.time_steps, "load_1m": load,
                                            "rounds": [round(t, 6) for t in per_round]}
            print(f"{name}: {1e3 * min(per_round):.2f} ms per step (min of "
                  f"{len(per_round)} rounds)", flush=True)
        save()
    for path in args.merge:
        with open(path) as f:
            results = {**json.load(f)["arms"], **results}
    print(report.markdown_table(results, args.versus))
    print()
    if args.table in ("balancing", "balancing_settings", "scores"):
        print(markdown_balancing_table(results, refused, TABLES[args.table]()))
        print()
    if args.table == "robustness":  # expert widths differ by family: no cost table
        print(report.markdown_robustness_table(results))
    else:
        print(report.markdown_cost_table(results, cfg.dim, cfg.hidden, args.versus))
    report.plot(results, PLOT_ARMS[args.table], args.plot, title=f"{args.table}: mean ± SE "
                f"over {args.seeds} seeds")
    return results


if __name__ == "__main__":
    main()
