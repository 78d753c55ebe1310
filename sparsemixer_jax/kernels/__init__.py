"""Hand-written and library GPU kernels behind the MoE layer's expert FFN.

:func:`grouped_ffn` is the ``"grouped"`` dispatch: the expert FFN on
:func:`grouped_matmul`, a custom-VJP grouped matmul whose forward and gradients run on JAX's
Mosaic GPU Pallas kernels on Hopper (``impl="mosaic"``) or on ``jax.lax.ragged_dot``
(``impl="xla"``).
"""

from sparsemixer_jax.kernels.grouped_ffn import grouped_ffn
from sparsemixer_jax.kernels.mosaic_grouped_matmul import (
    GroupedMatmulConfig,
    check_grouped_supported,
    grouped_matmul,
    interpret_mode_active,
)

__all__ = [
    "GroupedMatmulConfig",
    "check_grouped_supported",
    "grouped_ffn",
    "grouped_matmul",
    "interpret_mode_active",
]
