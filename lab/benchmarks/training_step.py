"""The whole training step as a benchmark workload, and the sections that time it: Switch
against SparseMixer, DenseMixer, Default MoE or any other router (overhead), dense against N=4
(throughput and MFU), one compiled call against the three calls of an accumulating update
(fusion), and a profile of where the device time goes.
"""

from __future__ import annotations

from typing import Any

from lab.benchmarks.flops import device_peak, model_flops_per_step
from lab.benchmarks.harness import (
    load_average,
    ratios_to,
    stats,
    time_interleaved,
    with_switch_first,
)
from lab.benchmarks.trace import profile_steps


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

    Owns the train state, which the compiled update donates and returns.
    ``fused``: ``train.Steps.train_step``, one compiled call per update (what ``train.py`` runs
    without gradient accumulation); else the three calls of an accumulating update (zero the
    accumulator, forward + backward, optimizer update).
    """

    def __init__(self, config: Any, vocab: int, batch: dict[str, Any], fused: bool = True):
        import jax

        from sparsemixer_jax.tasks import run_config
        from sparsemixer_jax.training import build_steps
        from sparsemixer_jax.training.steps import count_params

        self.steps = build_steps(run_config(config), vocab)
        self.state = self.steps.init_state()
        self.batch = batch
        self.key = jax.random.key(0)
        self.num_params = count_params(self.state.params)
        self.fused = fused
        self.calls = 0

    def __call__(self) -> Any:
        import jax

        # The same key every call: the routers see the same jitter/mask draws each time.
        if self.fused:
            self.state, metrics = self.steps.train_step(self.state, [self.batch], self.key)
        else:
            acc = self.steps.zeros(self.state, self.batch)
            acc, layer_state = self.steps.accumulate(self.state, acc, self.batch,
                                                     jax.random.fold_in(self.key, 0))
            self.state, metrics = self.steps.update(self.state, acc, layer_state)
        self.calls += 1
        return jax.tree.leaves(self.state.params)[0], metrics


def bench_overhead(sizes, experts, dtype, warmup, repeats,
                   routers=("switch", "sparsemixer"), **model_options) -> dict[str, Any]:
    """Whole training step of each router (Switch first, the reference), for each N,
    interleaved repeats. ``model_options``: ``dispatch`` and ``attention_impl`` of
    :func:`model_config`.

    JSON per N: ``{router}`` (stats of seconds per update) and ``{router}_s`` (median) for each
    router, ``to_switch[router]`` (:func:`harness.ratios_to`: ratio of medians, paired wall and
    CPU-time ratios, model FLOPs per step and FLOP ratio), ``load_average``; with SparseMixer
    also ``ratio`` and ``paired_ratio``, SparseMixer's to Switch."""
    routers = with_switch_first(routers)
    batch = synthetic_batch(sizes)
    out = {}
    for n in experts:
        load_before = load_average()
        fns = {router: TrainStep(model_config(sizes, n, router, dtype, **model_options),
                                 sizes["vocab"], batch)
               for router in routers}
        cpu: dict[str, list[float]] = {}
        times = time_interleaved(fns, warmup, repeats, cpu_times=cpu)
        flops = {router: model_flops_per_step(sizes, n, router) for router in routers}
        # Each repeat times the routers back to back, under nearly the same load: the spread
        # of the paired ratios is the noise floor of each ratio of medians.
        to_switch = ratios_to(times, "switch", cpu, flops)
        row: dict[str, Any] = {}
        for router in routers:
            row[router] = to_switch[router]["time"]
            row[f"{router}_s"] = row[router]["median"]
        if "sparsemixer" in to_switch:
            row["ratio"] = to_switch["sparsemixer"]["ratio"]
            row["paired_ratio"] = to_switch["sparsemixer"]["paired_ratio"]
        row["to_switch"] = to_switch
        row["load_average"] = [load_before, load_average()]
        out[str(n)] = row
        s = row["switch"]
        print(f"overhead N={n}: switch {s['median']*1e3:.1f} ms [{s['min']*1e3:.1f}, "
              f"{s['max']*1e3:.1f}]; " + ", ".join(
                  f"{r} {row[r]['median']*1e3:.1f} ms (ratio {to_switch[r]['ratio']:.3f}, "
                  f"FLOPs {to_switch[r]['flop_ratio']:.3f})" for r in routers[1:])
              + f" (load {row['load_average']})", flush=True)
        del fns
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


def bench_profile(sizes, dtype, warmup, steps, logdir, num_experts=4,
                  **model_options) -> dict[str, Any]:
    """``jax.profiler`` trace of ``steps`` whole training steps (SparseMixer, ``num_experts``)
    and a summary of where the device time goes."""
    step = TrainStep(model_config(sizes, num_experts, "sparsemixer", dtype, **model_options),
                     sizes["vocab"],
                     synthetic_batch(sizes))
    out = profile_steps(step, warmup, steps, logdir, f"profile (N={num_experts})")
    return {"num_experts": num_experts, "load_average": load_average(), **out}
