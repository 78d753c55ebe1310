"""Timing harness of the benchmarks: interleaved timed calls, their statistics, the machine's
load and a description of the machine.

Every timing: ``warmup`` untimed calls (the first compiles), then ``repeats`` timed calls, each
ended by ``jax.block_until_ready``; reported as median, min and max seconds. The 1-minute load
average is recorded around each measurement (other jobs share CPU cores).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


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


def with_switch_first(routers: Sequence[str]) -> list[str]:
    """``routers`` with ``switch`` (the reference every ratio is taken to) first, no repeats."""
    return list(dict.fromkeys(["switch", *routers]))


def ratios_to(times: dict[str, list[float]], reference: str,
              cpu_times: dict[str, list[float]] | None = None,
              flops: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Each timed function against ``reference``, from the times of :func:`time_interleaved`.

    Per name: ``time`` (its :func:`stats`), ``ratio`` (median over the reference's median),
    ``paired_ratio`` (stats of the ratios of the calls timed in the same repeat, under nearly
    the same load: their spread is the noise floor of ``ratio``), with ``cpu_times`` also
    ``cpu_time`` and ``paired_cpu_ratio`` (process CPU seconds, which waiting for a shared core
    does not inflate), and with ``flops`` (model FLOPs per call) ``flops`` and ``flop_ratio``.
    """
    out: dict[str, dict[str, Any]] = {}
    ref = times[reference]
    for name, t in times.items():
        row: dict[str, Any] = {
            "time": stats(t), "ratio": statistics.median(t) / statistics.median(ref),
            "paired_ratio": stats([b / a for a, b in zip(ref, t, strict=True)])}
        if cpu_times is not None:
            cref, c = cpu_times[reference], cpu_times[name]
            row["cpu_time"] = stats(c)
            row["paired_cpu_ratio"] = stats([b / a for a, b in zip(cref, c, strict=True)])
        if flops is not None:
            row["flops"] = flops[name]
            row["flop_ratio"] = flops[name] / flops[reference]
        out[name] = row
    return out


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
