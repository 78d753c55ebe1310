"""The language model's CPU training step against transformers' Mixtral in PyTorch, side by side.

    python -m experiments.cpu_peer --peer-python /path/to/torchenv/bin/python \
        --out docs/results/cpu_peer_lm.json

The peer runs under ``--peer-python``, a Python with torch and transformers (this project's
environment has neither); ``scripts/make_hf_references.py`` says how to make one. Every arm is
its own process, timed in interleaved rounds; the sizes are ``configs/lm_quickstart.py``'s
(:mod:`lab.benchmarks.cpu_peer`). ``--peer-experts eager grouped_mm`` times one peer arm per
experts kernel of transformers (the first is the reference); ``--dispatch`` one arm of ours
per MoE dispatch; ``--xla-flags NAME=FLAGS`` one more arm of ours with those XLA flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.cpu_peer import CPU_PEER_SIZES, bench_cpu_peer, ours_arm, peer_arm, report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--peer-python", required=True, help="a Python with torch and transformers")
    add("--out", default="runs/cpu_peer.json")
    add("--threads", type=int, default=2, help="the peer's torch.set_num_threads")
    add("--cpus", default="", help="pin every arm to these cores (a taskset list such as 0; "
        "give --threads as many): on cores shared with other jobs, one pinned core per arm "
        "keeps a descheduled thread from stalling the others")
    add("--peer-experts", nargs="+", default=[""], metavar="IMPL",
        help="transformers' experts kernels, one peer arm each (eager, grouped_mm, "
             "batched_mm; default: transformers' choice)")
    add("--dispatch", nargs="+", default=["auto"], choices=["auto", "ragged", "padded"],
        help="our MoE dispatch, one arm each")
    add("--xla-flags", nargs="+", default=[], metavar="NAME=FLAGS",
        help="more arms of ours (auto dispatch) with these XLA flags")
    add("--rounds", type=int, default=10)
    add("--steps", type=int, default=3, help="steps of each arm a round")
    add("--warmup", type=int, default=3, help="untimed steps of each arm (ours compiles)")
    for name, value in CPU_PEER_SIZES.items():
        add(f"--{name.replace('_', '-')}", type=int, default=value)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sizes = {name: getattr(args, name) for name in CPU_PEER_SIZES}
    arms = [peer_arm("peer" + (f"_{impl}" if impl else ""), args.peer_python, sizes,
                     args.threads, impl, args.cpus) for impl in args.peer_experts]
    arms += [ours_arm("ours" if d == "auto" else f"ours_{d}", sizes, d, cpus=args.cpus)
             for d in args.dispatch]
    for spec in args.xla_flags:
        name, _, flags = spec.partition("=")
        arms.append(ours_arm(f"ours_{name}", sizes, "auto", flags, args.cpus))
    result = bench_cpu_peer(arms, sizes, args.rounds, args.steps, args.warmup)
    return report(result, "experiments.cpu_peer", argv, args.peer_python, args.out)


if __name__ == "__main__":
    main()
