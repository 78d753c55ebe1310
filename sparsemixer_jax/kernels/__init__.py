"""GPU kernels behind the MoE layer's expert FFN, apart from the layer that calls them.

* :mod:`~sparsemixer_jax.kernels.mosaic_grouped_matmul`: :func:`grouped_matmul`, a custom-VJP
  grouped matmul whose forward and gradients run on JAX's Mosaic GPU Pallas kernels on Hopper
  (``impl="mosaic"``), on ``tokamax.ragged_dot`` (``impl="tokamax"``) or on
  ``jax.lax.ragged_dot`` (``impl="xla"``); the ``"grouped"``
  dispatch of :mod:`sparsemixer_jax.moe.dispatch` is built on it.
* :mod:`~sparsemixer_jax.kernels.grouped_matmul_2wg`: our grouped matmul with two consumer
  warpgroups per program, behind ``GroupedMatmulConfig(warpgroups=2)``.
* :mod:`~sparsemixer_jax.kernels.triton_ragged_dot`: whether ``jax.lax.ragged_dot`` lowers to
  grouped Pallas/Triton kernels on a GPU, and a switch for it.
"""

from sparsemixer_jax.kernels.mosaic_grouped_matmul import (
    GroupedMatmulConfig,
    check_grouped_supported,
    grouped_matmul,
    interpret_mode_active,
    mosaic_matmul,
    mosaic_weight_grad,
    sm_count,
    smem_bytes,
    target_device,
    tile_errors,
    transposed_ragged_dot,
)

__all__ = [
    "GroupedMatmulConfig",
    "check_grouped_supported",
    "grouped_matmul",
    "interpret_mode_active",
    "mosaic_matmul",
    "mosaic_weight_grad",
    "sm_count",
    "smem_bytes",
    "target_device",
    "tile_errors",
    "transposed_ragged_dot",
]
