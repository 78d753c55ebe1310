"""Gated DeltaNet's chunked form (:func:`~sparsemixer_jax.layers.delta_rule.chunk_gated_delta_rule`)
against the plain token-by-token scan on CPU, and its roofline on one H100 against causal
attention at the same width.

    python -m lab.benchmarks.gated_deltanet --cpu            # CPU seconds, interleaved rounds
    python -m lab.benchmarks.gated_deltanet --roofline       # compile for h100:1x1, no GPU

``--cpu`` times the forward and the forward + backward (gradients of all inputs) of the chunked
form (chunks of 64) and of :func:`~sparsemixer_jax.layers.delta_rule.recurrent_gated_delta_rule`
at a few lengths, the forms taking turns within each round so that a slower moment of a shared
machine falls on both, and prints the median and the fastest of the rounds (on a shared machine
the chunked form, whose matmuls spread over the cores, suffers most from other work; the scan
runs on one). ``--roofline`` compiles both the delta rule and cuDNN's causal attention
(``jax.nn.dot_product_attention``) for an H100 without one (needs the compile extras,
requirements-compile.txt) and prints the roofline of :mod:`sparsemixer_jax.aot.roofline` for
each: FLOPs, HBM bytes, predicted time, kernels, the costliest
operations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from sparsemixer_jax.layers.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


def inputs(batch: int, length: int, heads: int, dk: int, dv: int, dtype=jnp.float32
           ) -> tuple[jax.Array, ...]:
    """Unit queries and keys, values, log decays and write strengths as the layer makes
    them."""
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (batch, length, heads, dk))
    k = jax.random.normal(ks[1], (batch, length, heads, dk))
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (batch, length, heads, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (batch, length, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, length, heads)))
    return tuple(a.astype(dtype) for a in (q, k, v, g, beta))


def forms(chunk: int, backward: bool) -> dict[str, Callable[..., Any]]:
    """name -> the jitted forward (or forward + backward) of each form."""
    rules = {"chunked": lambda *a: chunk_gated_delta_rule(*a, chunk_size=chunk),
             "scan": recurrent_gated_delta_rule}
    if not backward:
        return {name: jax.jit(lambda *a, rule=rule: rule(*a)[0]) for name, rule in rules.items()}
    return {name: jax.jit(jax.grad(lambda *a, rule=rule: jnp.sum(rule(*a)[0] ** 2),
                                   argnums=tuple(range(5))))
            for name, rule in rules.items()}


def bench_cpu(lengths: Sequence[int], heads: int, dim: int, chunk: int, rounds: int
              ) -> dict[tuple[int, str], dict[str, float]]:
    """Median seconds per call of each form at each length (batch 1), forward and forward +
    backward apart (the scan's backward keeps every token's state, gigabytes at 4,096 tokens,
    which would slow whatever runs next)."""
    results = {}
    for length in lengths:
        args = inputs(1, length, heads, dim, dim)
        for mode in ("fwd", "fwd+bwd"):
            fns = forms(chunk, backward=mode == "fwd+bwd")
            for fn in fns.values():
                jax.block_until_ready(fn(*args))              # compile and warm up
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    times[name].append(time.perf_counter() - start)
            results[length, mode] = {name: statistics.median(t) for name, t in times.items()}
            print(f"T={length:5d} {mode:8s}" + "".join(
                f"  {name} {statistics.median(t) * 1e3:8.1f} ms (min {min(t) * 1e3:7.1f})"
                for name, t in times.items()), flush=True)
    return results


def bench_roofline(length: int, heads: int, dim: int, chunk: int) -> dict[str, Any]:
    """Rooflines on one H100 of the chunked rule (float32, as the layer runs it) and of
    cuDNN's causal attention (bfloat16, ``heads`` heads of ``dim``), forward and forward +
    backward, batch 1."""
    from sparsemixer_jax.aot.roofline import CHIPS, roofline
    from sparsemixer_jax.aot.targets import target_devices

    device = target_devices("h100:1x1")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def rule(*a):
        return chunk_gated_delta_rule(*a, chunk_size=chunk)[0]

    shape = jax.ShapeDtypeStruct
    rule_args = [shape((1, length, heads, dim), jnp.float32, sharding=sharding)] * 3 + \
        [shape((1, length, heads), jnp.float32, sharding=sharding)] * 2
    attn_args = [shape((1, length, heads, dim), jnp.bfloat16, sharding=sharding)] * 3
    programs = {
        "chunked fwd": (rule, rule_args),
        "chunked fwd+bwd": (jax.grad(lambda *a: jnp.sum(rule(*a) ** 2), tuple(range(5))),
                            rule_args),
        "attention fwd": (attention, attn_args),
        "attention fwd+bwd": (jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)
                                                          ** 2), (0, 1, 2)), attn_args),
    }
    out = {}
    for name, (fn, args) in programs.items():
        text = jax.jit(fn).lower(*args).compile().as_text()
        result = roofline(text, CHIPS["h100"], None, top=5)
        out[name] = result
        print(f"{name:18s} {result['flops'] / 1e9:8.2f} GFLOP {result['bytes'] / 1e6:9.1f} MB "
              f"pure {result['predicted_seconds_pure'] * 1e6:8.1f} us "
              f"calibrated {result['predicted_seconds'] * 1e6:8.1f} us "
              f"kernels {result['kernels']:.0f}")
        print("    by kind: " + ", ".join(
            f"{kind} {v['seconds'] * 1e6:.0f} us / {v['kernels']:.0f} kernels"
            for kind, v in result["kinds"].items()))
        for op in result["top_ops"]:
            print(f"    {op['kind']:9s} {op['seconds'] * 1e6:8.1f} us x{op['count']:<5.0f} "
                  f"{op['bound']:7s} {op['shapes'][:90]}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--roofline", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--roofline-heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if args.cpu:
        bench_cpu(args.lengths, args.heads, args.dim, args.chunk, args.rounds)
    if args.roofline:
        bench_roofline(4096, args.roofline_heads, args.dim, args.chunk)


if __name__ == "__main__":
    main()
