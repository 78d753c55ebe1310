"""The decoder-only language model's whole training step as a benchmark workload, and the
section that times it (``lm_throughput``): tokens per second of an MoE model (8 experts, top-2)
against a dense model of equal active parameters, model FLOPs per token and MFU, and the step
time of SparseMixer-v2, v2* and DenseMixer against top-2 softmax routing (Mixtral's).

Every arm is ``LMTask.loss`` through the project's compiled training step
(``training.build_steps``), on one synthetic batch of random token ids (one document per row),
timed in interleaved rounds by :func:`lab.benchmarks.harness.time_interleaved`.

``document_mask`` says how cuDNN's attention gets the batch's documents (:data:`DOCUMENT_MASKS`):
``"bias"`` and ``"offsets"`` set ``model.cudnn_document_mask`` (the batch carries segment ids,
as training's does); ``"causal"`` gives the model no segment ids, so cuDNN takes its causal
flag alone. With one document a row all three compute the same attention: what the mask costs.

The arms (``model config`` from ``configs/lm_quickstart.py`` with the benchmark's sizes):

* ``top2``: ``switch`` with ``normalize_top_k``, jitter 0: Mixtral's routing, the reference of
  every router ratio.
* one arm per router of ``routers`` (default ``sparsemixer_v2``, ``sparsemixer_v2star``,
  ``densemixer``): the same model, the same initial weights' shapes and the same batch.
* ``dense``: every layer's feed-forward a SwiGLU MLP of width ``top_k x mlp`` (the experts' width
  times the experts a token runs): the same matmul parameters per token as the MoE model's
  active ones (the MoE model adds only its routers, ``emb x N`` per layer). Routed by
  ``switch`` like ``top2``, which routes nothing in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.flops import device_peak, lm_flops_per_token
from lab.benchmarks.harness import load_average, ratios_to, stats, time_interleaved

# Mixtral's routing, the reference arm; the routers timed against it by default.
REFERENCE = "top2"
LM_ROUTERS = ("sparsemixer_v2", "sparsemixer_v2star", "densemixer")
DOCUMENT_MASKS = ("bias", "offsets", "causal")

# Default sizes (``mlp`` is each expert's width): a model a loaded 2-core CPU runs in a couple
# of minutes, and one for an H100 (bf16, sequences of 2048). Every arm's train state stays on
# the device while the others run: compiled for one H100 (jax's compile-only GPU target), the
# largest arm's step (DenseMixer's, padded dispatch: what "auto" picks on a GPU) needs 28.7 GiB,
# 4.3 GiB of it its state; the five arms' states and that step's temporaries come to about
# 43 GiB, within the 75% of HBM jax allocates by default (a DenseMixer arm of 8 layers, experts
# of width 2816 and 16,384 tokens a step needed 65.7 GiB alone).
LM_CPU_SIZES = {"emb": 128, "mlp": 256, "heads": 4, "kv_heads": 2, "layers": 2,
                "vocab": 2048, "tokens": 1024, "length": 128, "experts": 8, "top_k": 2}
LM_ACCEL_SIZES = {"emb": 1024, "mlp": 2048, "heads": 16, "kv_heads": 4, "layers": 6,
                  "vocab": 32000, "tokens": 8192, "length": 2048, "experts": 8, "top_k": 2}


def lm_model_config(sizes: dict[str, int], router: str, dtype: str,
                    dispatch: str = "auto", attention_impl: str = "einsum",
                    base: Any = None, document_mask: str = "bias") -> Any:
    """The ``top2`` arm's config routed by ``router`` instead (top-``k`` of
    ``sizes["experts"]``; ``switch`` renormalised with jitter 0: Mixtral's routing).

    ``base`` None: ``configs/lm_quickstart.py`` with the benchmark's sizes. Else an LM config
    (``configs/lm_bench.py``) whose sizes :func:`lm_sizes_of` read; only the router, the compute
    dtype, the dispatch and the attention (``document_mask``: module docstring) change."""
    from configs import lm_quickstart
    from sparsemixer_jax.routers.registry import routers_taking

    c = lm_quickstart.get_config() if base is None else base.copy_and_resolve_references()
    if base is None:
        c.data.vocab_size = sizes["vocab"]
        c.data.seq_len = sizes["length"]
        c.data.batch_size = c.data.eval_batch_size = rows_of(sizes)
        m = c.model
        m.hidden_size, m.mlp_dim = sizes["emb"], sizes["mlp"]
        m.num_layers, m.num_heads = sizes["layers"], sizes["heads"]
        m.num_kv_heads, m.num_experts = sizes["kv_heads"], sizes["experts"]
    c.model.dispatch, c.model.compute_dtype = dispatch, dtype
    c.model.attention_impl = attention_impl
    if document_mask not in DOCUMENT_MASKS:
        raise ValueError(f"document_mask={document_mask!r}; choose one of "
                         f"{', '.join(DOCUMENT_MASKS)}")
    if document_mask != "causal":
        c.model.cudnn_document_mask = document_mask
    c.router.name, c.router.top_k = router, sizes["top_k"]
    c.router.jitter_eps = 0.0 if router == "switch" else c.router.jitter_eps
    # Mixtral renormalises the k gates: every router with Switch's forward does so here too.
    c.router.normalize_top_k = router in routers_taking("normalize_top_k")
    return c


def lm_sizes_of(config: Any) -> dict[str, int]:
    """The benchmark's sizes of an MoE LM config (``configs/lm_bench.py:moe``), with
    ``micro_rows``: the rows of each micro-batch of an update (``data.micro_batch_size``)."""
    m, d = config.model, config.data
    if not m.num_experts:
        raise ValueError("lm_throughput: the LM config must be an MoE model (model.num_experts "
                         "> 0); its dense arm is built from it (lab.benchmarks.lm_step.dense_twin)")
    return {"emb": m.hidden_size, "mlp": m.mlp_dim, "heads": m.num_heads,
            "kv_heads": m.num_kv_heads, "layers": m.num_layers, "vocab": d.vocab_size,
            "tokens": d.batch_size * d.seq_len, "length": d.seq_len, "experts": m.num_experts,
            "top_k": config.router.top_k, "micro_rows": d.micro_batch_size or d.batch_size}


def rows_of(sizes: dict[str, int]) -> int:
    """Rows of one micro-batch: ``micro_rows`` where the sizes give it, else the whole update."""
    return sizes.get("micro_rows") or max(1, sizes["tokens"] // sizes["length"])


def micro_batches_of(sizes: dict[str, int]) -> int:
    """Micro-batches of one update (the update's rows over :func:`rows_of`)."""
    return max(1, sizes["tokens"] // sizes["length"] // rows_of(sizes))


def dense_twin(task: Any) -> Any:
    """``task`` (an ``LMTask``) with every feed-forward sublayer a dense SwiGLU MLP of width
    ``top_k x`` the experts' width: the MoE model's active matmul parameters per token."""
    lm = task.lm
    dense = lm.replace(moe_layers=(False,) * lm.arch.num_layers,
                       intermediate_size=lm.top_k * lm.arch.moe_intermediate_size)
    return dataclasses.replace(task, lm=dense)


def synthetic_lm_batch(sizes: dict[str, int], seed: int = 0, segments: bool = True
                       ) -> dict[str, Any]:
    """The batch ``LMTask`` trains on: ``tokens`` int32 ``[rows, length]`` of random ids (id 1,
    the document start, first), ``segments`` all 1 (one document per row, every position real;
    left out where ``segments`` is False: the model gets no segment ids), ``bytes`` float32
    ``[rows]`` (4 per target; it only enters bits per byte)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    rows, length = rows_of(sizes), sizes["length"]
    tokens = rng.integers(2, sizes["vocab"], (rows, length), dtype=np.int32)
    tokens[:, 0] = 1
    batch = {"tokens": jnp.asarray(tokens),
             "segments": jnp.ones((rows, length), jnp.int32),
             "targets": jnp.ones((rows, length), bool).at[:, 0].set(False),
             "bytes": jnp.full((rows,), 4.0 * (length - 1), jnp.float32)}
    if not segments:
        del batch["segments"]
    return batch


def active_params(lm: Any, num_params: int) -> int:
    """Parameters a token runs through: all of them less the experts it does not choose
    (``(N - k) x 3 emb mlp`` per MoE layer: gate, up and down projections)."""
    unchosen = (lm.num_experts - lm.top_k) * 3 * lm.arch.hidden_size * lm.arch.moe_intermediate_size
    return num_params - sum(lm.arch.moe_layers) * unchosen


class LMTrainStep:
    """One update of the training loop on the language model, as a zero-argument call:
    ``LMTask.loss`` in ``Steps.train_step`` over ``micro_batches`` copies of ``batch`` (one: a
    single compiled call; several: zero, accumulate each, apply, as training runs them). Owns
    the train state, which the compiled update donates and returns."""

    def __init__(self, task: Any, config: Any, batch: dict[str, Any], micro_batches: int = 1):
        import jax

        from sparsemixer_jax.tasks import run_config
        from sparsemixer_jax.training import build_steps
        from sparsemixer_jax.training.steps import count_params

        self.lm = task.lm
        self.steps = build_steps(run_config(config, task), task.lm.arch.vocab_size)
        self.state = self.steps.init_state()
        self.micro_batches = [batch] * micro_batches
        self.key = jax.random.key(0)
        self.num_params = count_params(self.state.params)
        self.active_params = active_params(self.lm, self.num_params) \
            if any(self.lm.arch.moe_layers) else self.num_params

    def __call__(self) -> Any:
        import jax

        # The same key every call: the routers see the same jitter/mask draws each time.
        self.state, metrics = self.steps.train_step(self.state, self.micro_batches,
                                                     self.key)
        return jax.tree.leaves(self.state.params)[0], metrics


def build_arms(sizes: dict[str, int], dtype: str, routers: Sequence[str],
               dispatch: str = "auto", attention_impl: str = "einsum", base: Any = None,
               document_mask: str = "bias") -> dict[str, LMTrainStep]:
    """``top2``, each router of ``routers``, then ``dense`` (module docstring), built on one
    batch (``base``, ``document_mask``: :func:`lm_model_config`'s)."""
    from sparsemixer_jax.tasks.language_model import LMTask

    batch = synthetic_lm_batch(sizes, segments=document_mask != "causal")
    micro = micro_batches_of(sizes)
    names = {REFERENCE: "switch", **{r: r for r in routers if r != "switch"}}
    arms: dict[str, LMTrainStep] = {}
    for name, router in names.items():
        config = lm_model_config(sizes, router, dtype, dispatch, attention_impl, base,
                                 document_mask)
        arms[name] = LMTrainStep(LMTask.from_config(config), config, batch, micro)
    config = lm_model_config(sizes, "switch", dtype, dispatch, attention_impl, base,
                             document_mask)
    arms["dense"] = LMTrainStep(dense_twin(LMTask.from_config(config)), config, batch, micro)
    return arms


def bench_lm_throughput(sizes: dict[str, int], dtype: str, warmup: int, repeats: int,
                        routers: Sequence[str] = LM_ROUTERS, dispatch: str = "auto",
                        attention_impl: str = "einsum", base: Any = None,
                        document_mask: str = "bias") -> dict[str, Any]:
    """Every arm of :func:`build_arms`, interleaved repeats; ``sizes``, ``base`` and
    ``document_mask`` as :func:`lm_model_config` takes them (an update of ``sizes["tokens"]``
    tokens).

    JSON: ``sizes``, ``dtype``, ``document_mask``, ``device_kind``, ``peak_flops`` (None where
    unknown), ``micro_batches``, ``tokens_per_step`` (rows x length x micro-batches; the loss counts
    ``length - 1`` targets a row),
    ``load_average`` before and after, and per arm ``router``, ``num_params``,
    ``active_params``, ``step_s`` (stats), ``tokens_per_s`` with its ``[min, max]`` range,
    ``model_flops_per_token`` (:func:`flops.lm_flops_per_token`'s parts), ``mfu``, and
    ``to_top2`` (:func:`harness.ratios_to` against ``top2``: ratio of medians, paired ratios and
    CPU-time ratios, FLOP ratio). ``moe_to_dense``: ``top2``'s tokens/s over ``dense``'s (ratio of
    medians) and the stats of the per-round ratios of wall time (``paired``) and of the process's
    CPU time (``paired_cpu``: on shared CPU cores, the work done).
    """
    load_before = load_average()
    arms = build_arms(sizes, dtype, routers, dispatch, attention_impl, base, document_mask)
    cpu: dict[str, list[float]] = {}
    times = time_interleaved(arms, warmup, repeats, cpu_times=cpu)
    length = sizes["length"]
    tokens = rows_of(sizes) * length * micro_batches_of(sizes)
    per_token = {name: lm_flops_per_token(arm.lm, length) for name, arm in arms.items()}
    flops = {name: f["total"] * tokens for name, f in per_token.items()}
    to_ref = ratios_to(times, REFERENCE, cpu, flops)
    kind, peak = device_peak(dtype)
    out: dict[str, Any] = {"sizes": dict(sizes), "dtype": dtype, "dispatch": dispatch,
                           "attention_impl": attention_impl,
                           "document_mask": document_mask, "device_kind": kind,
                           "peak_flops": peak, "micro_batches": micro_batches_of(sizes),
                           "tokens_per_step": tokens}
    for name, arm in arms.items():
        s = stats(times[name])
        out[name] = {
            "router": arm.lm.router if any(arm.lm.arch.moe_layers) else None,
            "num_params": arm.num_params, "active_params": arm.active_params,
            "step_s": s, "tokens_per_s": tokens / s["median"],
            "tokens_per_s_range": [tokens / s["max"], tokens / s["min"]],
            "model_flops_per_token": per_token[name],
            "achieved_flops_per_s": flops[name] / s["median"],
            "mfu": flops[name] / s["median"] / peak if peak else None,
            "to_top2": to_ref[name],
        }
    # Per round, dense's time over top2's: top2's tokens/s over dense's.
    out["moe_to_dense"] = {"tokens_per_s_ratio": out[REFERENCE]["tokens_per_s"]
                           / out["dense"]["tokens_per_s"],
                           "paired": stats(_paired(times, REFERENCE, "dense")),
                           "paired_cpu": stats(_paired(cpu, REFERENCE, "dense"))}
    out["load_average"] = [load_before, load_average()]
    for name in arms:
        a = out[name]
        mfu = f", MFU {a['mfu']:.1%}" if peak else ""
        print(f"lm_throughput {name}: {a['tokens_per_s']:.0f} tokens/s "
              f"({a['step_s']['median']*1e3:.1f} ms/step, {a['active_params']:,} active of "
              f"{a['num_params']:,} params), ratio to top2 {a['to_top2']['ratio']:.3f}{mfu}",
              flush=True)
    print(f"lm_throughput top2/dense tokens/s: {out['moe_to_dense']['tokens_per_s_ratio']:.3f} "
          f"(load {out['load_average']})", flush=True)
    return out


def _paired(times: dict[str, list[float]], reference: str, name: str) -> list[float]:
    """``name``'s time over ``reference``'s, round by round."""
    return [b / a for a, b in zip(times[reference], times[name], strict=True)]


def bench_lm_profile(sizes: dict[str, int], dtype: str, warmup: int, steps: int, logdir: str,
                     dispatch: str = "auto", attention_impl: str = "einsum",
                     base: Any = None, document_mask: str = "bias") -> dict[str, Any]:
    """A ``jax.profiler`` trace of ``steps`` training steps of the ``top2`` arm and where its
    device time goes (:func:`lab.benchmarks.trace.profile_steps`), as ``profile`` does for
    the translation model."""
    from lab.benchmarks.trace import profile_steps
    from sparsemixer_jax.tasks.language_model import LMTask

    config = lm_model_config(sizes, "switch", dtype, dispatch, attention_impl, base,
                             document_mask)
    batch = synthetic_lm_batch(sizes, segments=document_mask != "causal")
    step = LMTrainStep(LMTask.from_config(config), config, batch, micro_batches_of(sizes))
    out = profile_steps(step, warmup, steps, logdir, "lm_profile")
    return {"sizes": dict(sizes), "dtype": dtype, "dispatch": dispatch,
            "attention_impl": attention_impl, "document_mask": document_mask,
            "load_average": load_average(), **out}
