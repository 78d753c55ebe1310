"""What each routing option costs per training step, against the plain router.

The translation Transformer (``configs/wmt.py``, shrunk by ``--emb``, ``--mlp``, ``--layers``;
Transformer-base is ``--emb 512 --mlp 2048 --layers 6``) with ``--experts`` experts in every
other feed-forward layer, trained on random tokens: one whole update (``--micro-batches``
micro-batches of ``--tokens`` source and target tokens each, the optimizer step and, for bias
balancing, the bias step) per timed step. The plain router is Switch top-2 (softmax scores,
micro-batch balance loss); each option changes one field:

    python -m experiments.bench_routing_options            # the CPU figures in docs/routing.md
    python -m experiments.bench_routing_options --emb 512 --mlp 2048 --layers 6 --tokens 4096

Options are timed in turns (``--repeats`` rounds of ``--steps`` steps each, every option once
per round), so that a machine whose load changes affects them alike; the table gives each
option's median step and its fastest round's (the least disturbed by other work on the
machine), the ratios of both to the plain router's, and the spread of the per-round ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from lab.benchmarks.routing_options import OPTIONS, bench_config, results_table, write_json
from sparsemixer_jax import training
from sparsemixer_jax.tasks import run_config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--emb", type=int, default=128)
    add("--mlp", type=int, default=512)
    add("--layers", type=int, default=2, help="encoder and decoder layers each")
    add("--experts", type=int, default=4)
    add("--tokens", type=int, default=1024, help="source (and target) tokens per micro-batch")
    add("--length", type=int, default=64, help="sequence length")
    add("--micro-batches", type=int, default=2)
    add("--vocab", type=int, default=1000)
    add("--steps", type=int, default=5, help="timed steps per option per round")
    add("--repeats", type=int, default=3, help="rounds")
    add("--options", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    add("--build-threads", type=int, default=None,
        help="options built and compiled at once (default: one per core on a CPU; one at a "
             "time elsewhere: on an H200, builds in threads crashed in XLA's GEMM autotuning "
             "with CUDA_ERROR_ILLEGAL_INSTRUCTION, and one at a time took 6-13 s each)")
    add("--json", help="also write the settings and the table here")
    args = parser.parse_args(argv)
    if args.build_threads is None:
        args.build_threads = min(len(OPTIONS), os.cpu_count() or 1) \
            if jax.default_backend() == "cpu" else 1
    if "plain" not in args.options:
        args.options = ["plain", *args.options]
    rows = args.tokens // args.length
    rng = np.random.default_rng(0)
    batches = [{k: jnp.asarray(rng.integers(3, args.vocab, (rows, args.length), np.int32))
                for k in ("inputs", "targets")} for _ in range(args.micro_batches)]

    def build(name: str) -> list:
        """The option's steps and state, compiled and warmed up."""
        start = time.perf_counter()
        config = bench_config(args, OPTIONS[name])
        steps = training.build_steps(run_config(config), args.vocab)
        state = steps.init_state()
        for i in range(2):  # compile, then one more outside the timing
            state, _ = steps.train_step(state, batches, jax.random.key(i))
        jax.block_until_ready(state)
        # Compilation is most of a run's time on a GPU: say where it is, so a stopped run tells.
        print(f"{name}: built, compiled and warmed up in {time.perf_counter() - start:.1f} s",
              flush=True)
        return [steps, state]

    # On a CPU the options compile at once, in threads: XLA's compiler leaves Python's lock
    # while it works, so on a many-core host the builds overlap instead of taking turns.
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.build_threads) as pool:
        runs = dict(zip(args.options, pool.map(build, args.options), strict=True))
    print(f"all {len(runs)} options built in {time.perf_counter() - start:.1f} s "
          f"({args.build_threads} at once)", flush=True)

    times = {name: [] for name in args.options}  # [round] -> median seconds per step
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "build_threads")}
    for r in range(args.repeats):
        for name in args.options:
            steps, state = runs[name]
            per_step = []
            for i in range(args.steps):
                start = time.perf_counter()
                state, _ = steps.train_step(state, batches, jax.random.key(100 * r + i))
                jax.block_until_ready(state)
                per_step.append(time.perf_counter() - start)
            runs[name][1] = state
            times[name].append(float(np.median(per_step)))
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} {times[name][-1] * 1e3:.1f} ms" for name in args.options), flush=True)
        if args.json:  # the rounds so far, so that a run stopped early keeps them
            write_json(args.json, settings, None, times)

    results = results_table(args, times)
    if args.json:
        write_json(args.json, settings, results, times)
    return results


if __name__ == "__main__":
    main()
