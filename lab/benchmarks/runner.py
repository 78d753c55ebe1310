"""Router overhead, MoE layer against dense, training throughput and decoding, side by side: the
runs of ``python -m experiments.benchmark``, one JSON result.

Sections (``sections`` picks some):

* ``overhead``: seconds per update of the whole training step (``train.Steps.train_step``: one
  compiled call per update, as ``train.py`` runs without gradient accumulation), Switch against
  each other router of ``routers`` (default SparseMixer; DenseMixer, Default MoE, ...) on the
  same model sizes, the same seed and the same batch, for each N. Repeats are interleaved (ABBA
  order, ABCDDCBA for four) so that a change of machine load hits every router alike; each
  ratio to Switch comes with the spread of its paired ratios, the process's CPU-time ratio and
  the FLOP ratio of ``flops.model_flops_per_step``. JSON: ``overhead[N] = {"switch_s",
  "sparsemixer_s", "ratio", "to_switch": {router: ...}, ...}``.
* ``router``: the two routers alone (forward + backward on ``[tokens, N]`` logits), and the
  difference as a share of the whole step: a bound on SparseMixer's overhead that is not
  drowned by the load noise of whole-step timings.
* ``moe_vs_dense``: forward + backward of one MoE layer (``MoEFeedForward``, top-1, dropless,
  each dispatch of ``layer_dispatches``; with ``triton_ragged_dot`` "ragged" is the grouped
  Pallas/Triton lowering where jax has it) against a dense feed-forward layer of width ``mlp``
  (the same per-token FLOPs: top-1 runs one expert of width ``mlp`` per token), interleaved.
  JSON: ``moe_vs_dense[N][impl] = ratio`` (MoE / dense seconds); times in ``moe_vs_dense_s``.
* ``layer_cost`` (not run by default): forward + backward of one MoE layer with each router of
  ``routers`` against Switch's (dispatch ``dispatch``, activation dropout ``layer_dropout``),
  interleaved, with the FLOP ratio of ``flops.moe_layer_flops_per_token``: what DenseMixer's
  dense pass over all N experts and Default MoE's terms cost where they are. JSON:
  ``layer_cost[N]["to_switch"][router]``.
* ``padded_blocks`` (not run by default): the ``padded`` expert FFN with smaller blocks than
  ``moe.dispatch.padded_block_rows`` picks, against dense: the evidence for a change of that rule.
* ``throughput``: target tokens per second of the whole training step, dense against N=4
  (SparseMixer), and model FLOPs utilisation against the device's peak on an accelerator.
* ``lm_throughput`` (not run by default): the decoder-only language model's whole training step
  (:mod:`lab.benchmarks.lm_step`): tokens per second of an MoE model (``lm_experts`` experts,
  top-``top_k``, Mixtral's routing) against a dense model of equal active parameters, model
  FLOPs per token and MFU, and each router of ``lm_routers`` (SparseMixer-v2, v2*, DenseMixer)
  against top-k, interleaved. Its own sizes (``LM_CPU_SIZES``, ``LM_ACCEL_SIZES``; ``mlp`` is
  each expert's width), which the size settings override; or, with ``lm_config`` (an MoE LM
  config such as ``configs/lm_bench.py:moe``), that config's model, sizes and micro-batches,
  its dense arm the config's dense twin (``configs/lm_bench.py:dense``), the ``dispatch`` and
  ``attention_impl`` settings overriding the config's where given; ``lm_document_mask``: how
  cuDNN gets the batch's documents (:data:`lab.benchmarks.lm_step.DOCUMENT_MASKS`: ``bias``,
  the default, ``offsets``, or ``causal``, no segment ids); ``lm_grouped_impl``: the config's
  ``model.grouped_impl`` replaced (``mosaic_2wg``: the two-warpgroup kernels). JSON:
  ``lm_throughput[arm]``.
* ``fusion`` (not run by default): the one-call update against the three calls of an
  accumulating update (zero, accumulate, update), dense and each N.
* ``decode`` (not run by default): beam search (beam 4) in sentences per second on Multi30k-test
  and newstest-like batches, dense and each N, compile time apart.
* ``profile`` (not run by default): a ``jax.profiler`` trace of a few whole training steps
  (N=4, SparseMixer) and the device time per op or kernel category (matmul, fused attention,
  fusions, scatter, collectives, memcpy, ...): on a GPU from the kernels on the device's
  streams, on CPU from the XLA ops' self times; the trace itself stays in ``profile_dir`` for
  TensorBoard or Perfetto.
* ``lm_profile`` (not run by default): the same for the language model's ``top2`` arm at the
  ``lm_throughput`` sizes.

Whole-step sections take ``dispatch`` (so does ``layer_cost``), ``attention_impl`` and, for the
whole run, ``rng_impl``, ``deterministic``, ``triton_ragged_dot``; the JSON records them.

Every timing: ``warmup`` untimed calls (the first compiles), then ``repeats`` timed calls,
each ended by ``jax.block_until_ready``; reported as median, min and max seconds. The load
average of the machine is recorded before and after each section (other jobs share CPU cores).

Default sizes: on CPU a reduced model (emb 256, mlp 1024, 2+2 layers, 4k vocabulary, 2048 tokens
per step, length 32) that finishes in minutes; on GPU/TPU Transformer-base (emb 512, mlp 2048,
6+6 layers, 32k vocabulary) at 2^15 tokens per step. Settings override each size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from lab.benchmarks.decoding import bench_decode
from lab.benchmarks.harness import load_average, machine, with_switch_first
from lab.benchmarks.layers import (
    bench_layer_cost,
    bench_moe_vs_dense,
    bench_padded_blocks,
    bench_router,
)
from lab.benchmarks.lm_step import (
    LM_ACCEL_SIZES,
    LM_CPU_SIZES,
    LM_ROUTERS,
    bench_lm_profile,
    bench_lm_throughput,
    lm_sizes_of,
)
from lab.benchmarks.report import markdown_tables
from lab.benchmarks.training_step import (
    bench_fusion,
    bench_overhead,
    bench_profile,
    bench_throughput,
)
from sparsemixer_jax.training.cli import load_config_file

# --backend -> jax_platforms. jax 0.11 reads "gpu" as "any GPU plugin" and then fails to start
# ROCm on a CUDA machine ("Unable to initialize backend 'rocm'"); the plugin's name is "cuda".
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}

DISPATCH_CHOICES = ("auto", "ragged", "padded", "grouped")

CPU_SIZES = {"emb": 256, "mlp": 1024, "heads": 4, "layers": 2, "vocab": 4000, "tokens": 2048,
             "length": 32}
ACCEL_SIZES = {"emb": 512, "mlp": 2048, "heads": 8, "layers": 6, "vocab": 32000,
               "tokens": 2**15, "length": 128}

SECTIONS = ("overhead", "router", "moe_vs_dense", "layer_cost", "throughput", "profile",
            "padded_blocks", "fusion", "decode", "lm_throughput", "lm_profile")


@dataclasses.dataclass
class BenchmarkSettings:
    """What one benchmark run measures, and how (the options of ``experiments.benchmark``).

    A size left None takes its value from ``CPU_SIZES`` on CPU and ``ACCEL_SIZES`` elsewhere;
    ``dtype`` None is float32 on CPU and bfloat16 elsewhere; ``routers`` are those the
    ``overhead`` and ``layer_cost`` sections time (Switch is always timed, as the reference);
    ``lm_routers`` those ``lm_throughput`` times against top-2 (``kv_heads``, ``lm_experts`` and
    ``top_k`` are its sizes alone; None takes ``LM_CPU_SIZES`` / ``LM_ACCEL_SIZES``);
    ``step_seconds`` None relates the
    routers' cost to the fastest Switch step of this run's overhead section; ``decode_shapes``
    None times ``DECODE_SHAPES``.
    """

    out: str | None = "runs/bench.json"  # under the git-ignored runs/ of a checkout
    backend: str | None = None
    sections: list[str] = dataclasses.field(
        default_factory=lambda: ["overhead", "router", "moe_vs_dense", "throughput"])
    dispatch: str | None = None  # "auto", or for the LM sections the config's (lm_config)
    routers: list[str] = dataclasses.field(default_factory=lambda: ["switch", "sparsemixer"])
    lm_routers: list[str] = dataclasses.field(default_factory=lambda: list(LM_ROUTERS))
    layer_dispatches: list[str] = dataclasses.field(default_factory=lambda: ["ragged", "padded"])
    attention_impl: str | None = None  # "einsum", or for the LM sections the config's
    lm_config: str | None = None  # "configs/lm_bench.py:moe": the LM sections' model and sizes
    lm_document_mask: str = "bias"  # the LM sections: lab.benchmarks.lm_step.DOCUMENT_MASKS
    lm_grouped_impl: str | None = None  # the LM sections: lm_config's model.grouped_impl replaced
    rng_impl: str | None = None
    triton_ragged_dot: bool = False
    deterministic: bool = False
    decode_beam: int = 4
    decode_extra_len: int = 50
    decode_shapes: dict[str, tuple[int, int]] | None = None
    experts: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 8, 16])
    dtype: str | None = None
    profile_dir: str = "/tmp/sparsemixer_profile"
    profile_steps: int = 3
    step_seconds: float | None = None
    layer_dropout: float = 0.1
    warmup: int = 2
    repeats: int = 6
    emb: int | None = None
    mlp: int | None = None
    heads: int | None = None
    layers: int | None = None
    vocab: int | None = None
    tokens: int | None = None
    length: int | None = None
    kv_heads: int | None = None
    lm_experts: int | None = None
    top_k: int | None = None


def lm_sizes(settings: BenchmarkSettings, backend: str, base: Any = None) -> dict[str, int]:
    """The ``lm_throughput`` section's sizes: those of the LM config ``base`` where given, else
    its defaults for ``backend``, each overridden by the setting of that name (``experts`` by
    ``lm_experts``)."""
    if base is not None:
        return lm_sizes_of(base)
    defaults = LM_CPU_SIZES if backend == "cpu" else LM_ACCEL_SIZES
    names = {k: "lm_experts" if k == "experts" else k for k in defaults}
    return {k: v if getattr(settings, names[k]) is None else getattr(settings, names[k])
            for k, v in defaults.items()}


def run(settings: BenchmarkSettings, command: str) -> dict[str, Any]:
    """Runs the sections of ``settings`` in their fixed order and returns the result JSON
    (``command``: the command line it records); writes it to ``settings.out`` if set, and prints
    each section's lines as it finishes and the markdown tables at the end."""
    s = settings
    import jax

    from sparsemixer_jax.kernels import triton_ragged_dot
    from sparsemixer_jax.routers import ROUTERS
    from sparsemixer_jax.training import runtime

    # Both before JAX starts its backend (JAX read JAX_PLATFORMS when it was imported).
    if s.backend:
        jax.config.update("jax_platforms", PLATFORMS[s.backend])
    if s.deterministic:
        runtime.set_deterministic_gpu_ops()
    if s.rng_impl:
        jax.config.update("jax_default_prng_impl", s.rng_impl)
    triton = triton_ragged_dot.enable_triton_ragged_dot() if s.triton_ragged_dot else False
    unknown = [r for r in [*s.routers, *s.lm_routers] if r not in ROUTERS]
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {sorted(ROUTERS)}")
    routers = with_switch_first(s.routers)

    backend = jax.default_backend()
    defaults = CPU_SIZES if backend == "cpu" else ACCEL_SIZES
    sizes = {k: getattr(s, k) if getattr(s, k) is not None else v for k, v in defaults.items()}
    dtype = s.dtype or ("float32" if backend == "cpu" else "bfloat16")
    result: dict[str, Any] = {
        "command": command,
        "machine": machine(), "sizes": sizes, "dtype": dtype,
        "warmup": s.warmup, "repeats": s.repeats, "layer_dropout": s.layer_dropout,
        "load_average_start": load_average(),
        "dispatch": s.dispatch or "auto", "attention_impl": s.attention_impl or "einsum",
        "lm_config": s.lm_config, "lm_grouped_impl": s.lm_grouped_impl, "routers": routers,
        "rng_impl": jax.config.values["jax_default_prng_impl"],
        "triton_ragged_dot": {"requested": s.triton_ragged_dot,
                              "available": triton_ragged_dot.triton_ragged_dot_available(),
                              "enabled": triton},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    model_options = {"dispatch": s.dispatch or "auto",
                     "attention_impl": s.attention_impl or "einsum"}
    # The LM sections: the config's model where one is named, the flags given overriding it.
    base = load_config_file(s.lm_config) if s.lm_config else None
    if s.lm_grouped_impl:
        if base is None:
            raise SystemExit("error: --lm-grouped-impl replaces --lm-config's model.grouped_impl; "
                             "name an LM config (e.g. --lm-config configs/lm_bench.py:moe)")
        base.model.grouped_impl = s.lm_grouped_impl
    lm_options = {"dispatch": s.dispatch or (base.model.dispatch if base else "auto"),
                  "attention_impl": s.attention_impl
                  or (base.model.attention_impl if base else "einsum"), "base": base,
                  "document_mask": s.lm_document_mask}
    print(json.dumps({k: result[k] for k in ("machine", "sizes", "dtype")}), flush=True)
    if "overhead" in s.sections:
        result["overhead"] = bench_overhead(sizes, s.experts, dtype, s.warmup, s.repeats,
                                            routers=routers, **model_options)
    if "router" in s.sections:
        overhead = result.get("overhead", {})
        step_s = min((o["switch_s"] for o in overhead.values()), default=None)
        result["router"] = bench_router(sizes["tokens"], s.experts, s.warmup,
                                        max(s.repeats, 20), s.step_seconds or step_s)
    if "moe_vs_dense" in s.sections:
        result["moe_vs_dense"], result["moe_vs_dense_s"] = bench_moe_vs_dense(
            sizes, s.experts, dtype, s.warmup, s.repeats,
            impls=tuple(s.layer_dispatches), dropout=s.layer_dropout)
    if "layer_cost" in s.sections:
        result["layer_cost"] = bench_layer_cost(sizes, s.experts, routers, dtype, s.warmup,
                                                s.repeats, dispatch=model_options["dispatch"],
                                                dropout=s.layer_dropout)
    if "padded_blocks" in s.sections:
        result["padded_blocks"] = bench_padded_blocks(sizes, s.experts, dtype, s.warmup,
                                                      s.repeats, dropout=s.layer_dropout)
    if "throughput" in s.sections:
        result["throughput"] = bench_throughput(sizes, dtype, s.warmup, s.repeats,
                                                **model_options)
    if "lm_throughput" in s.sections:
        result["lm_throughput"] = bench_lm_throughput(
            lm_sizes(s, backend, base), dtype, s.warmup, s.repeats, routers=s.lm_routers,
            **lm_options)
    if "lm_profile" in s.sections:
        result["lm_profile"] = bench_lm_profile(lm_sizes(s, backend, base), dtype, s.warmup,
                                                s.profile_steps, s.profile_dir, **lm_options)
    if "fusion" in s.sections:
        result["fusion"] = bench_fusion(sizes, s.experts, dtype, s.warmup, s.repeats,
                                        **model_options)
    if "decode" in s.sections:
        result["decode"] = bench_decode(sizes, s.experts, dtype, s.warmup, s.repeats,
                                        beam_size=s.decode_beam,
                                        max_extra_len=s.decode_extra_len,
                                        shapes=s.decode_shapes)
    if "profile" in s.sections:
        result["profile"] = bench_profile(sizes, dtype, s.warmup, s.profile_steps,
                                          s.profile_dir, **model_options)
    result["load_average_end"] = load_average()
    if s.out:
        os.makedirs(os.path.dirname(s.out) or ".", exist_ok=True)
        with open(s.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {s.out}")
    print(markdown_tables(result))
    return result
