"""Micro-benchmark: forward + backward of the expert FFN per dispatch, against the dense FFN.

For each number of experts ``N``: random routing of ``tokens`` rows, then the median time of one
``jax.grad`` call (w.r.t. the rows and all four parameters, activation dropout 0.1) of

* ``dense``: one FFN of the same width over every row (the cost a dropless MoE should approach);
* ``padded``: ``moe.dispatch._padded_ffn`` dropless (block-padded batched matmul);
* ``grouped``: :func:`sparsemixer_jax.moe.dispatch.grouped_ffn` (Mosaic GPU grouped matmuls);
* ``padded_cap{c}`` / ``grouped_cap{c}``: Switch capacity ``c``: rows past their expert's
  capacity get no expert (as the layer's ``capacity_keep`` does); padded uses the Switch
  ``[N, capacity, emb]`` layout.

Every row also records ``compile_time_model``: XLA's figures for the compiled executable (FLOPs
and bytes accessed from its cost analysis, argument / temporary / total bytes from its memory
analysis, Mosaic kernels in the program). They are the compiler's model, known before it runs,
never a timing. ``--target h100:1x1x1`` compiles for a compile-only H100 (no GPU needed, see
:mod:`sparsemixer_jax.aot.targets`) and records only that model.

``--interpret --tiny`` runs a few hundred rows with the kernels in the Mosaic GPU interpreter,
so the whole path is checked on a CPU. ``--products`` times the grouped matmul's products alone
per kernel config instead (:mod:`lab.benchmarks.grouped_products`). Entry point:
``python -m experiments.bench_grouped``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lab.benchmarks.timing import environment, targeting, time_calls
from sparsemixer_jax import moe
from sparsemixer_jax.aot import analysis
from sparsemixer_jax.moe.dispatch import ExpertRows, grouped_ffn

FULL = dict(tokens=32768, emb=512, mlp=2048)
TINY = dict(tokens=256, emb=64, mlp=128)
DROPOUT = 0.1


def _dense_ffn(rows: ExpertRows) -> jax.Array:
    """One dense FFN (the first expert's weights) on every row: the baseline."""
    h = jax.nn.relu(rows.x @ rows.wi[0] + rows.bi[0])
    return moe.dispatch.row_dropout(h, rows.token_ids, rows.drop_key, rows.rate) @ rows.wo[0] \
        + rows.bo[0]


def compile_time_model(compiled: jax.stages.Compiled, seconds: float) -> dict[str, Any]:
    """XLA's figures for one compiled executable (its cost and memory analyses), per device."""
    report = analysis.analyse("", compiled, seconds)
    return {"flops": report.flops, "bytes_accessed": report.bytes_accessed,
            "argument_bytes": report.arguments, "temporary_bytes": report.temporaries,
            "total_bytes": report.total, "mosaic_kernels": report.kernels,
            "compile_seconds": seconds}


def _abstract_on(device: Any, tree: Any) -> Any:
    """``tree``'s arrays as shapes placed on ``device`` (a compile-only device holds no data)."""
    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), tree)


def _grad_step(ffn: Callable, token_ids: jax.Array, key: jax.Array) -> Callable:
    """jit ``(group, x, wi, bi, wo, bo) -> grads``; the routing is an argument, so the dropless
    and capacity runs of one dispatch share a compilation."""

    def loss(x, wi, bi, wo, bo, group):
        # Squared, so the backward pass needs the output: the gradient of a plain sum does not,
        # and XLA would drop the forward's second matmul (a grouped one: 5 kernels, not 6).
        y = ffn(ExpertRows(x, group, token_ids, wi, bi, wo, bo, key, DROPOUT)
                ).astype(jnp.float32)
        return 0.5 * jnp.sum(jnp.square(y))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    return jax.jit(lambda group, *args: grad(*args, group))


