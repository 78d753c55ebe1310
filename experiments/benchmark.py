"""Router overhead, MoE layer against dense, training throughput and decoding, side by side.

    python -m experiments.benchmark --out bench.json                 # sizes for this backend
    python -m experiments.benchmark --out bench.json --backend gpu --repeats 20
    python -m experiments.benchmark --emb 128 --mlp 256 --tokens 512 --experts 2 4 --repeats 2
    bash experiments/gpu_campaign.sh                                  # every GPU figure

Sections (``--sections`` picks some):

* ``overhead``: seconds per update of the whole training step (``train.Steps.train_step``: one
  compiled call per update, as ``train.py`` runs without gradient accumulation), Switch against
  Switch+SparseMixer on the same model sizes, the same seed and the same batch, for each N.
  Repeats are interleaved in ABBA order so that a change of machine load hits both routers
  alike. JSON: ``overhead[N] = {"switch_s", "sparsemixer_s", "ratio", ...}``.
* ``router``: the two routers alone (forward + backward on ``[tokens, N]`` logits), and the
  difference as a share of the whole step: a bound on SparseMixer's overhead that is not
  drowned by the load noise of whole-step timings.
* ``moe_vs_dense``: forward + backward of one MoE layer (``MoEFeedForward``, top-1, dropless,
  each dispatch of ``--layer-dispatches``; with ``--triton-ragged-dot`` "ragged" is the grouped
  Pallas/Triton lowering where jax has it) against a dense feed-forward layer of width ``mlp``
  (the same per-token FLOPs: top-1 runs one expert of width ``mlp`` per token), interleaved.
  JSON: ``moe_vs_dense[N][impl] = ratio`` (MoE / dense seconds); times in ``moe_vs_dense_s``.
* ``padded_blocks`` (not run by default): the ``padded`` layer with smaller blocks than
  ``moe._block_rows`` picks, against dense: the evidence for a proposed change of that rule.
* ``throughput``: target tokens per second of the whole training step, dense against N=4
  (SparseMixer), and model FLOPs utilisation against the device's peak on an accelerator.
* ``fusion`` (not run by default): the one-call update against the three calls of an
  accumulating update (zero, accumulate, update), dense and each N.
* ``decode`` (not run by default): beam search (beam 4) in sentences per second on Multi30k-test
  and newstest-like batches, dense and each N, compile time apart.
* ``profile`` (not run by default): a ``jax.profiler`` trace of a few whole training steps
  (N=4, SparseMixer) and the device time per op or kernel category (matmul, fused attention,
  fusions, scatter, collectives, memcpy, ...): on a GPU from the kernels on the device's
  streams, on CPU from the XLA ops' self times; the trace itself stays in ``--profile-dir`` for
  TensorBoard or Perfetto.

Whole-step sections take ``--dispatch``, ``--attention-impl`` and, for the whole run,
``--rng-impl``, ``--deterministic``, ``--triton-ragged-dot``; the JSON records them.

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

DISPATCH_CHOICES = ("auto", "ragged", "padded")

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


def time_interleaved(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int,
                     cpu_times: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in turn (ABBA order for two) after ``warmup``
    untimed calls each. Each call must return what it computed; it is blocked on.

    ``cpu_times``, if given, receives the process's CPU seconds (all threads) per call: on CPU
    cores shared with other jobs, the work done, which waiting for a core does not inflate."""
    import jax

    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
            if cpu_times is not None:
                cpu_times.setdefault(name, []).append(time.process_time() - cpu_start)
    return times


# ---------------------------------------------------------------------------- model configs


