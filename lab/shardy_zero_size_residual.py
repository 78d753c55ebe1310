"""XLA's compiler crash on a zero-size residual of a ``shard_map`` in a differentiated scan.

    python -m lab.shardy_zero_size_residual            # every case, each in a subprocess
    python -m lab.shardy_zero_size_residual --case jnp  # one case in this process

With jax 0.11.2, XLA's Shardy import (``ShardyXLA``, the canonicalizer's
``ManualComputationUnusedInputsPattern``) crashes with a segmentation fault on this pattern: a
``shard_map`` inside a differentiated ``jax.lax.scan`` whose body builds a zero-size array that
does not depend on its inputs (``jnp.zeros((0,))`` concatenated to an index vector, say), when
all of the ``shard_map``'s inputs depend on the differentiated carry. JAX's partial evaluation
then splits the ``shard_map`` in two: a part without inputs that computes the constants, and the
rest, which receives them as residuals, the zero-size array among them. The compilers for CPUs
and for GPUs both crash (the TPU compiler was not tried); no Pallas kernel is needed.

The ``grouped`` MoE dispatch (:func:`sparsemixer_jax.moe.dispatch.grouped_ffn`) padded its sorted
rows to whole kernel tiles with such arrays, also when no padding was needed, and under expert
parallelism (``mesh.expert > 1``) in the scanned language model it crashed the H100 compile. It
builds the padding only where there is some, which this script checks too.

Cases (each prints ``compiled`` or ``crashed``):

* ``jnp``: the smallest form, on 8 CPU devices, with a zero-size array: crashes with jax 0.11.2.
* ``jnp-padded``: the same with 64 padding rows instead of none: compiles.
* ``grouped``: the ``grouped`` dispatch's expert FFN (Mosaic kernels in JAX's GPU interpreter)
  split over 8 CPU devices, in a differentiated scan, with rows that fill whole tiles: compiles.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CASES = ("jnp", "jnp-padded", "grouped")
DEVICES, ROWS, WIDTH = 8, 128, 64  # per device: rows (a multiple of the kernels' 64-row tiles)


def _compile(case: str) -> None:
    """Lower and compile the case's gradient on 8 CPU devices (a crash ends the process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparsemixer_jax.parallel.sharding import make_mesh

    mesh = make_mesh(1, DEVICES, jax.devices()[:DEVICES])
    rows = P(("data", "fsdp", "expert"))

    if case == "grouped":
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        from sparsemixer_jax.moe.expert_parallel import expert_parallel_ffn

        experts = 2 * DEVICES

        def layer(h, params):
            group = jnp.argmax(h[..., :experts], axis=-1).astype(jnp.int32)
            return expert_parallel_ffn(h, group, jnp.zeros_like(group), params, mesh=mesh,
                                       dispatch="grouped", activation="silu")

        params = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                            sharding=NamedSharding(mesh, P("expert")))
                       for shape in ((experts, WIDTH, WIDTH), (experts, WIDTH, WIDTH),
                                     (experts, WIDTH, WIDTH)))
        context = interpret_params.force_gpu_interpret_mode()
    else:
        pad = 64 if case == "jnp-padded" else 0

        def local(x, group):
            order = jnp.argsort(group, stable=True)
            gather = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
            return (x[gather] * 2.0)[: x.shape[0]]

        def layer(h, params):
            del params
            group = jnp.argmax(h[..., :8], axis=-1).astype(jnp.int32)
            flat = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows), out_specs=rows)(
                h.reshape(-1, WIDTH), group.reshape(-1))
            return flat.reshape(h.shape)

        params = ()
        context = np.errstate()  # nothing to switch on

    def loss(x, params):
        def step(h, _):
            return layer(h, params), None

        h, _ = jax.lax.scan(step, x, None, length=2)
        return jnp.sum(jnp.square(h.astype(jnp.float32)))

    x = jax.ShapeDtypeStruct((DEVICES, ROWS, WIDTH), jnp.bfloat16,
                             sharding=NamedSharding(mesh, rows))
    with context:
        jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()


def _cpu_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with JAX on the CPU, simulating :data:`DEVICES` devices."""
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    return dict(environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)


def run_case(case: str, timeout: float = 600.0) -> str:
    """``"compiled"`` or ``"crashed (...)"``: ``case`` compiled in a subprocess of 8 CPU
    devices, so that a crash does not end the caller."""
    env = _cpu_environment(dict(os.environ))
    done = subprocess.run([sys.executable, "-m", "lab.shardy_zero_size_residual", "--case", case],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode == 0:
        return "compiled"
    if done.returncode < 0:
        return f"crashed (signal {-done.returncode})"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"crashed (exit {done.returncode}: {last})"


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=CASES, help="compile one case in this process")
    args = parser.parse_args(argv)
    if args.case:
        os.environ.update(_cpu_environment(dict(os.environ)))  # before JAX starts
        _compile(args.case)
        print(f"{args.case}: compiled")
        return {args.case: "compiled"}
    results = {}
    for case in CASES:
        results[case] = run_case(case)
        print(f"{case}: {results[case]}", flush=True)
    return results


if __name__ == "__main__":
    main()
