"""Benchmarks of single layers: the routers alone, one MoE layer against the dense feed-forward
layer of the same per-token FLOPs, one MoE layer with each router against Switch's, the
``padded`` dispatch's block sizes, and the expert dispatches on their own (``expert_ffn``:
``ragged`` against ``padded``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lab.benchmarks.harness import (
    load_average,
    ratios_to,
    stats,
    time_interleaved,
    with_switch_first,
)


def bench_router(tokens: int, experts: Sequence[int], warmup: int, repeats: int,
                 step_s: float | None = None) -> dict[str, Any]:
    """The routers alone: forward + backward of ``sum(gate * g) + load_balancing_loss`` on
    float32 logits ``[tokens, N]``, Switch against SparseMixer, interleaved. Their difference,
    divided by the whole step's time (``step_s``), bounds SparseMixer's share of the step far
    below the noise of timing whole steps on a shared machine."""
    import jax
    import jax.numpy as jnp

    from sparsemixer_jax import routers

    out: dict[str, Any] = {}
    for n in experts:
        logits = jax.random.normal(jax.random.key(2), (tokens, n), jnp.float32)
        cotangent = jax.random.normal(jax.random.key(3), (tokens,), jnp.float32)
        fns = {}
        for name in ("switch", "sparsemixer"):
            route = routers.get_router(name, 0.1)

            def loss(logits, route=route, cotangent=cotangent):
                r = route(logits, jax.random.key(4), True)
                return jnp.sum(r.gate * cotangent) + routers.load_balancing_loss(r.probs,
                                                                                 r.expert)

            step = jax.jit(jax.grad(loss))
            fns[name] = lambda step=step, logits=logits: step(logits)
        times = time_interleaved(fns, warmup, repeats)
        sw, sm = stats(times["switch"]), stats(times["sparsemixer"])
        extra = sm["median"] - sw["median"]
        out[str(n)] = {"switch": sw, "sparsemixer": sm, "extra_s": extra,
                       "extra_fraction_of_step": extra / step_s if step_s else None,
                       "load_average": load_average()}
        print(f"router N={n}: switch {sw['median']*1e6:.0f} us, sparsemixer "
              f"{sm['median']*1e6:.0f} us" + (f", extra = {extra / step_s:.2%} of a step"
                                                if step_s else ""), flush=True)
    return out


def layer_step(layer: Any, x: Any) -> Callable[[], Any]:
    """Jitted forward + backward (params and input) of ``sum(y^2)`` through ``layer``, as a
    zero-argument call; dropout active (training mode), the same RNG state every call.

    The call also returns the layer's updated ``nnx.BatchStat`` state (Default MoE's default
    vectors), so that the compiled step computes their update as a training step does; the
    layer itself is left unchanged."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def grads(params, rest, x):
        def loss(params, x):
            # A copy of the RNG-stream state at this trace level (as train._loss does), so the
            # dropout stream can advance inside the traced function.
            layer = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, rest))
            y, _ = layer(x, deterministic=False)
            return jnp.sum(y.astype(jnp.float32) ** 2), nnx.state(layer, nnx.BatchStat)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    return lambda: grads(params, rest, x)


