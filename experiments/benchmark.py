"""Router overhead, MoE layer against dense, training throughput and decoding, side by side.

    python -m experiments.benchmark                      # sizes for this backend: runs/bench.json
    python -m experiments.benchmark --out runs/bench_gpu.json --backend gpu --repeats 20
    python -m experiments.benchmark --emb 128 --mlp 256 --tokens 512 --experts 2 4 --repeats 2
    python -m experiments.benchmark --sections layer_cost overhead --experts 4 8 \
        --routers switch sparsemixer densemixer default_moe          # DenseMixer's cost
    python -m experiments.benchmark --sections lm_throughput --out runs/bench_lm.json
        # the language model: MoE (8 experts, top-2) vs dense, SparseMixer / DenseMixer vs top-2
    python -m experiments.benchmark --backend gpu --sections lm_throughput \
        --lm-config configs/lm_bench.py:moe --lm-routers sparsemixer_v2    # the target sizes
    bash experiments/gpu_campaign.sh                                  # every GPU figure

The sections (``--sections``), their JSON and the default sizes:
:mod:`lab.benchmarks.runner`. ``--report FILE`` prints the markdown tables of a
result file (or of each run of a file that ``gpu_campaign.sh`` merged) and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.decoding import DECODE_SHAPES, parse_shapes
from lab.benchmarks.lm_step import DOCUMENT_MASKS, LM_ACCEL_SIZES, LM_CPU_SIZES
from lab.benchmarks.report import print_report
from lab.benchmarks.runner import (
    ACCEL_SIZES,
    CPU_SIZES,
    DISPATCH_CHOICES,
    PLATFORMS,
    SECTIONS,
    BenchmarkSettings,
    run,
)
from sparsemixer_jax.moe.dispatch import GROUPED_IMPLS

DEFAULT = BenchmarkSettings()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default=DEFAULT.out)
    add("--report", default=None, metavar="JSON",
        help="print the markdown tables of an existing result file and exit")
    add("--backend", default=None, choices=sorted(PLATFORMS),
        help="JAX platform (default: JAX's default); gpu = cuda (NVIDIA)")
    add("--sections", nargs="+", default=DEFAULT.sections, choices=SECTIONS)
    add("--dispatch", default=DEFAULT.dispatch, choices=DISPATCH_CHOICES,
        help="whole-step sections (overhead, throughput, fusion, profile) and layer_cost: the "
             "MoE layers' dispatch (default auto; the LM sections: --lm-config's, else auto)")
    add("--routers", nargs="+", default=DEFAULT.routers, metavar="ROUTER",
        help="overhead and layer_cost: the routers timed against Switch (always timed), e.g. "
             "switch sparsemixer densemixer default_moe (names: sparsemixer_jax.routers.ROUTERS)")
    add("--lm-routers", nargs="+", default=DEFAULT.lm_routers, metavar="ROUTER",
        help="lm_throughput: the routers timed against top-2 softmax routing (always timed)")
    add("--lm-config", default=None, metavar="FILE[:VARIANT]",
        help="lm_throughput and lm_profile: an MoE LM config (configs/lm_bench.py:moe) giving "
             "the model, its sizes and micro-batches (the size options then apply to the other "
             "sections only); the dense arm is its dense twin (configs/lm_bench.py:dense)")
    add("--lm-document-mask", default=DEFAULT.lm_document_mask, choices=DOCUMENT_MASKS,
        help="lm_throughput and lm_profile: how cuDNN's attention gets the batch's documents: "
             "bias (model.cudnn_document_mask), offsets (cuDNN's packed layout), causal (no "
             "segment ids: its causal flag alone)")
    add("--lm-grouped-impl", default=None, choices=GROUPED_IMPLS,
        help="lm_throughput and lm_profile: --lm-config's model.grouped_impl replaced")
    add("--kv-heads", type=int, default=None,
        help=f"lm_throughput: key/value heads (default: {LM_CPU_SIZES['kv_heads']} on CPU, "
             f"{LM_ACCEL_SIZES['kv_heads']} else)")
    add("--lm-experts", type=int, default=None,
        help=f"lm_throughput: experts per MoE layer (default {LM_CPU_SIZES['experts']})")
    add("--top-k", type=int, default=None,
        help=f"lm_throughput: experts per token (default {LM_CPU_SIZES['top_k']})")
    add("--layer-dispatches", nargs="+", default=DEFAULT.layer_dispatches,
        choices=["ragged", "padded", "grouped"],
        help="moe_vs_dense: the dispatch implementations timed against dense")
    add("--attention-impl", default=DEFAULT.attention_impl,
        choices=["einsum", "xla", "cudnn", "auto"],
        help="whole-step sections: model.attention_impl (not einsum: attention dropout 0; "
             "default einsum; the LM sections: --lm-config's, else einsum)")
    add("--rng-impl", default=None, choices=["threefry2x32", "rbg", "unsafe_rbg"],
        help="jax_default_prng_impl for the whole run (default: jax's)")
    add("--triton-ragged-dot", action="store_true",
        help="turn on ragged_dot's Pallas/Triton GPU lowering (where this jax has it; recorded "
             "in the JSON)")
    add("--deterministic", action="store_true",
        help="XLA's deterministic GPU ops (runtime.deterministic)")
    add("--decode-beam", type=int, default=DEFAULT.decode_beam)
    add("--decode-extra-len", type=int, default=DEFAULT.decode_extra_len,
        help="decode: output length limit = source length + this")
    add("--decode-shapes", nargs="+", default=None, metavar="NAME=ROWSxLEN",
        help=f"decode: batches to time (default {DECODE_SHAPES})")
    add("--experts", type=int, nargs="+", default=DEFAULT.experts)
    add("--dtype", default=None, choices=["float32", "bfloat16"],
        help="compute dtype (default: float32 on CPU, bfloat16 elsewhere)")
    add("--profile-dir", default=DEFAULT.profile_dir,
        help="section 'profile': where jax.profiler writes its trace")
    add("--profile-steps", type=int, default=DEFAULT.profile_steps)
    add("--step-seconds", type=float, default=None,
        help="router: the whole step's time to relate the routers' cost to (default: the "
             "fastest Switch step of this run's overhead section)")
    add("--layer-dropout", type=float, default=DEFAULT.layer_dropout,
        help="moe_vs_dense: activation dropout of both layers (0 = none)")
    add("--warmup", type=int, default=DEFAULT.warmup)
    add("--repeats", type=int, default=DEFAULT.repeats)
    for name in CPU_SIZES:
        add(f"--{name}", type=int, default=None,
            help=f"default: {CPU_SIZES[name]} on CPU, {ACCEL_SIZES[name]} else; "
                 f"lm_throughput: {LM_CPU_SIZES[name]}, {LM_ACCEL_SIZES[name]}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            result = json.load(f)
        print_report(result)
        return result
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchmarkSettings)}
    if args.decode_shapes:
        options["decode_shapes"] = parse_shapes(args.decode_shapes)
    command = " ".join(["python -m experiments.benchmark", *argv])
    return run(BenchmarkSettings(**options), command)


if __name__ == "__main__":
    main()
