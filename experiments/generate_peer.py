"""Greedy generation on the CPU against transformers' ``generate`` in PyTorch, side by side.

    python -m experiments.generate_peer --peer-python /path/to/torchenv/bin/python \
        --out docs/results/generate_peer_cpu.json

One tiny random Mixtral (the model sizes of ``experiments.cpu_peer``) is saved as a Hugging
Face directory that both arms load; each arm is its own process, timed in interleaved rounds
(:mod:`lab.benchmarks.generate_peer`). A step is one ``generate`` call: ``--batch`` prompts of
``--prompt`` tokens continued by ``--new-tokens`` greedy tokens. Without ``--peer-python`` only
our arm runs. The result records each arm's new tokens per second and whether the arms
generated the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.cpu_peer import bench_cpu_peer, report
from lab.benchmarks.generate_peer import (
    GENERATE_PEER_SIZES,
    agreement,
    ours_arm,
    peer_arm,
    write_model,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--peer-python", default="", help="a Python with torch and transformers")
    add("--out", default="runs/generate_peer.json")
    add("--threads", type=int, default=2, help="the peer's torch.set_num_threads")
    add("--peer-experts", nargs="+", default=[""], metavar="IMPL",
        help="transformers' experts kernels, one peer arm each (eager, grouped_mm, "
             "batched_mm; default: transformers' choice); the first is the reference")
    add("--cpus", default="", help="pin every arm to these cores (a taskset list such as 0)")
    add("--rounds", type=int, default=8)
    add("--steps", type=int, default=2, help="generate calls of each arm a round")
    add("--warmup", type=int, default=2, help="untimed calls of each arm (ours compiles)")
    for name, value in GENERATE_PEER_SIZES.items():
        add(f"--{name.replace('_', '-')}", type=int, default=value)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sizes = {name: getattr(args, name) for name in GENERATE_PEER_SIZES}
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(sizes, model_dir)
        arms = [peer_arm("peer" + (f"_{impl}" if impl else ""), args.peer_python, model_dir,
                         sizes, args.threads, impl, args.cpus)
                for impl in args.peer_experts] if args.peer_python else []
        arms.append(ours_arm("ours", model_dir, sizes, args.cpus))
        # Tokens a step: every row's new tokens (the driver's tokens/s).
        result = bench_cpu_peer(arms, {**sizes, "tokens": sizes["batch"] * sizes["new_tokens"]},
                                args.rounds, args.steps, args.warmup)
    result["agreement"] = agreement(result)
    return report(result, "experiments.generate_peer", argv, args.peer_python, args.out,
                  "call", [f"agreement with {result['reference']}: {result['agreement']}"])


if __name__ == "__main__":
    main()
