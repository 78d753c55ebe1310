"""Process-wide JAX/XLA settings of an experiment (``config.runtime``), applied before training.

* ``runtime.deterministic``: XLA:GPU's ``--xla_gpu_deterministic_ops=true``: reductions and
  scatters in a fixed order and no autotuning that may pick a different kernel per run, so that a
  resumed run equals the uninterrupted one bit for bit on a GPU (CPUs are deterministic anyway).
  XLA reads its flags once, when the backend starts: :func:`configure` must run before anything
  touches a device (``experiments.wmt`` calls it first thing). Cost: deterministic scatter-adds
  and reductions are slower (atomics are replaced) and autotuning is off; to be measured on a GPU
  (``experiments/gpu_campaign.sh``, docs/benchmarks.md).
* ``runtime.rng_impl``: ``jax_default_prng_impl``, the PRNG of every key the run creates (router
  jitter, dropout). ``"threefry2x32"`` (jax's default, the same numbers on every backend) or
  ``"rbg"`` / ``"unsafe_rbg"``, which are cheaper on accelerators (4-8% of an H100 step,
  docs/benchmarks.md) but draw other numbers, so a run's results change with it.
* ``runtime.matmul_precision``: ``jax_default_matmul_precision``. ``"default"`` leaves jax's
  choice (float32 matmuls run as TF32 on NVIDIA GPUs since Ampere, ~1e-3 relative error);
  ``"highest"`` computes them in full float32 (slower on GPUs; no effect on CPUs).
* ``runtime.triton_ragged_dot``: ``ragged_dot``'s grouped Pallas/Triton GPU lowering where this
  jax has it (:mod:`sparsemixer_jax.kernels.triton_ragged_dot`); with it ``dispatch="auto"`` picks
  ``"ragged"`` on GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax

from sparsemixer_jax.section import check_choice, read_fields

logger = logging.getLogger(__name__)

DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"
RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """``config.runtime``: the process-wide settings of the module docstring."""

    deterministic: bool = False
    rng_impl: str = "threefry2x32"
    matmul_precision: str = "default"
    triton_ragged_dot: bool = False

    @classmethod
    def from_config(cls, section: Any, where: str = "config.runtime.") -> RuntimeConfig:
        """The settings of ``section``, checked: one-line ValueErrors naming the field."""
        runtime = cls(**read_fields(cls, section, where))
        check_choice(where, "rng_impl", runtime.rng_impl, RNG_IMPLS)
        check_choice(where, "matmul_precision", runtime.matmul_precision, MATMUL_PRECISIONS)
        return runtime


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public "has a backend started?" in jax 0.10-0.11

    return xla_bridge.backends_are_initialized()


def set_deterministic_gpu_ops() -> None:
    """Adds XLA's deterministic-GPU-ops flag to ``XLA_FLAGS``.

    Raises RuntimeError if a GPU backend already started without it (too late to take effect).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if DETERMINISTIC_XLA_FLAG in flags.split():
        return
    if _backend_started() and jax.default_backend() in ("gpu", "cuda", "rocm"):
        raise RuntimeError(
            "config.runtime.deterministic needs XLA_FLAGS to hold "
            f"{DETERMINISTIC_XLA_FLAG} before JAX starts its GPU backend; call "
            "sparsemixer_jax.training.runtime.configure(runtime) before any computation, or "
            "export it"
        )
    os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_XLA_FLAG}".strip()


def configure(runtime: RuntimeConfig) -> None:
    """Applies the runtime section ``runtime`` (module docstring)."""
    if runtime.deterministic:
        set_deterministic_gpu_ops()
    if jax.config.values["jax_default_prng_impl"] != runtime.rng_impl:
        jax.config.update("jax_default_prng_impl", runtime.rng_impl)
    precision = runtime.matmul_precision
    if precision != "default":
        jax.config.update("jax_default_matmul_precision", precision)
    if runtime.triton_ragged_dot:
        from sparsemixer_jax.kernels.triton_ragged_dot import enable_triton_ragged_dot

        if not enable_triton_ragged_dot():
            logger.warning("config.runtime.triton_ragged_dot: this jax lacks the Pallas/Triton "
                           "ragged_dot kernels; dispatch='auto' stays 'padded' on GPUs")
