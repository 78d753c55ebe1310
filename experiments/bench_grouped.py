"""Grouped-GEMM expert FFN against the padded dispatch and the dense FFN (forward + backward).

    python -m experiments.bench_grouped --json runs/grouped.json  # N = 2, 4, 8, 16 on a GPU
    python -m experiments.bench_grouped --interpret --tiny --experts 2  # the path, on a CPU
    python -m experiments.bench_grouped --target h100:1x1x1 --experts 4 --capacities
        # compiled for one H100 on a CPU: each dispatch's compile-time model, nothing timed
    python -m experiments.bench_grouped --products --experts 8 --warpgroups 1 2 \
        --tiles 128x128x64x4 128x256x64x4  # the grouped products alone, per kernel config

Every row records ``compile_time_model``: XLA's FLOPs, bytes and memory for the compiled
executable and its Mosaic kernels, the compiler's figures, not a timing.

The code lives in :mod:`lab.benchmarks.grouped_ffn` (so tests can run it); options:
``python -m experiments.bench_grouped --help``.
"""

from __future__ import annotations

import sys

from lab.benchmarks import grouped_ffn as benchmark


def main(argv: list[str] | None = None) -> int:
    result = benchmark.main(argv)
    failed = [row for row in result["rows"] if "error" in row]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