def run(
    experts: Sequence[int], *, tokens: int, emb: int, mlp: int, dtype: str = "bfloat16",
    capacities: Sequence[float] = (1.0, 1.25), warmup: int = 2, repeats: int = 10,
    interpret: bool = False, grouped_options: dict[str, Any] | None = None,
    compile_device: Any = None,
) -> list[dict[str, Any]]:
    """One row per (N, dispatch): median / min milliseconds and the ratio to ``dense``, and the
    executable's ``compile_time_model``. With ``compile_device`` (a compile-only device of
    :func:`sparsemixer_jax.aot.targets.target_devices`) nothing runs: each case is compiled for
    that device and only its model is recorded."""
    grouped_options = dict(grouped_options or {})
    dt = jnp.dtype(dtype)
    rows: list[dict[str, Any]] = []
    keys = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(keys[0], (tokens, emb), dt)
    token_ids = jnp.arange(tokens, dtype=jnp.int32)

    def grouped(rows):
        return grouped_ffn(rows, interpret=interpret, **grouped_options)

    for n in experts:
        wi = (jax.random.normal(keys[1], (n, emb, mlp)) / emb ** 0.5).astype(dt)
        wo = (jax.random.normal(keys[2], (n, mlp, emb)) / mlp ** 0.5).astype(dt)
        bi, bo = jnp.zeros((n, mlp), dt), jnp.zeros((n, emb), dt)
        params = (x, wi, bi, wo, bo)
        group = jax.random.randint(keys[3], (tokens,), 0, n, jnp.int32)
        cases: dict[str, tuple[Callable, jax.Array, tuple]] = {
            "dense": (_dense_ffn, group, (x, wi[:1], bi[:1], wo[:1], bo[:1])),
            "padded": (lambda rows: moe.dispatch.padded_ffn(rows, capacity=None), group,
                       params),
            "grouped": (grouped, group, params),
        }
        for c in capacities:
            cap = moe.expert_capacity(c, tokens, n)
            kept = moe.capacity_keep(group, jnp.ones((tokens,), bool), n, cap)
            capped = jnp.where(kept, group, n)
            cases[f"padded_cap{c}"] = (
                lambda rows, cap=cap: moe.dispatch.padded_ffn(rows, capacity=cap), capped,
                params)
            cases[f"grouped_cap{c}"] = (grouped, capped, params)
        dense_ms = None
        steps: dict[int, Callable] = {}
        for name, (ffn, g, args) in cases.items():
            row: dict[str, Any] = {"experts": n, "dispatch": name}
            try:
                if id(ffn) not in steps:
                    steps[id(ffn)] = _grad_step(ffn, token_ids, keys[4])
                inputs = (g, *args)
                if compile_device is not None:
                    inputs = _abstract_on(compile_device, inputs)
                started = time.perf_counter()
                with targeting(compile_device):
                    compiled = steps[id(ffn)].lower(*inputs).compile()
                row["compile_time_model"] = compile_time_model(
                    compiled, time.perf_counter() - started)
                if compile_device is None:
                    times = time_calls(lambda c=compiled, i=inputs: c(*i), warmup, repeats)
            except ValueError as err:  # e.g. the Mosaic kernels on a GPU that is not sm90
                row["error"] = str(err)
            else:
                if compile_device is None:
                    row["ms"] = 1e3 * statistics.median(times)
                    row["ms_min"] = 1e3 * min(times)
                    if name == "dense":
                        dense_ms = row["ms"]
                    row["vs_dense"] = row["ms"] / dense_ms if dense_ms else None
            rows.append(row)
            print(f"N={n:<3d} {name:<16s} {_shown(row)}", flush=True)
    return rows


