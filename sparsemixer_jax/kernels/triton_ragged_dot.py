"""Which grouped-matmul lowering ``jax.lax.ragged_dot`` gets on an NVIDIA GPU, and a switch for it.

By default XLA:GPU may lower ``ragged_dot`` to a dense batched dot over all ``N`` groups with the
rows of other groups zeroed: measured on one H100 (jax 0.11.2, bf16, 32,768 tokens, emb 512, mlp
2048), one MoE layer forward + backward took 147-203 ms with ``dispatch="ragged"`` against
4.3-4.9 ms with ``"padded"`` and 1.7 ms for the dense FFN (docs/benchmarks.md). jax has a
config option, ``jax_ragged_dot_use_gpu_pallas_triton_lowering``, that lowers ``ragged_dot`` and
its two gradients to Pallas/Triton grouped kernels instead, but the kernels live in a module that
some jax wheels lack (``jax._src.lax.pallas_lowerings``: absent from the CPU wheel of 0.10.2 and
from the CUDA wheel of 0.11.2, where turning the option on fails at compile time).

:func:`triton_ragged_dot_available` says whether this jax can use that lowering;
:func:`enable_triton_ragged_dot` turns it on only then, so ``moe.resolve_dispatch("auto")`` can
pick ``"ragged"`` on a GPU exactly when it is backed by grouped kernels.
"""

from __future__ import annotations

import importlib.util

import jax

TRITON_RAGGED_DOT_OPTION = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
# Where jax's GPU lowering rule imports the kernels from (jax/_src/lax/lax.py, 0.10-0.11).
TRITON_RAGGED_DOT_MODULE = "jax._src.lax.pallas_lowerings.gpu.ragged_dot"


def triton_ragged_dot_available() -> bool:
    """True if this jax has both the config option and the Pallas/Triton ragged_dot kernels."""
    if TRITON_RAGGED_DOT_OPTION not in jax.config.values:
        return False
    try:
        return importlib.util.find_spec(TRITON_RAGGED_DOT_MODULE) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def triton_ragged_dot_enabled() -> bool:
    """True if ``ragged_dot`` on a GPU lowers to the grouped Pallas/Triton kernels."""
    return triton_ragged_dot_available() and bool(jax.config.values[TRITON_RAGGED_DOT_OPTION])


def enable_triton_ragged_dot() -> bool:
    """Turns on the Pallas/Triton lowering of ``ragged_dot`` where this jax has it.

    Returns whether it is on. Where the kernels are missing nothing changes (the option would
    only make every compilation that meets ``ragged_dot`` on a GPU fail), and ``auto`` dispatch
    keeps choosing ``"padded"`` on GPUs.
    """
    if not triton_ragged_dot_available():
        return False
    jax.config.update(TRITON_RAGGED_DOT_OPTION, True)
    return True