def model_config(sizes: dict[str, int], num_experts: int, router: str, dtype: str,
                 dispatch: str = "auto", attention_impl: str = "einsum") -> Any:
    """``configs/wmt.py`` with the benchmark's sizes (dropout and optimizer unchanged, except
    attention dropout 0 with a fused ``attention_impl``, which has none)."""
    from configs import wmt

    c = wmt.get_config()
    c.model.attention_impl = attention_impl
    if attention_impl != "einsum":
        c.model.attention_dropout = 0.0
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
    ``fused``: ``train.Steps.train_step``, one compiled call per update (what ``train.py`` runs
    without gradient accumulation); else the three calls of an accumulating update (zero the
    accumulator, forward + backward, optimizer update).
    """

    def __init__(self, config: Any, vocab: int, batch: dict[str, Any], fused: bool = True):
        import jax

        from sparsemixer_jax.tasks import translation
        from sparsemixer_jax.training.steps import count_params

        model = translation.TranslationTask().build_model(config, vocab, None)
        self.steps = translation.make_steps(model, config)
        del model
        self.params = self.steps.params
        self.opt_state = self.steps.init_opt(self.params)
        self.batch = batch
        self.key = jax.random.key(0)
        self.num_params = count_params(self.params)
        self.fused = fused
        self.calls = 0

    def __call__(self) -> Any:
        import jax

        # The same key every call: the routers see the same jitter/mask draws each time.
        if self.fused:
            self.params, self.opt_state, metrics = self.steps.train_step(
                self.params, self.opt_state, [self.batch], self.key)
        else:
            acc = self.steps.zeros(self.params, self.batch)
            acc = self.steps.accumulate(self.params, acc, self.batch,
                                        jax.random.fold_in(self.key, 0))
            self.params, self.opt_state, metrics = self.steps.update(self.params,
                                                                     self.opt_state, acc)
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


def bench_overhead(sizes, experts, dtype, warmup, repeats, **model_options) -> dict[str, Any]:
    """Whole training step, Switch vs SparseMixer, for each N (interleaved repeats).
    ``model_options``: ``dispatch`` and ``attention_impl`` of :func:`model_config`."""
    batch = synthetic_batch(sizes)
    out = {}
    for n in experts:
        load_before = load_average()
        fns = {router: TrainStep(model_config(sizes, n, router, dtype, **model_options),
                                 sizes["vocab"], batch)
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
        if resolve_dispatch("auto") in impls:
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


def bench_throughput(sizes, dtype, warmup, repeats, **model_options) -> dict[str, Any]:
    """Target tokens per second of the whole training step, dense vs N=4, and MFU."""
    batch = synthetic_batch(sizes)
    tokens = int(batch["targets"].size)
    load_before = load_average()
    arms = {"dense": 0, "n4": 4}
    fns = {name: TrainStep(model_config(sizes, n, "sparsemixer", dtype, **model_options),
                           sizes["vocab"], batch)
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


def bench_fusion(sizes, experts, dtype, warmup, repeats, **model_options) -> dict[str, Any]:
    """The whole training step as one compiled call (``train.Steps.train_step``) against the
    three calls of an accumulating update, dense and each N, interleaved: the cost of dispatch
    and of materialising the gradient accumulator."""
    batch = synthetic_batch(sizes)
    out: dict[str, Any] = {}
    for n in [0, *experts]:
        config = model_config(sizes, n, "sparsemixer", dtype, **model_options)
        fns = {"fused": TrainStep(config, sizes["vocab"], batch, fused=True),
               "three_calls": TrainStep(config, sizes["vocab"], batch, fused=False)}
        load_before = load_average()
        cpu: dict[str, list[float]] = {}
        times = time_interleaved(fns, warmup, repeats, cpu_times=cpu)
        f, t = stats(times["fused"]), stats(times["three_calls"])
        fc, tc = stats(cpu["fused"]), stats(cpu["three_calls"])
        name = "dense" if n == 0 else str(n)
        out[name] = {"fused": f, "three_calls": t, "ratio": f["median"] / t["median"],
                     "fused_cpu": fc, "three_calls_cpu": tc,
                     "cpu_ratio": fc["median"] / tc["median"],
                     "load_average": [load_before, load_average()]}
        print(f"fusion {name}: one call {f['median']*1e3:.1f} ms, three calls "
              f"{t['median']*1e3:.1f} ms, ratio {out[name]['ratio']:.3f}; CPU time "
              f"{fc['median']*1e3:.1f} vs {tc['median']*1e3:.1f} ms, ratio "
              f"{out[name]['cpu_ratio']:.3f}", flush=True)
        del fns
    return out


# Decoding shapes: sentences per batch x padded source length. Multi30k's test_2016_flickr has
# 1,000 sentences of about 12-16 subword tokens (at most ~40); WMT newstest2014 has 3,003
# sentences of about 30-35 (long tail past 100). Buckets of 32 and 64 cover most of each.
DECODE_SHAPES = {"multi30k": (128, 32), "newstest": (64, 64)}


def bench_decode(sizes, experts, dtype, warmup, repeats, beam_size=4, max_extra_len=50,
                 shapes=None) -> dict[str, Any]:
    """Beam search (``decode.beam_search_model``) in sentences per second, per model and shape.

    Compile time (first call minus a timed call) is reported apart. The model is untrained, so
    it rarely emits EOS and every search runs to its length limit (source + ``max_extra_len``):
    an upper bound on a trained model's time per sentence."""
    import jax
    import numpy as np

    from sparsemixer_jax import decode
    from sparsemixer_jax.tasks import translation

    shapes = shapes or DECODE_SHAPES
    out: dict[str, Any] = {"beam_size": beam_size, "max_extra_len": max_extra_len}
    for n in [0, *experts]:
        config = model_config(sizes, n, "sparsemixer", dtype)
        model = translation.TranslationTask().build_model(config, sizes["vocab"], None)
        name = "dense" if n == 0 else f"n{n}"
        for shape_name, (rows, length) in shapes.items():
            rng = np.random.default_rng(0)
            inputs = rng.integers(3, sizes["vocab"], (rows, length), dtype=np.int32)
            inputs[:, -1] = 1  # EOS

            def search(inputs=inputs, model=model):
                return decode.beam_search_model(model, inputs, eos_id=1, beam_size=beam_size,
                                                max_extra_len=max_extra_len)[0]

            start = time.perf_counter()
            jax.block_until_ready(search())
            first = time.perf_counter() - start
            times = time_interleaved({"search": search}, max(warmup - 1, 0), repeats)["search"]
            st = stats(times)
            out[f"{name}/{shape_name}"] = {
                "num_experts": n, "sentences": rows, "source_len": length,
                "search_s": st, "sentences_per_s": rows / st["median"],
                "compile_s": max(first - st["median"], 0.0), "load_average": load_average()}
            print(f"decode {name} {shape_name} ({rows} x {length}, beam {beam_size}): "
                  f"{rows / st['median']:.1f} sentences/s ({st['median']*1e3:.0f} ms per batch), "
                  f"compile {out[f'{name}/{shape_name}']['compile_s']:.1f} s", flush=True)
    return out


