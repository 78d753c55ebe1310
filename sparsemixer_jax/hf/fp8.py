"""Block FP8 weights, as DeepSeek-V3's checkpoints on the Hub hold them, dequantized on load.

A weight ``W [rows, cols]`` is stored as ``<name>.weight`` in float8 e4m3 (safetensors dtype
``F8_E4M3``) and ``<name>.weight_scale_inv`` float32 ``[ceil(rows / b0), ceil(cols / b1)]``
with ``(b0, b1)`` the config's ``quantization_config.weight_block_size`` (``[128, 128]`` on
the Hub). Dequantized as DeepSeek-V3's own ``weight_dequant`` does: each element times the
scale of its block, ``W[i, j] = q[i, j] * scale_inv[i // b0, j // b1]``; the grid is
ceil-divided, so a last block the weight only partly fills (``kv_a_proj_with_mqa``'s 576 rows
are 4.5 blocks of 128) takes its own scale for the rows it has.

The e4m3 values are read by :mod:`sparsemixer_jax.hf.safetensors_read` (the ``safetensors``
package's numpy reader has no float8 dtype).
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
#: The float8 dtypes a block-FP8 weight may have (DeepSeek-V3's: e4m3); either is dequantized alike.
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale tensor's shape for a weight of ``shape`` and blocks ``block`` (ceil-divided)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def check_scale(weight_shape: tuple[int, ...], scale: np.ndarray, block: tuple[int, int],
                name: str, where: str) -> None:
    """A one-line ValueError naming ``where`` (the file) and the scale tensor unless ``scale``
    is float ``[ceil(rows / b0), ceil(cols / b1)]`` for the 2-D weight ``name``."""
    grid = scale_grid(weight_shape, block) if len(weight_shape) == 2 else None
    if grid is None or scale.shape != grid or not np.issubdtype(scale.dtype, np.floating):
        raise ValueError(f"{where}: tensor {name + SCALE_SUFFIX!r} is {scale.dtype} "
                         f"{list(scale.shape)}, expected float {list(grid or ())} (one scale per "
                         f"{block[0]} x {block[1]} block of {name!r}, "
                         f"{list(weight_shape)})")


def dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 ``weight [rows, cols]`` times its block's scale (``scale`` from
    :func:`check_scale`); edge blocks cut to the rows and columns the weight has."""
    rows, cols = weight.shape
    expanded = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * expanded[:rows, :cols]
