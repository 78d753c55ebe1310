"""Reading safetensors files without a framework: the header, and each tensor memory-mapped in
its own dtype.

The ``safetensors`` package's numpy reader has no bfloat16 or float8 dtype, yet the Hub's
checkpoints are bfloat16 (and DeepSeek-V3's weights float8 e4m3), so tensors are read here from
the format itself: an 8-byte little-endian header length, a JSON header naming each tensor's
``dtype``, ``shape`` and byte range (``data_offsets``, from the end of the header), then the
bytes. bfloat16 and float8 map to ``ml_dtypes``' types (a jax dependency).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

#: safetensors dtype names -> numpy dtypes.
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}


def header(file: str) -> dict[str, dict]:
    """Per tensor of ``file``: its ``dtype`` (safetensors' name), ``shape``, ``data_offsets``
    and ``start`` (the byte its data starts at in the file); a one-line ValueError naming the
    file when the header does not parse, names a dtype not in :data:`DTYPES`, or places a
    tensor past the end of the file (a truncated file)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            entries = json.loads(f.read(length))
        entries.pop("__metadata__", None)
        table = {name: {**entry, "start": 8 + length + entry["data_offsets"][0]}
                 for name, entry in entries.items()}
    except (struct.error, ValueError, KeyError, TypeError, IndexError, MemoryError):
        raise ValueError(f"{file}: not a safetensors file (its header does not parse)") from None
    size = os.path.getsize(file)
    for name, entry in table.items():
        if entry.get("dtype") not in DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {entry.get('dtype')!r}, which "
                             f"is not read (read: {', '.join(DTYPES)})")
        if entry["start"] - entry["data_offsets"][0] + entry["data_offsets"][1] > size:
            raise ValueError(f"{file}: tensor {name!r} ends past the end of the file "
                             f"({size} bytes): the file is truncated")
    return table


def read(file: str, entry: dict) -> np.ndarray:
    """One tensor of ``file`` (``entry``: its :func:`header` row), memory-mapped, in its own
    dtype (bfloat16 and float8 as ``ml_dtypes``' types)."""
    shape = tuple(entry["shape"])
    if not all(shape):  # np.memmap cannot map zero bytes
        return np.zeros(shape, DTYPES[entry["dtype"]])
    return np.memmap(file, DTYPES[entry["dtype"]], mode="r", offset=entry["start"], shape=shape)