def _op_category(name: str) -> str:
    """Coarse kind of an XLA op (CPU thunk, from its HLO name) or GPU kernel (from its name).

    A heuristic on names: XLA names fusions after their kind and root op (``loop_add_fusion``,
    ``input_reduce_fusion``), cuBLAS/CUTLASS/cuDNN kernels carry their library's prefixes
    (``sm90_xmma_gemm``, ``nvjet_``, ``cutlass_``, ``cudnn``), NCCL kernels ``nccl``."""
    lowered = name.lower()
    if any(k in lowered for k in ("flash", "fmha", "cudnn", "sdpa")):
        return "attention (fused)"
    if any(k in lowered for k in ("dot", "gemm", "matmul", "conv", "ynn_fusion", "xnn_fusion",
                                  "cublas", "cutlass", "nvjet", "xmma", "wgmma", "ragged")):
        return "matmul"
    if any(k in lowered for k in ("nccl", "all-reduce", "all_reduce", "all-gather",
                                  "all-to-all", "reduce-scatter", "collective")):
        return "collective"
    if any(k in lowered for k in ("memcpy", "memset")):
        return "memcpy/memset"
    if any(k in lowered for k in ("threefry", "philox", "rng", "random")):
        return "rng"
    for key in ("while", "scatter", "gather", "sort", "reduce-window", "copy", "transpose",
                "custom-call"):
        if key in lowered:
            return key
    if "cub::" in lowered or "radix" in lowered:
        return "sort"
    if "reduce" in lowered or "reduction" in lowered:
        return "reduction fusion"
    if "triton" in lowered:
        return "triton fusion"
    if "fusion" in lowered:
        return "other fusion"
    return "other"


