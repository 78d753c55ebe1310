"""Micro-benchmark of the grouped matmul's Mosaic GPU products, one kernel config against another.

``python -m experiments.bench_grouped --products``: for each ``K x N`` of ``--widths``, each
product (``forward``: ``[rows, K] x [G, K, N]``; ``input_grad``: ``[rows, K] x [G, N, K]^T``,
as the input gradient of a ``[G, N, K]`` weight reads it; ``weight_grad``: ``[rows, K]^T x
[rows, N]`` per group, the gradient of a ``[G, K, N]`` weight), each ``--warpgroups`` and each
``--tiles``: the median time of the product alone (``mosaic_matmul``, ``mosaic_weight_grad``
of :mod:`sparsemixer_jax.kernels.mosaic_grouped_matmul`) on rows routed uniformly at random to
``--experts`` groups, and its rate, ``2 x rows x K x N`` FLOP over that time. (JAX's
one-warpgroup weight-gradient kernel computes ``[block_n, block_n]`` output tiles; ours, and
every forward and input-gradient kernel, ``[block_m, block_n]``.) The
language model's expert products (``configs/lm_bench.py:moe``: 8 experts, a micro-batch of
8 x 4,096 tokens routed top-2, 65,536 rows; SwiGLU of width 2048: ``[2048, 4096]`` in,
``[2048, 2048]`` out) are ``--experts 8 --tokens 65536 --widths 2048x4096 2048x2048
4096x2048``. Tiles a config refuses (shared memory, registers) are recorded with the refusal.
``--target h100:1x1x1`` compiles each case for a compile-only H100 and times nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lab.benchmarks.timing import targeting, time_calls
from sparsemixer_jax.kernels import GroupedMatmulConfig, mosaic_matmul, mosaic_weight_grad

PRODUCTS = ("forward", "input_grad", "weight_grad")


def parse_sizes(text: str, names: Sequence[str], flag: str, example: str) -> dict[str, int]:
    """``"128x256x64x4"`` -> ``dict(zip(names, (128, 256, 64, 4)))``; one line if malformed."""
    parts = text.lower().split("x")
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{flag} {text!r}: expected {len(names)} positive integers joined by "
                         f"'x' ({', '.join(names)}), e.g. {example}")
    return dict(zip(names, map(int, parts), strict=True))


def _product(product: str, config: GroupedMatmulConfig, operands: dict[str, jax.Array]):
    """``(fn, args)``: one product of ``config`` as a jitted function and its arguments."""
    lhs, sizes = operands["lhs"], operands["sizes"]
    if product == "weight_grad":
        return (jax.jit(lambda a, b, s: mosaic_weight_grad(a, b, s, config)),
                (lhs, operands["dout"], sizes))
    transpose_rhs = product == "input_grad"
    rhs = operands["rhs_t" if transpose_rhs else "rhs"]
    return jax.jit(lambda a, b, s: mosaic_matmul(a, b, s, config, transpose_rhs)), (lhs, rhs, sizes)


def run(*, experts: int, rows: int, widths: Sequence[tuple[int, int]],
        warpgroups: Sequence[int], tiles: Sequence[dict[str, int]], dtype: str = "bfloat16",
        warmup: int = 2, repeats: int = 10, interpret: bool = False, num_sms: int | None = None,
        compile_device: Any = None) -> list[dict[str, Any]]:
    """One row per (widths, product, warpgroups, tiles): ``ms`` and ``tflops`` when timed, the
    ``error`` line of a refused config, or with ``compile_device`` only ``compile_seconds``."""
    dt = jnp.dtype(dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    group = jax.random.randint(keys[0], (rows,), 0, experts)
    sizes = jnp.bincount(group, length=experts).astype(jnp.int32)  # every row in a group
    placed = None if compile_device is None else jax.sharding.SingleDeviceSharding(compile_device)
    out = []
    for k, n in widths:
        operands = dict(lhs=jax.random.normal(keys[1], (rows, k), dt),
                        rhs=jax.random.normal(keys[2], (experts, k, n), dt) / k ** 0.5,
                        rhs_t=jax.random.normal(keys[3], (experts, n, k), dt) / k ** 0.5,
                        dout=jax.random.normal(keys[4], (rows, n), dt), sizes=sizes)
        if placed is not None:  # a compile-only device holds no data: shapes only
            operands = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
                        for name, a in operands.items()}
        for product in PRODUCTS:
            for wg in warpgroups:
                for tile in tiles:
                    row: dict[str, Any] = dict(product=product, k=k, n=n, rows=rows,
                                               experts=experts, warpgroups=wg, **tile)
                    try:
                        # The weight-gradient kernel's rules apply where it runs;
                        # zero_past_groups: every row is in a group, nothing to mask.
                        config = GroupedMatmulConfig(
                            warpgroups=wg, interpret=interpret, num_sms=num_sms,
                            weight_grad="kernel" if product == "weight_grad" else "xla",
                            zero_past_groups=True, **tile)
                        fn, args = _product(product, config, operands)
                        started = time.perf_counter()
                        with targeting(compile_device):
                            compiled = fn.lower(*args).compile()
                        row["compile_seconds"] = time.perf_counter() - started
                        if compile_device is None:
                            seconds = statistics.median(time_calls(
                                lambda c=compiled, a=args: c(*a), warmup, repeats))
                            row["ms"] = 1e3 * seconds
                            row["tflops"] = 2 * rows * k * n / seconds / 1e12
                    except ValueError as err:  # a refused config; a GPU that is not sm90
                        row["error"] = str(err).splitlines()[0]
                    out.append(row)
                    print(_shown(row), flush=True)
    return out


def _shown(row: dict[str, Any]) -> str:
    what = (f"{row['product']:<10s} K={row['k']:<5d} N={row['n']:<5d} wg={row['warpgroups']} "
            f"{row['block_m']}x{row['block_n']}x{row['block_k']}x{row['max_concurrent_steps']}")
    if "error" in row:
        return f"{what}  error: {row['error']}"
    if "ms" not in row:
        return f"{what}  compiled in {row['compile_seconds']:.1f} s"
    return f"{what}  {row['ms']:8.3f} ms  {row['tflops']:6.1f} TFLOP/s"
