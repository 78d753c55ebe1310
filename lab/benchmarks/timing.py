"""What the benchmarks of :mod:`lab.benchmarks.grouped_ffn` and
:mod:`lab.benchmarks.grouped_products` share: the machine they ran on, the timing of calls, and
building for a compile-only device."""

from __future__ import annotations

import contextlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import jax


def environment() -> dict[str, Any]:
    """Machine and library versions recorded with every result."""
    device = jax.devices()[0]
    out: dict[str, Any] = {
        "backend": jax.default_backend(), "device_kind": device.device_kind,
        "jax": jax.__version__, "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    if out["backend"] in ("gpu", "cuda"):
        out["compute_capability"] = str(getattr(device, "compute_capability", "?"))
        try:  # private module: record why instead of failing the benchmark
            from jax._src.lib import cuda_versions

            out["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
            out["cudnn"] = cuda_versions.cudnn_get_version()
        except Exception as err:
            out["cuda_versions_error"] = repr(err)
    return out


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (to its results' readiness), after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def targeting(device: Any):
    """Build for ``device`` (the kernels' sm90 check asks the default device), or as usual."""
    return contextlib.nullcontext() if device is None else jax.default_device(device)