# Threads (trace "resources") of a GPU/TPU device process that summarise the kernels of the
# stream lines (XLA modules, XLA ops, steps, launch statistics): counting them would count the
# same time twice.
_DERIVED_DEVICE_LINES = ("xla modules", "xla ops", "steps", "launch stats", "framework",
                         "source code", "tensorflow", "host offload")


def _self_times(events: list[dict]) -> Any:
    """Exclusive time (minus nested events on the same thread) per event name, in microseconds."""
    import collections

    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [end, name, time of children, duration]
    exclusive: collections.Counter = collections.Counter()
    for e in [*events, None]:  # None: a sentinel that closes every open event
        while stack and (e is None or stack[-1][0] <= e["ts"]):
            _, op, child, dur = stack.pop()
            exclusive[op] += dur - child
        if e is None:
            break
        if stack:
            stack[-1][2] += e["dur"]
        stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
    return exclusive


def summarize_trace(path: str, steps: int, top: int = 25) -> dict[str, Any]:
    """Device time per op or kernel and per category from a Chrome/Perfetto trace
    ``*.trace.json.gz`` of ``jax.profiler``, divided by ``steps``.

    Accelerators: the trace has a process per device (``/device:GPU:0``, ``/device:TPU:0``) with
    a thread per stream (``Stream #14(Compute)``) holding the kernels as they ran; those are the
    device table (the device's summary lines, ``XLA Ops`` and the like, are skipped: they repeat
    the streams). Host threads, ``python`` included, are never in it.
    CPU: the XLA ops are the events on the executor threads of the host process (self times);
    the ``python`` thread holds the host side (tracing, dispatch, argument handling).
    ``host_python_s_per_step`` is the ``python`` thread's self time per frame either way."""
    import collections
    import gzip

    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e["pid"], e.get("tid"))].append(e)
    device_pids = {pid for pid, name in process_names.items()
                   if name.startswith("/device:") and "cpu" not in name.lower()}
    self_time: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    streams = set()
    for thread, evs in by_thread.items():
        name = thread_names.get(thread, "")
        if name == "python":
            host.update(_self_times(evs))
        elif not device_pids:  # CPU: the executor threads
            self_time.update(_self_times(evs))
        elif thread[0] in device_pids and not name.lower().startswith(_DERIVED_DEVICE_LINES):
            streams.add(f"{process_names[thread[0]]} {name}".strip())
            self_time.update(_self_times(evs))
    waits = [k for k in self_time if k.startswith("ThunkExecutor") or "wait" in k.lower()]
    for k in waits:  # executor bookkeeping and waiting, not work
        del self_time[k]
    categories: collections.Counter = collections.Counter()
    for op, us in self_time.items():
        categories[_op_category(op)] += us
    total = sum(self_time.values()) or 1.0
    scale = 1e-6 / steps  # microseconds -> seconds per step
    return {
        "device_kind": "accelerator streams" if device_pids else "cpu threads",
        "streams": sorted(streams),
        "device_s_per_step": total * scale,
        "categories": {k: {"s_per_step": v * scale, "fraction": v / total}
                       for k, v in categories.most_common()},
        "top_ops": [{"op": k, "s_per_step": v * scale, "fraction": v / total,
                     "category": _op_category(k)} for k, v in self_time.most_common(top)],
        "host_python_s_per_step": {k: v * scale for k, v in host.most_common(12)},
    }


