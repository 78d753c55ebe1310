"""Time the MoE expert dispatch: ``ragged`` (ragged_dot) against ``padded`` (block-padded
batched matmul), forward + backward of the expert FFN, on the default JAX backend.

    python -m experiments.bench_dispatch [--tokens 4096 --emb 512 --mlp 2048 --experts 2 4 8 16]

Prints a table of median milliseconds per forward+backward; the result sets the CPU default of
``dispatch="auto"`` in ``sparsemixer_jax/moe/dispatch.py`` (``moe.AUTO_DISPATCH``). On a GPU
(``JAX_PLATFORMS=cuda``), ``--triton-ragged-dot`` times ``ragged`` with ragged_dot's grouped
Pallas/Triton lowering where the installed jax has it (it says so when it has not).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from lab.benchmarks.layers import time_expert_ffn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--emb", type=int, default=512)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--triton-ragged-dot", action="store_true",
                        help="ragged: the grouped Pallas/Triton GPU lowering, where available")
    args = parser.parse_args()
    if args.triton_ragged_dot:
        from sparsemixer_jax.kernels.triton_ragged_dot import enable_triton_ragged_dot

        state = "on" if enable_triton_ragged_dot() else "not in this jax"
        print(f"triton ragged_dot lowering: {state}")
    dtype = jnp.dtype(args.dtype)
    print(f"backend={jax.default_backend()} devices={jax.devices()[0].device_kind} "
          f"tokens={args.tokens} emb={args.emb} mlp={args.mlp} dtype={args.dtype} "
          f"median of {args.repeats}, fwd+bwd")
    dense = time_expert_ffn("dense", args.tokens, args.emb, args.mlp, 1, args.repeats, dtype) * 1e3
    print(f"dense FFN (one expert, all tokens): {dense:.1f} ms")
    print(f"{'N':>4} {'ragged ms':>10} {'padded ms':>10} {'faster':>8}")
    for n in args.experts:
        r = time_expert_ffn("ragged", args.tokens, args.emb, args.mlp, n, args.repeats, dtype) * 1e3
        p = time_expert_ffn("padded", args.tokens, args.emb, args.mlp, n, args.repeats, dtype) * 1e3
        print(f"{n:>4} {r:>10.1f} {p:>10.1f} {'ragged' if r < p else 'padded':>8}", flush=True)


if __name__ == "__main__":
    main()