def bench_layer_cost(sizes, experts, routers, dtype, warmup, repeats, dispatch: str = "auto",
                     dropout: float = 0.1) -> dict[str, Any]:
    """One top-1 MoE layer's forward + backward (:func:`layer_step`) with each router, Switch
    first (the reference), interleaved, for each N: the cost of DenseMixer's dense pass and of
    Default MoE's terms next to their FLOP ratio
    (:func:`lab.benchmarks.flops.moe_layer_flops_per_token`).

    JSON per N: ``to_switch[router]`` (:func:`harness.ratios_to`: seconds, ratio of medians,
    paired wall and CPU-time ratios, FLOPs per call and FLOP ratio) and ``load_average``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lab.benchmarks.flops import moe_layer_flops_per_token
    from sparsemixer_jax.moe import MoEConfig, MoEFeedForward
    from sparsemixer_jax.routers import RouterConfig

    routers = with_switch_first(routers)
    compute = jnp.dtype(dtype)
    rows = max(1, sizes["tokens"] // sizes["length"])
    x = jax.random.normal(jax.random.key(1), (rows, sizes["length"], sizes["emb"]), compute)
    tokens = rows * sizes["length"]
    out: dict[str, Any] = {}
    for n in experts:
        fns = {}
        for router in routers:
            layer = MoEFeedForward(
                (sizes["emb"], sizes["mlp"]),
                MoEConfig(num_experts=n, activation_dropout=dropout, dispatch=dispatch),
                RouterConfig(name=router), dtype=compute, rngs=nnx.Rngs(0))
            fns[router] = layer_step(layer, x)
        flops = {r: tokens * moe_layer_flops_per_token(sizes["emb"], sizes["mlp"], n, r)
                 for r in routers}
        load_before = load_average()
        cpu: dict[str, list[float]] = {}
        times = time_interleaved(fns, warmup, repeats, cpu_times=cpu)
        to_switch = ratios_to(times, "switch", cpu, flops)
        out[str(n)] = {"to_switch": to_switch, "load_average": [load_before, load_average()]}
        print(f"layer_cost N={n}: switch {to_switch['switch']['time']['median']*1e3:.1f} ms; "
              + ", ".join(f"{r} {to_switch[r]['ratio']:.2f}x "
                          f"(FLOPs {to_switch[r]['flop_ratio']:.2f}x)" for r in routers[1:])
              + f" (load {out[str(n)]['load_average']})", flush=True)
    return out


def bench_moe_vs_dense(sizes, experts, dtype, warmup, repeats, impls=("ragged", "padded"),
                       dropout: float = 0.1) -> tuple[dict, dict]:
    """One MoE layer (each dispatch) against the dense FFN of width ``mlp``, fwd + bwd, both
    with activation dropout ``dropout`` (the MoE layer draws its masks per token, the dense
    layer one mask for the whole batch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparsemixer_jax.layers.fairseq import FeedForward
    from sparsemixer_jax.moe import MoEConfig, MoEFeedForward, resolve_dispatch
    from sparsemixer_jax.routers import RouterConfig

    compute = jnp.dtype(dtype)
    rows = max(1, sizes["tokens"] // sizes["length"])
    x = jax.random.normal(jax.random.key(1), (rows, sizes["length"], sizes["emb"]), compute)
    dense = FeedForward(sizes["emb"], sizes["mlp"], activation_dropout=dropout, dtype=compute,
                        rngs=nnx.Rngs(0))
    ratios, seconds = {}, {}
    for n in experts:
        fns = {"dense": layer_step(dense, x)}
        for impl in impls:
            moe = MoEFeedForward(
                (sizes["emb"], sizes["mlp"]),
                MoEConfig(num_experts=n, activation_dropout=dropout, dispatch=impl),
                RouterConfig(name="sparsemixer"), dtype=compute, rngs=nnx.Rngs(0))
            fns[impl] = layer_step(moe, x)
        load_before = load_average()
        times = time_interleaved(fns, warmup, repeats)
        per = {name: stats(t) for name, t in times.items()}
        ratios[str(n)] = {impl: per[impl]["median"] / per["dense"]["median"] for impl in impls}
        if resolve_dispatch("auto") in impls:
            ratios[str(n)]["auto"] = ratios[str(n)][resolve_dispatch("auto")]
        seconds[str(n)] = {**per, "load_average": [load_before, load_average()]}
        print(f"moe_vs_dense N={n}: dense {per['dense']['median']*1e3:.1f} ms; " + ", ".join(
            f"{impl} {per[impl]['median']*1e3:.1f} ms ({ratios[str(n)][impl]:.2f}x)"
            for impl in impls) + f" (load {seconds[str(n)]['load_average']})", flush=True)
    return ratios, seconds


def bench_padded_blocks(sizes, experts, dtype, warmup, repeats, dropout: float = 0.1,
                        divisors: Sequence[int] = (1, 2, 4, 8)) -> dict[str, Any]:
    """The ``padded`` expert FFN with blocks of about ``R / (d * N)`` rows for each divisor
    ``d`` (``d = 1`` is the default rule, ``moe.dispatch.padded_block_rows``), as a ratio to the
    dense FFN of the same width on every row; forward + backward, dropout on.

    A diagnostic for the block rule: the block size is passed to ``expert_ffn(...,
    block_rows=...)``, the rest of the layer (router, residual) does not depend on it."""
    import jax
    import jax.numpy as jnp

    from sparsemixer_jax.moe import dispatch as moe_dispatch

    compute = jnp.dtype(dtype)
    tokens, emb, mlp = sizes["tokens"], sizes["emb"], sizes["mlp"]
    kx, kg, kw, kd = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(kx, (tokens, emb), compute)
    ids = jnp.arange(tokens, dtype=jnp.int32)
    out: dict[str, Any] = {}
    for n in experts:
        group = jax.random.randint(kg, (tokens,), 0, n)  # roughly balanced routing
        k1, k2 = jax.random.split(kw)
        params = (jax.random.normal(k1, (n, emb, mlp), compute) / emb**0.5,
                  jnp.zeros((n, mlp), compute),
                  jax.random.normal(k2, (n, mlp, emb), compute) / mlp**0.5,
                  jnp.zeros((n, emb), compute))

        def step_for(block_rows: int | None, params=params, group=group):
            def loss(params, x):
                if block_rows is None:  # one FFN on every row: the cost floor
                    wi, bi, wo, bo = (p[0] for p in params)
                    h = moe_dispatch.row_dropout(jax.nn.relu(x @ wi + bi), ids, kd, dropout)
                    y = h @ wo + bo
                else:
                    y = moe_dispatch.expert_ffn(x, group, ids, params, dispatch="padded",
                                                dropout_key=kd, dropout_rate=dropout,
                                                block_rows=block_rows)
                return jnp.sum(y.astype(jnp.float32) ** 2)

            step = jax.jit(jax.grad(loss, argnums=(0, 1)))
            return lambda: step(params, x)

        fns = {"dense": step_for(None)}
        for d in divisors:
            fns[f"R/{d}N"] = step_for(moe_dispatch.padded_block_rows(tokens, n * d))
        times = time_interleaved(fns, warmup, repeats)
        dense_s = stats(times["dense"])["median"]
        out[str(n)] = {k: stats(v)["median"] / dense_s for k, v in times.items() if k != "dense"}
        out[str(n)]["dense_s"] = dense_s
        out[str(n)]["load_average"] = load_average()
        print(f"padded blocks N={n}: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in out[str(n)].items() if k.startswith("R/")), flush=True)
    return out


def time_expert_ffn(dispatch: str, tokens: int, emb: int, mlp: int, n: int, repeats: int,
                    dtype) -> float:
    """Median seconds of one jitted forward+backward of ``expert_ffn`` with ``dispatch``
    (``"dense"``: one FFN on every token, the cost floor of any dispatch), tokens routed to
    ``n`` experts uniformly at random; one untimed call compiles."""
    import jax
    import jax.numpy as jnp

    from sparsemixer_jax.moe import expert_ffn

    kx, kg, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (tokens, emb), dtype)
    group = jax.random.randint(kg, (tokens,), 0, n)  # roughly balanced routing
    ids = jnp.arange(tokens, dtype=jnp.int32)
    k1, k2 = jax.random.split(kw)
    params = (
        jax.random.normal(k1, (n, emb, mlp), dtype) / emb**0.5,
        jnp.zeros((n, mlp), dtype),
        jax.random.normal(k2, (n, mlp, emb), dtype) / mlp**0.5,
        jnp.zeros((n, emb), dtype),
    )

    def loss(params, x):
        if dispatch == "dense":  # one FFN on every token: the cost floor of any dispatch
            wi, bi, wo, bo = (p[0] for p in params)
            y = jax.nn.relu(x @ wi + bi) @ wo + bo
        else:
            y = expert_ffn(x, group, ids, params, dispatch=dispatch)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    times = time_interleaved({"step": lambda: step(params, x)}, 1, repeats)["step"]
    return stats(times)["median"]