def bench_profile(sizes, dtype, warmup, steps, logdir, num_experts=4,
                  **model_options) -> dict[str, Any]:
    """``jax.profiler`` trace of ``steps`` whole training steps (SparseMixer, ``num_experts``)
    and a summary of where the device time goes."""
    import glob

    import jax

    step = TrainStep(model_config(sizes, num_experts, "sparsemixer", dtype, **model_options),
                     sizes["vocab"],
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
        impls = [k for k in next(iter(result["moe_vs_dense_s"].values()))
                 if k not in ("dense", "load_average")]
        lines += ["| N | dense ms | " + " | ".join(f"{i} ms" for i in impls) + " | "
                  + " | ".join(f"{i} / dense" for i in impls) + " | load avg |",
                  "| --- " * (3 + 2 * len(impls)) + "|"]
        for n, r in result["moe_vs_dense"].items():
            t = result["moe_vs_dense_s"][n]
            lines.append(f"| {n} | {_ms(t['dense'])} | "
                         + " | ".join(_ms(t[i]) for i in impls) + " | "
                         + " | ".join(f"{r[i]:.2f}" for i in impls)
                         + f" | {_load(t['load_average'])} |")
        lines.append("")
    if "fusion" in result:
        lines += ["| model | one call ms/update | three calls ms/update | ratio "
                  "| CPU ms: one call | CPU ms: three calls | CPU ratio | load avg |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, f in result["fusion"].items():
            lines.append(f"| {name} | {_ms(f['fused'])} | {_ms(f['three_calls'])} | "
                         f"{f['ratio']:.3f} | {_ms(f['fused_cpu'])} | "
                         f"{_ms(f['three_calls_cpu'])} | {f['cpu_ratio']:.3f} | "
                         f"{_load(f['load_average'])} |")
        lines.append("")
    if "decode" in result:
        d = result["decode"]
        lines += [f"| model / shape (beam {d['beam_size']}) | sentences x source length "
                  "| ms per batch | sentences/s | compile s |", "| --- | --- | --- | --- | --- |"]
        for name, r in d.items():
            if isinstance(r, dict):
                lines.append(f"| {name} | {r['sentences']} x {r['source_len']} | "
                             f"{_ms(r['search_s'])} | {r['sentences_per_s']:.1f} | "
                             f"{r['compile_s']:.1f} |")
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
    out = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
           "device_count": jax.device_count(), "cpu": cpu, "cpu_count": os.cpu_count(),
           "jax": jax.__version__, "python": platform.python_version()}
    try:  # the CUDA plugin's versions (what jax's cuDNN attention checks); absent on CPU/TPU
        from jax._src.lib import cuda_versions

        if cuda_versions is not None and out["backend"] in ("gpu", "cuda"):
            out["cudnn"] = cuda_versions.cudnn_get_version()
            out["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
    except Exception as err:  # private module: record why instead of failing the benchmark
        out["cuda_versions_error"] = repr(err)
    return out


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
                                 "padded_blocks", "fusion", "decode"])
    parser.add_argument("--dispatch", default="auto", choices=DISPATCH_CHOICES,
                        help="whole-step sections (overhead, throughput, fusion, profile): the "
                             "MoE layers' dispatch")
    parser.add_argument("--layer-dispatches", nargs="+", default=["ragged", "padded"],
                        choices=["ragged", "padded"],
                        help="moe_vs_dense: the dispatch implementations timed against dense")
    parser.add_argument("--attention-impl", default="einsum",
                        choices=["einsum", "xla", "cudnn", "auto"],
                        help="whole-step sections: model.attention_impl (not einsum: attention "
                             "dropout 0)")
    parser.add_argument("--rng-impl", default=None, choices=["threefry2x32", "rbg", "unsafe_rbg"],
                        help="jax_default_prng_impl for the whole run (default: jax's)")
    parser.add_argument("--triton-ragged-dot", action="store_true",
                        help="turn on ragged_dot's Pallas/Triton GPU lowering (where this jax has "
                             "it; recorded in the JSON)")
    parser.add_argument("--deterministic", action="store_true",
                        help="XLA's deterministic GPU ops (runtime.deterministic)")
    parser.add_argument("--decode-beam", type=int, default=4)
    parser.add_argument("--decode-extra-len", type=int, default=50,
                        help="decode: output length limit = source length + this")
    parser.add_argument("--decode-shapes", nargs="+", default=None, metavar="NAME=ROWSxLEN",
                        help=f"decode: batches to time (default {DECODE_SHAPES})")
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
        # experiments/gpu_campaign.sh merges several runs: {"runs": {name: result}}.
        for name, run in result.get("runs", {"": result}).items():
            if name:
                print(f"### {name}: {run.get('command', run.get('failed', '')[-300:])}\n")
            print(markdown_tables(run))
        return result
    if args.backend:
        os.environ["JAX_PLATFORMS"] = PLATFORMS[args.backend]
    if args.deterministic:  # before JAX starts its backend
        from sparsemixer_jax import runtime

        runtime.set_deterministic_gpu_ops()
    import jax

    from sparsemixer_jax import grouped_matmul

    if args.rng_impl:
        jax.config.update("jax_default_prng_impl", args.rng_impl)
    triton = grouped_matmul.enable_triton_ragged_dot() if args.triton_ragged_dot else False

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
        "dispatch": args.dispatch, "attention_impl": args.attention_impl,
        "rng_impl": jax.config.values["jax_default_prng_impl"],
        "triton_ragged_dot": {"requested": args.triton_ragged_dot,
                              "available": grouped_matmul.triton_ragged_dot_available(),
                              "enabled": triton},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    model_options = {"dispatch": args.dispatch, "attention_impl": args.attention_impl}
    print(json.dumps({k: result[k] for k in ("machine", "sizes", "dtype")}), flush=True)
    if "overhead" in args.sections:
        result["overhead"] = bench_overhead(sizes, args.experts, dtype, args.warmup, args.repeats,
                                            **model_options)
    if "router" in args.sections:
        overhead = result.get("overhead", {})
        step_s = min((o["switch_s"] for o in overhead.values()), default=None)
        result["router"] = bench_router(sizes["tokens"], args.experts, args.warmup,
                                        max(args.repeats, 20), args.step_seconds or step_s)
    if "moe_vs_dense" in args.sections:
        result["moe_vs_dense"], result["moe_vs_dense_s"] = bench_moe_vs_dense(
            sizes, args.experts, dtype, args.warmup, args.repeats,
            impls=tuple(args.layer_dispatches), dropout=args.layer_dropout)
    if "padded_blocks" in args.sections:
        result["padded_blocks"] = bench_padded_blocks(sizes, args.experts, dtype, args.warmup,
                                                      args.repeats, dropout=args.layer_dropout)
    if "throughput" in args.sections:
        result["throughput"] = bench_throughput(sizes, dtype, args.warmup, args.repeats,
                                                **model_options)
    if "fusion" in args.sections:
        result["fusion"] = bench_fusion(sizes, args.experts, dtype, args.warmup, args.repeats,
                                        **model_options)
    if "decode" in args.sections:
        shapes = None
        if args.decode_shapes:
            shapes = {}
            for item in args.decode_shapes:
                name, _, dims = item.partition("=")
                rows, _, length = dims.partition("x")
                shapes[name] = (int(rows), int(length))
        result["decode"] = bench_decode(sizes, args.experts, dtype, args.warmup, args.repeats,
                                        beam_size=args.decode_beam,
                                        max_extra_len=args.decode_extra_len, shapes=shapes)
    if "profile" in args.sections:
        result["profile"] = bench_profile(sizes, dtype, args.warmup, args.profile_steps,
                                          args.profile_dir, **model_options)
    result["load_average_end"] = load_average()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    print(markdown_tables(result))
    return result


if __name__ == "__main__":
    main()
