"""MXFP4 expert weights, as gpt-oss's checkpoints on the Hub hold them, dequantized on load.

MXFP4 (the Open Compute Project's Microscaling format, FP4 E2M1 elements with an E8M0 scale per
block of 32) stores a weight ``W [..., rows, cols]`` (``cols`` the input width, a multiple of
32) as two tensors (layout as transformers 5.23 reads it, ``integrations/mxfp4.py``):

* ``<name>_blocks``: uint8 ``[..., rows, cols / 32, 16]``, two 4-bit codes per byte, the low
  nibble the even element and the high nibble the odd one;
* ``<name>_scales``: uint8 ``[..., rows, cols / 32]``, the block's power of two plus 127.

A code is a sign bit and an E2M1 magnitude (:data:`FP4_VALUES`); the value is
``FP4_VALUES[code] * 2^(scale - 127)``, and the dequantized tensor is ``W`` with its last two
axes swapped, ``[..., cols, rows]``, as gpt-oss's ``gate_up_proj [N, emb, 2I]`` and
``down_proj [N, I, emb]`` are laid out. Every such value (two significant bits times a power of
two) is exact in float32, and in bfloat16 within its normal range, so the float32 params hold
what transformers' dequantization gives in either dtype.
"""

from __future__ import annotations

import numpy as np

#: The 16 FP4 (E2M1) values by code: codes 0-7 positive, 8-15 their negatives.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_BIAS = 127
BLOCK_BYTES = 16  # 32 four-bit codes


def check_pair(blocks: np.ndarray, scales: np.ndarray, name: str, where: str) -> None:
    """A one-line ValueError naming ``where`` (the file) and the tensor unless ``blocks`` and
    ``scales`` of weight ``name`` have MXFP4's dtypes and agreeing shapes."""
    if blocks.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"{where}: tensor {name + BLOCKS!r} is {blocks.dtype} "
                         f"{list(blocks.shape)}; MXFP4 blocks are uint8 [..., rows, cols / 32, "
                         f"{BLOCK_BYTES}]")
    if scales.dtype != np.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"{where}: tensor {name + SCALES!r} is {scales.dtype} "
                         f"{list(scales.shape)}, expected uint8 {list(blocks.shape[:-1])} (one "
                         f"scale per 32 values of {name + BLOCKS!r})")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., cols, rows]`` of MXFP4 ``blocks [..., rows, cols / 32, 16]`` and
    ``scales [..., rows, cols / 32]`` (module docstring; :func:`check_pair` first)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], 2 * BLOCK_BYTES)
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS
    weight = np.ldexp(values, exponents)  # exact: a power-of-two scaling of an FP4 value
    weight = weight.reshape(*blocks.shape[:-2], -1)  # [..., rows, cols]
    return np.ascontiguousarray(np.swapaxes(weight, -1, -2))
