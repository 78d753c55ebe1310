"""Where the device time of a ``jax.profiler`` trace goes: per op or kernel and per category."""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from typing import Any


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


def profile_steps(step: Callable[[], Any], warmup: int, steps: int, logdir: str,
                  label: str) -> dict[str, Any]:
    """``warmup`` untimed calls of ``step``, then a ``jax.profiler`` trace of ``steps`` calls
    into ``logdir``: the wall time per traced call and :func:`summarize_trace` of the newest
    trace, printed under ``label``."""
    import jax

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
    out: dict[str, Any] = {"logdir": logdir, "steps": steps, "wall_s_per_step_traced": wall}
    if traces:
        out.update(summarize_trace(traces[-1], steps))
        print(f"{label}: device {out['device_s_per_step']*1e3:.1f} ms/step of "
              f"{wall*1e3:.1f} ms wall; " + ", ".join(
                  f"{k} {v['fraction']:.0%}" for k, v in out["categories"].items()), flush=True)
        for op in out["top_ops"][:10]:
            print(f"  {op['op'][:60]:<60} {op['s_per_step']*1e3:8.2f} ms  {op['fraction']:.1%}")
    return out
