"""Router overhead, MoE layer against dense, and training throughput, measured side by side.

    python -m experiments.benchmark --out bench.json                 # sizes for this backend
    python -m experiments.benchmark --out bench.json --backend gpu --repeats 20
    python -m experiments.benchmark --emb 128 --mlp 256 --tokens 512 --experts 2 4 --repeats 2

Three sections (``--sections`` picks some):

* ``overhead``: seconds per update of the whole training step (``train.Steps``: zero the
  accumulator, forward + backward, optimizer update: the three compiled calls ``train.py`` makes
  per update), Switch against Switch+SparseMixer on the same model sizes, the same seed and the
  same batch, for each N. Repeats are interleaved in ABBA order so that a change of machine load
  hits both routers alike. JSON: ``overhead[N] = {"switch_s", "sparsemixer_s", "ratio", ...}``.
* ``router``: the two routers alone (forward + backward on ``[tokens, N]`` logits), and the
  difference as a share of the whole step: a bound on SparseMixer's overhead that is not
  drowned by the load noise of whole-step timings.
* ``moe_vs_dense``: forward + backward of one MoE layer (``MoEFeedForward``, top-1, dropless,
  each dispatch implementation) against a dense feed-forward layer of width ``mlp`` (the same
  per-token FLOPs: top-1 runs one expert of width ``mlp`` per token), interleaved.
  JSON: ``moe_vs_dense[N][impl] = ratio`` (MoE / dense seconds); times in ``moe_vs_dense_s``.
* ``padded_blocks`` (not run by default): the ``padded`` layer with smaller blocks than
  ``moe._block_rows`` picks, against dense: the evidence for a proposed change of that rule.
* ``throughput``: target tokens per second of the whole training step, dense against N=4
  (SparseMixer), and model FLOPs utilisation against the device's peak on an accelerator.
* ``profile`` (not run by default): a ``jax.profiler`` trace of a few whole training steps
  (N=4, SparseMixer) and the device time per op category (matmul, while loops, scatter, ...),
  from the trace's self times; the trace itself stays in ``--profile-dir`` for TensorBoard or
  Perfetto.

Every timing: ``--warmup`` untimed calls (the first compiles), then ``--repeats`` timed calls,
each ended by ``jax.block_until_ready``; reported as median, min and max seconds. The load
average of the machine is recorded before and after each section (other jobs share CPU cores).

Default sizes: on CPU a reduced model (emb 256, mlp 1024, 2+2 layers, 4k vocabulary, 2048 tokens
per step, length 32) that finishes in minutes; on GPU/TPU Transformer-base (emb 512, mlp 2048,
6+6 layers, 32k vocabulary) at 2^15 tokens per step. Flags override each size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# Per-device peak dense matmul throughput in FLOP/s (vendor datasheets, dense, no sparsity),
# by dtype, for the MFU figure. float32 on NVIDIA runs as TF32 under JAX's default precision.
PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "float32": 494.5e12},  # SXM; PCIe is lower (756 / 378)
    "H200": {"bfloat16": 989e12, "float32": 494.5e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
}

# --backend -> JAX_PLATFORMS. jax 0.11 reads "gpu" as "any GPU plugin" and then fails to start
# ROCm on a CUDA machine ("Unable to initialize backend 'rocm'"); the plugin's name is "cuda".
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}

CPU_SIZES = {"emb": 256, "mlp": 1024, "heads": 4, "layers": 2, "vocab": 4000, "tokens": 2048,
             "length": 32}
ACCEL_SIZES = {"emb": 512, "mlp": 2048, "heads": 8, "layers": 6, "vocab": 32000,
               "tokens": 2**15, "length": 128}


# ----------------------------------------------------------------------------------- timing


def load_average() -> float | None:
    """1-minute load average (None where the OS has none): other jobs share the CPU cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def stats(times: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "n": len(times)}


