"""Overlay loss curves and router diagnostics of several runs against updates.

    python -m experiments.plot runs/switch runs/sparsemixer --out runs/curves.png \
        --diagnostics runs/router.png

Reads each run's ``metrics.jsonl`` (or, for a run of ``experiments.compare`` whose log was not
kept, its compact ``curves.json``); the label is the directory name and the router. The
diagnostics figure shows, per run, the mean over its MoE layers (band: the layers' min to max) of
the router diagnostics logged at ``log_every`` (:mod:`sparsemixer_jax.router_diagnostics`).
"""

from __future__ import annotations

import argparse
import os
import sys

from lab.studies.curves import plot_diagnostics, plot_losses, read_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", default="runs/curves.png")
    parser.add_argument("--diagnostics", help="also draw the router diagnostics to this PNG")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window (steps)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    runs = [read_run(w) for w in args.workdirs]
    for path in (args.out, args.diagnostics):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    plot_losses(runs, args.out, args.smooth)
    print(f"wrote {args.out}")
    if args.diagnostics:
        plot_diagnostics({run["label"]: [run] for run in runs}, args.diagnostics)
        print(f"wrote {args.diagnostics}")


if __name__ == "__main__":
    main()