def _shown(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    model = row["compile_time_model"]
    flops = "n/a" if model["flops"] is None else f"{model['flops'] / 1e9:.1f} GFLOP"
    shown = (f"[compile-time model: {flops}, temporaries {model['temporary_bytes'] / 2**20:.0f} "
             f"MiB, {model['mosaic_kernels']} Mosaic kernels]")
    if "ms" not in row:
        return shown
    ratio = row["vs_dense"]
    return f"{row['ms']:9.2f} ms" + (f"  x{ratio:.2f}" if ratio else "") + "  " + shown


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--emb", type=int, default=None)
    parser.add_argument("--mlp", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--capacities", type=float, nargs="*", default=[1.0, 1.25])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--impl", default="mosaic", choices=["mosaic", "xla"])
    parser.add_argument("--block-m", type=int, default=None)
    parser.add_argument("--block-n", type=int, default=None)
    parser.add_argument("--weight-grad", default="auto", choices=["auto", "kernel", "xla"])
    parser.add_argument("--interpret", action="store_true",
                        help="run the Mosaic kernels in the interpreter (any backend)")
    parser.add_argument("--tiny", action="store_true", help="a few hundred rows, one repeat")
    parser.add_argument("--block-k", type=int, default=None)
    parser.add_argument("--target", default=None,
                        help="compile for this compile-only target (h100:1x1x1) without running")
    parser.add_argument("--products", action="store_true",
                        help="time the grouped matmul's forward and input-gradient products "
                        "per kernel config (--widths, --warpgroups, --tiles), not the FFN")
    parser.add_argument("--widths", nargs="+", default=None,
                        help="--products: KxN contraction x output widths; default: emb x mlp "
                        "and mlp x emb")
    parser.add_argument("--warpgroups", type=int, nargs="+", default=[1],
                        help="consumer warpgroups per program of the Mosaic kernels: 1 or 2 "
                        "(with --products: 1 and/or 2)")
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="--products: block_m x block_n x block_k x pipeline stages, e.g. "
                        "128x256x64x4; default: --block-m/-n/-k, 4 stages")
    parser.add_argument("--num-sms", type=int, default=None,
                        help="--products: programs of the persistent grids (default: the SMs)")
    parser.add_argument("--json", default=None, help="write the result here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark from command-line arguments; returns (and writes) its JSON."""
    args = parse_args(argv)
    sizes = dict(TINY if args.tiny else FULL)
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    block = 64 if args.tiny else 128
    options = {"impl": args.impl, "weight_grad": args.weight_grad,
               "block_m": args.block_m or block, "block_n": args.block_n or block}
    if args.block_k is not None:
        options["block_k"] = args.block_k
    compile_device = None
    if args.target is not None:
        from sparsemixer_jax.aot import targets

        compile_device = targets.target_devices(args.target)[0]
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 10)
    if args.products:
        return _products(args, sizes, options, warmup, repeats, compile_device)
    if len(args.warpgroups) != 1:
        raise ValueError(f"--warpgroups takes one count without --products, got "
                         f"{args.warpgroups}")
    options["warpgroups"] = args.warpgroups[0]
    rows = run(args.experts, dtype=args.dtype, capacities=args.capacities, warmup=warmup,
               repeats=repeats, interpret=args.interpret, grouped_options=options,
               compile_device=compile_device, **sizes)
    result = {"environment": environment(),
              "config": {**sizes, "dtype": args.dtype, "dropout": DROPOUT, "warmup": warmup,
                         "repeats": repeats, "interpret": args.interpret, "grouped": options,
                         "target": args.target},
              "rows": rows}
    _write_json(args.json, result)
    return result


def _products(args: argparse.Namespace, sizes: dict[str, int], options: dict[str, Any],
              warmup: int, repeats: int, compile_device: Any) -> dict[str, Any]:
    """``--products``: :func:`lab.benchmarks.grouped_products.run` on one expert count, with
    ``--tokens`` rows."""
    from lab.benchmarks import grouped_products

    if len(args.experts) != 1:
        raise ValueError(f"--products takes one --experts count, got {args.experts}")
    tile_names = ("block_m", "block_n", "block_k", "max_concurrent_steps")
    default_tile = f"{options['block_m']}x{options['block_n']}x{options.get('block_k', 64)}x4"
    tiles = [grouped_products.parse_sizes(t, tile_names, "--tiles", "128x256x64x4")
             for t in args.tiles or [default_tile]]
    default_widths = [f"{sizes['emb']}x{sizes['mlp']}", f"{sizes['mlp']}x{sizes['emb']}"]
    widths = [tuple(grouped_products.parse_sizes(w, ("k", "n"), "--widths", "2048x4096").values())
              for w in args.widths or default_widths]
    rows = grouped_products.run(
        experts=args.experts[0], rows=sizes["tokens"], widths=widths, warpgroups=args.warpgroups,
        tiles=tiles, dtype=args.dtype, warmup=warmup, repeats=repeats, interpret=args.interpret,
        num_sms=args.num_sms, compile_device=compile_device)
    result = {"environment": environment(),
              "config": {**sizes, "experts": args.experts[0], "dtype": args.dtype,
                         "warmup": warmup, "repeats": repeats, "interpret": args.interpret,
                         "target": args.target, "products": True},
              "rows": rows}
    _write_json(args.json, result)
    return result


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