def time_interleaved(fns: dict[str, Callable[[], Any]], warmup: int,
                     repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in turn (ABBA order for two) after ``warmup``
    untimed calls each. Each call must return what it computed; it is blocked on."""
    import jax

    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------------------- model configs


def model_config(sizes: dict[str, int], num_experts: int, router: str, dtype: str,
                 dispatch: str = "auto") -> Any:
    """``configs/wmt_base.py`` with the benchmark's sizes (dropout and optimizer unchanged)."""
    from configs import wmt_base

    c = wmt_base.get_config()
    c.model.encoder_layers = c.model.decoder_layers = sizes["layers"]
    c.model.emb_dim, c.model.mlp_dim = sizes["emb"], sizes["mlp"]
    c.model.num_heads = sizes["heads"]
    c.model.num_experts = num_experts
    c.model.dispatch = dispatch
    c.model.compute_dtype = dtype
    c.router.name = router
    c.optim.tokens_per_update = 0
    return c


def synthetic_batch(sizes: dict[str, int], seed: int = 0) -> dict[str, Any]:
    """``inputs``/``targets`` int32 ``[tokens / length, length]`` of random non-padding ids,
    both ending with EOS (id 1): every position is a real token, so tokens = rows * length."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = max(1, sizes["tokens"] // sizes["length"])
    shape = (rows, sizes["length"])
    batch = {k: rng.integers(3, sizes["vocab"], shape, dtype=np.int32)
             for k in ("inputs", "targets")}
    for v in batch.values():
        v[:, -1] = 1
    return {k: jnp.asarray(v) for k, v in batch.items()}


class TrainStep:
    """One update of ``train.py``'s training loop (one micro-batch), as a zero-argument call.

    Owns the parameters and optimizer state, which the compiled update donates and returns.
    """

    def __init__(self, config: Any, vocab: int, batch: dict[str, Any]):
        import jax

        from sparsemixer_jax import train

        model = train.build_model(config, vocab, mesh=None)
        self.steps = train.Steps(model, config)
        del model
        self.params = self.steps.params
        self.opt_state = self.steps.init_opt(self.params)
        self.batch = batch
        self.key = jax.random.key(0)
        self.num_params = train.count_params(self.params)
        self.calls = 0

    def __call__(self) -> Any:
        import jax

        # The same key every call: the routers see the same jitter/mask draws each time.
        acc = self.steps.zeros(self.params, self.batch)
        acc = self.steps.accumulate(self.params, acc, self.batch, self.key)
        self.params, self.opt_state, metrics = self.steps.update(self.params, self.opt_state, acc)
        self.calls += 1
        return jax.tree.leaves(self.params)[0], metrics


def model_flops_per_step(sizes: dict[str, int], num_experts: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward matmul FLOPs).

    Per token and layer, forward: attention projections ``8 e^2`` (q, k, v, out), scores and
    weighted sum ``4 L e``; feed-forward ``4 e m`` (top-1 MoE: one expert, same FLOPs, plus the
    router ``2 e N``). The decoder adds cross-attention (``4 e^2`` for q/out per target token,
    ``4 e^2`` for k/v per source token, ``4 L e`` scores) and the output projection ``2 e V``.
    Causal self-attention is counted in full (it is computed in full). Embedding gathers,
    LayerNorm, softmax and dispatch are not counted (MFU convention: model FLOPs, not hardware
    FLOPs).
    """
    e, m, n_layers, v = sizes["emb"], sizes["mlp"], sizes["layers"], sizes["vocab"]
    length = sizes["length"]
    tokens = max(1, sizes["tokens"] // length) * length  # per side
    moe_layers = (n_layers + 1) // 2 if num_experts else 0  # moe_every = 2: layers 0, 2, ...
    router = 2 * e * num_experts * moe_layers
    ffn = 4 * e * m
    encoder = n_layers * (8 * e * e + 4 * length * e + ffn) + router
    decoder = n_layers * (8 * e * e + 4 * length * e + ffn + 4 * e * e + 4 * length * e) + router
    cross_kv = n_layers * 4 * e * e  # per source token
    forward = tokens * (encoder + cross_kv + decoder + 2 * e * v)
    return 3.0 * forward


def device_peak(dtype: str) -> tuple[str, float | None]:
    import jax

    kind = jax.devices()[0].device_kind
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return kind, peaks[dtype]
    return kind, None


# --------------------------------------------------------------------------------- sections


def bench_overhead(sizes, experts, dtype, warmup, repeats) -> dict[str, Any]:
    """Whole training step, Switch vs SparseMixer, for each N (interleaved repeats)."""
    batch = synthetic_batch(sizes)
    out = {}
    for n in experts:
        load_before = load_average()
        fns = {router: TrainStep(model_config(sizes, n, router, dtype), sizes["vocab"], batch)
               for router in ("switch", "sparsemixer")}
        times = time_interleaved(fns, warmup, repeats)
        s, m = stats(times["switch"]), stats(times["sparsemixer"])
        # Each repeat times the two routers back to back, under nearly the same load: the
        # spread of these paired ratios is the noise floor of "ratio".
        paired = [b / a for a, b in zip(times["switch"], times["sparsemixer"], strict=True)]
        out[str(n)] = {
            "switch_s": s["median"], "sparsemixer_s": m["median"],
            "ratio": m["median"] / s["median"],
            "paired_ratio": stats(paired),
            "switch": s, "sparsemixer": m,
            "load_average": [load_before, load_average()],
        }
        print(f"overhead N={n}: switch {s['median']*1e3:.1f} ms [{s['min']*1e3:.1f}, "
              f"{s['max']*1e3:.1f}], sparsemixer {m['median']*1e3:.1f} ms [{m['min']*1e3:.1f}, "
              f"{m['max']*1e3:.1f}], ratio {out[str(n)]['ratio']:.3f} "
              f"(load {out[str(n)]['load_average']})", flush=True)
        del fns
    return out


def bench_router(tokens: int, experts: Sequence[int], warmup: int, repeats: int,
                 step_s: float | None = None) -> dict[str, Any]:
    """The routers alone: forward + backward of ``sum(gate * g) + load_balancing_loss`` on
    float32 logits ``[tokens, N]``, Switch against SparseMixer, interleaved. Their difference,
    divided by the whole step's time (``step_s``), bounds SparseMixer's share of the step far
    below the noise of timing whole steps on a shared machine."""
    import jax
    import jax.numpy as jnp

    from sparsemixer_jax import routing

    out: dict[str, Any] = {}
    for n in experts:
        logits = jax.random.normal(jax.random.key(2), (tokens, n), jnp.float32)
        cotangent = jax.random.normal(jax.random.key(3), (tokens,), jnp.float32)
        fns = {}
        for name in ("switch", "sparsemixer"):
            route = routing.get_router(name, 0.1)

            def loss(logits, route=route, cotangent=cotangent):
                r = route(logits, jax.random.key(4), True)
                return jnp.sum(r.gate * cotangent) + routing.load_balancing_loss(r.probs,
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
    zero-argument call; dropout active (training mode), the same RNG state every call."""
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
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return lambda: grads(params, rest, x)


def bench_moe_vs_dense(sizes, experts, dtype, warmup, repeats, impls=("ragged", "padded"),
                       dropout: float = 0.1) -> tuple[dict, dict]:
    """One MoE layer (each dispatch) against the dense FFN of width ``mlp``, fwd + bwd, both
    with activation dropout ``dropout`` (the MoE layer draws its masks per token, the dense
    layer one mask for the whole batch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparsemixer_jax.models import FeedForward
    from sparsemixer_jax.moe import MoEFeedForward, resolve_dispatch

    compute = jnp.dtype(dtype)
    rows = max(1, sizes["tokens"] // sizes["length"])
    x = jax.random.normal(jax.random.key(1), (rows, sizes["length"], sizes["emb"]), compute)
    dense = FeedForward(sizes["emb"], sizes["mlp"], activation_dropout=dropout, dtype=compute,
                        rngs=nnx.Rngs(0))
    ratios, seconds = {}, {}
    for n in experts:
        fns = {"dense": layer_step(dense, x)}
        for impl in impls:
            moe = MoEFeedForward(sizes["emb"], sizes["mlp"], n, router="sparsemixer",
                                 activation_dropout=dropout, dispatch=impl, dtype=compute,
                                 rngs=nnx.Rngs(0))
            fns[impl] = layer_step(moe, x)
        load_before = load_average()
        times = time_interleaved(fns, warmup, repeats)
        per = {name: stats(t) for name, t in times.items()}
        ratios[str(n)] = {impl: per[impl]["median"] / per["dense"]["median"] for impl in impls}
        ratios[str(n)]["auto"] = ratios[str(n)][resolve_dispatch("auto")]
        seconds[str(n)] = {**per, "load_average": [load_before, load_average()]}
        print(f"moe_vs_dense N={n}: dense {per['dense']['median']*1e3:.1f} ms; " + ", ".join(
            f"{impl} {per[impl]['median']*1e3:.1f} ms ({ratios[str(n)][impl]:.2f}x)"
            for impl in impls) + f" (load {seconds[str(n)]['load_average']})", flush=True)
    return ratios, seconds


def bench_padded_blocks(sizes, experts, dtype, warmup, repeats, dropout: float = 0.1,
                        divisors: Sequence[int] = (1, 2, 4, 8)) -> dict[str, Any]:
    """The ``padded`` MoE layer with blocks of about ``R / (d * N)`` rows for each divisor
    ``d`` (``d = 1`` is ``moe._block_rows``' current rule), as a ratio to the dense layer.

    A diagnostic for the dispatch's owner: ``moe._block_rows`` is swapped for the duration of
    each compilation and restored (the library itself is not changed)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparsemixer_jax import moe
    from sparsemixer_jax.models import FeedForward

    compute = jnp.dtype(dtype)
    rows = max(1, sizes["tokens"] // sizes["length"])
    x = jax.random.normal(jax.random.key(1), (rows, sizes["length"], sizes["emb"]), compute)
    dense = FeedForward(sizes["emb"], sizes["mlp"], activation_dropout=dropout, dtype=compute,
                        rngs=nnx.Rngs(0))
    out: dict[str, Any] = {}
    original = moe._block_rows
    for n in experts:
        fns = {"dense": layer_step(dense, x)}
        for d in divisors:
            def block_rows(r: int, g: int, d: int = d) -> int:
                target = max(1, r // (max(g, 1) * d))
                return int(min(512, max(8, 1 << (target.bit_length() - 1))))

            moe._block_rows = block_rows
            try:
                layer = moe.MoEFeedForward(sizes["emb"], sizes["mlp"], n, dispatch="padded",
                                           activation_dropout=dropout, dtype=compute,
                                           rngs=nnx.Rngs(0))
                fn = layer_step(layer, x)
                jax.block_until_ready(fn())  # compile now, while the block rule is swapped
            finally:
                moe._block_rows = original
            fns[f"R/{d}N"] = fn
        times = time_interleaved(fns, warmup, repeats)
        dense_s = stats(times["dense"])["median"]
        out[str(n)] = {k: stats(v)["median"] / dense_s for k, v in times.items() if k != "dense"}
        out[str(n)]["dense_s"] = dense_s
        out[str(n)]["load_average"] = load_average()
        print(f"padded blocks N={n}: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in out[str(n)].items() if k.startswith("R/")), flush=True)
    return out


def bench_throughput(sizes, dtype, warmup, repeats) -> dict[str, Any]:
    """Target tokens per second of the whole training step, dense vs N=4, and MFU."""
    batch = synthetic_batch(sizes)
    tokens = int(batch["targets"].size)
    load_before = load_average()
    arms = {"dense": 0, "n4": 4}
    fns = {name: TrainStep(model_config(sizes, n, "sparsemixer", dtype), sizes["vocab"], batch)
           for name, n in arms.items()}
    times = time_interleaved(fns, warmup, repeats)
    kind, peak = device_peak(dtype)
    out: dict[str, Any] = {"device_kind": kind, "peak_flops": peak,
                           "tokens_per_step": tokens, "load_average": None}
    for name, n in arms.items():
        s = stats(times[name])
        flops = model_flops_per_step(sizes, n)
        out[name] = {
            "num_experts": n,
            "num_params": fns[name].num_params,
            "step_s": s,
            "tokens_per_s": tokens / s["median"],
            "tokens_per_s_range": [tokens / s["max"], tokens / s["min"]],
            "model_flops_per_step": flops,
            "achieved_flops_per_s": flops / s["median"],
            "mfu": flops / s["median"] / peak if peak else None,
        }
        print(f"throughput {name}: {out[name]['tokens_per_s']:.0f} tokens/s "
              f"({s['median']*1e3:.1f} ms/step), {out[name]['achieved_flops_per_s']/1e9:.1f} "
              f"GFLOP/s" + (f", MFU {out[name]['mfu']:.1%}" if peak else ""), flush=True)
    out["load_average"] = [load_before, load_average()]
    return out


def _op_category(name: str) -> str:
    """Coarse kind of an XLA CPU thunk from its HLO name (heuristic: names carry the opcode)."""
    lowered = name.lower()
    if any(k in lowered for k in ("dot", "gemm", "matmul", "conv", "ynn_fusion", "xnn_fusion",
                                  "cublas", "cutlass", "triton_gemm")):
        return "matmul"
    for key in ("while", "scatter", "gather", "sort", "reduce-window", "rng", "threefry",
                "copy", "transpose", "all-reduce", "custom-call"):
        if key in lowered:
            return key
    if "fusion" in lowered:
        return "other fusion"
    return "other"


def summarize_trace(path: str, steps: int, top: int = 25) -> dict[str, Any]:
    """Self time (exclusive of nested events) per op and per category from a Chrome/Perfetto
    trace ``*.trace.json.gz`` of ``jax.profiler``, divided by ``steps``.

    Device (XLA) ops are the events on the XLA executor threads; the ``python`` thread holds
    the host side (tracing, dispatch, argument handling)."""
    import collections
    import gzip

    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    thread_names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e["pid"], e.get("tid"))].append(e)
    self_time: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    for thread, evs in by_thread.items():
        name = thread_names.get(thread, "")
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, time of children, duration]
        exclusive: collections.Counter = collections.Counter()
        for e in [*evs, None]:  # None: a sentinel that closes every open event
            while stack and (e is None or stack[-1][0] <= e["ts"]):
                _, op, child, dur = stack.pop()
                exclusive[op] += dur - child
            if e is None:
                break
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        target = host if name == "python" else self_time
        target.update(exclusive)
    waits = [k for k in self_time if k.startswith("ThunkExecutor") or "wait" in k.lower()]
    for k in waits:  # executor bookkeeping and waiting, not work
        del self_time[k]
    categories: collections.Counter = collections.Counter()
    for op, us in self_time.items():
        categories[_op_category(op)] += us
    total = sum(self_time.values()) or 1.0
    scale = 1e-6 / steps  # microseconds -> seconds per step
    return {
        "device_s_per_step": total * scale,
        "categories": {k: {"s_per_step": v * scale, "fraction": v / total}
                       for k, v in categories.most_common()},
        "top_ops": [{"op": k, "s_per_step": v * scale, "fraction": v / total,
                     "category": _op_category(k)} for k, v in self_time.most_common(top)],
        "host_python_s_per_step": {k: v * scale for k, v in host.most_common(12)},
    }


def bench_profile(sizes, dtype, warmup, steps, logdir, num_experts=4) -> dict[str, Any]:
    """``jax.profiler`` trace of ``steps`` whole training steps (SparseMixer, ``num_experts``)
    and a summary of where the device time goes."""
    import glob

    import jax

    step = TrainStep(model_config(sizes, num_experts, "sparsemixer", dtype), sizes["vocab"],
                     synthetic_batch(sizes))
    for _ in range(warmup):
        jax.block_until_ready(step())
    start = time.perf_counter()
    jax.profiler.start_trace(logdir)
    for _ in range(steps):
        jax.block_until_ready(step())
    jax.profiler.stop_trace()
    wall = (time.perf_counter() - start) / steps
    traces = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    out: dict[str, Any] = {"logdir": logdir, "num_experts": num_experts, "steps": steps,
                           "wall_s_per_step_traced": wall, "load_average": load_average()}
    if traces:
        out.update(summarize_trace(traces[-1], steps))
        print(f"profile (N={num_experts}): device {out['device_s_per_step']*1e3:.1f} ms/step "
              f"of {wall*1e3:.1f} ms wall; " + ", ".join(
                  f"{k} {v['fraction']:.0%}" for k, v in out["categories"].items()), flush=True)
        for op in out["top_ops"][:10]:
            print(f"  {op['op'][:50]:<50} {op['s_per_step']*1e3:8.2f} ms  {op['fraction']:.1%}")
    return out


def _ms(stat: dict[str, Any]) -> str:
    def one(seconds: float) -> str:
        ms = seconds * 1e3
        return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"

    return f"{one(stat['median'])} [{one(stat['min'])}, {one(stat['max'])}]"


def _load(pair: Sequence[float | None] | None) -> str:
    return "–" if not pair else " → ".join("?" if v is None else f"{v:.1f}" for v in pair)


def markdown_tables(result: dict[str, Any]) -> str:
    """The sections of a benchmark JSON as markdown tables (what docs/benchmarks.md shows):
    medians with [min, max] in milliseconds, and the 1-minute load average before → after."""
    lines: list[str] = []
    if "overhead" in result:
        lines += ["| N | Switch ms/update | SparseMixer ms/update | ratio of medians "
                  "| paired ratios: median [min, max] | load avg |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for n, o in result["overhead"].items():
            pr = o.get("paired_ratio")
            paired = "–" if pr is None else (
                f"{pr['median']:.3f} [{pr['min']:.3f}, {pr['max']:.3f}]")
            lines.append(f"| {n} | {_ms(o['switch'])} | {_ms(o['sparsemixer'])} | "
                         f"{o['ratio']:.3f} | {paired} | {_load(o['load_average'])} |")
        lines.append("")
    if "router" in result:
        lines += ["| N | Switch router µs | SparseMixer router µs | extra, share of a step |",
                  "| --- | --- | --- | --- |"]
        for n, r in result["router"].items():
            share = r["extra_fraction_of_step"]
            lines.append(f"| {n} | {r['switch']['median']*1e6:.0f} | "
                         f"{r['sparsemixer']['median']*1e6:.0f} | "
                         f"{'–' if share is None else f'{share:.3%}'} |")
        lines.append("")
    if "moe_vs_dense" in result:
        lines += ["| N | dense ms | ragged ms | padded ms | ragged / dense | padded / dense "
                  "| load avg |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for n, r in result["moe_vs_dense"].items():
            t = result["moe_vs_dense_s"][n]
            lines.append(f"| {n} | {_ms(t['dense'])} | {_ms(t['ragged'])} | {_ms(t['padded'])} "
                         f"| {r['ragged']:.2f} | {r['padded']:.2f} | {_load(t['load_average'])} |")
        lines.append("")
    if "throughput" in result:
        t = result["throughput"]
        lines += ["| model | params | ms/update | target tokens/s [range] | model GFLOP/s | MFU "
                  "| load avg |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("dense", "n4"):
            a = t[name]
            lo, hi = a["tokens_per_s_range"]
            mfu = "–" if a["mfu"] is None else f"{a['mfu']:.1%}"
            lines.append(f"| {name} | {a['num_params']:,} | {_ms(a['step_s'])} | "
                         f"{a['tokens_per_s']:.0f} [{lo:.0f}, {hi:.0f}] | "
                         f"{a['achieved_flops_per_s']/1e9:.1f} | {mfu} | "
                         f"{_load(t['load_average'])} |")
        lines.append("")
    if "profile" in result and "categories" in result["profile"]:
        p = result["profile"]
        lines += ["| op category | share of device time |", "| --- | --- |"]
        lines += [f"| {k} | {v['fraction']:.1%} |" for k, v in p["categories"].items()]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    import jax

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "python": platform.python_version()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="print the markdown tables of an existing result file and exit")
    parser.add_argument("--backend", default=None, choices=sorted(PLATFORMS),
                        help="JAX platform (default: JAX's default); gpu = cuda (NVIDIA)")
    parser.add_argument("--sections", nargs="+", default=["overhead", "router", "moe_vs_dense",
                                                          "throughput"],
                        choices=["overhead", "router", "moe_vs_dense", "throughput", "profile",
                                 "padded_blocks"])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: float32 on CPU, bfloat16 elsewhere)")
    parser.add_argument("--profile-dir", default="/tmp/sparsemixer_profile",
                        help="section 'profile': where jax.profiler writes its trace")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="router: the whole step's time to relate the routers' cost to "
                             "(default: the fastest Switch step of this run's overhead section)")
    parser.add_argument("--layer-dropout", type=float, default=0.1,
                        help="moe_vs_dense: activation dropout of both layers (0 = none)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    for name in CPU_SIZES:
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"default: {CPU_SIZES[name]} on CPU, {ACCEL_SIZES[name]} else")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        with open(args.report) as f:
            result = json.load(f)
        print(markdown_tables(result))
        return result
    if args.backend:
        os.environ["JAX_PLATFORMS"] = PLATFORMS[args.backend]
    import jax

    backend = jax.default_backend()
    defaults = CPU_SIZES if backend == "cpu" else ACCEL_SIZES
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in defaults.items()}
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    result: dict[str, Any] = {
        "command": " ".join(["python -m experiments.benchmark",
                             *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(), "sizes": sizes, "dtype": dtype,
        "warmup": args.warmup, "repeats": args.repeats, "layer_dropout": args.layer_dropout,
        "load_average_start": load_average(),
    }
    print(json.dumps({k: result[k] for k in ("machine", "sizes", "dtype")}), flush=True)
    if "overhead" in args.sections:
        result["overhead"] = bench_overhead(sizes, args.experts, dtype, args.warmup, args.repeats)
    if "router" in args.sections:
        overhead = result.get("overhead", {})
        step_s = min((o["switch_s"] for o in overhead.values()), default=None)
        result["router"] = bench_router(sizes["tokens"], args.experts, args.warmup,
                                        max(args.repeats, 20), args.step_seconds or step_s)
    if "moe_vs_dense" in args.sections:
        result["moe_vs_dense"], result["moe_vs_dense_s"] = bench_moe_vs_dense(
            sizes, args.experts, dtype, args.warmup, args.repeats, dropout=args.layer_dropout)
    if "padded_blocks" in args.sections:
        result["padded_blocks"] = bench_padded_blocks(sizes, args.experts, dtype, args.warmup,
                                                      args.repeats, dropout=args.layer_dropout)
    if "throughput" in args.sections:
        result["throughput"] = bench_throughput(sizes, dtype, args.warmup, args.repeats)
    if "profile" in args.sections:
        result["profile"] = bench_profile(sizes, dtype, args.warmup, args.profile_steps,
                                          args.profile_dir)
    result["load_average_end"] = load_average()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    print(markdown_tables(result))
    return result


if __name__ == "__main__":
    main()
