"""Grouped (ragged) matmul for Hopper with two consumer warpgroups per program (Pallas Mosaic GPU).

``grouped_matmul_2wg(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`` (``rhs [G, N, K]``
with ``transpose_rhs=True``, the input gradient's product): rows of ``lhs`` are sorted by group
and group ``g``'s rows are multiplied by ``rhs[g]``. Rows past ``sum(group_sizes)`` are never
written (the caller, :func:`sparsemixer_jax.kernels.mosaic_grouped_matmul.grouped_matmul`,
zeroes them). Operands share one 16-bit dtype; accumulation is float32; the output is in the
operand dtype.

Why two warpgroups. JAX's ``ragged_dot_mgpu`` runs one consumer warpgroup on a 128 x 128 output
tile: per 64-wide step of the contraction it loads (128 + 128) x 64 operand elements into shared
memory for 128 x 128 x 64 multiply-adds, 64 FLOP per byte of shared memory. A 128 x 256 (or
256 x 128) tile gives 85 FLOP per byte, but its float32 accumulator is 256 registers per thread
in one warpgroup, more than a thread has. Here each program (one per SM, a persistent grid)
runs three warpgroups: a memory warpgroup that issues the TMA loads of a multi-stage pipeline,
and two consumer warpgroups that each own half of the output tile (:func:`warpgroup_tile`: the
longer side halved) and read the same shared operand tiles. Each consumer waits for its product
of a step before that step's buffers are released; meanwhile the other consumer's product keeps
the tensor cores busy. While the consumers write one tile's output, the memory warpgroup already
loads the next tile's operands (the pipeline's buffers are allocated once, outside the tile
loop, and the output has its own buffer).

Group boundaries. Row tiles are ``block_m`` rows of ``lhs``; a tile that holds rows of several
groups is computed once per group it holds (each time with that group's ``rhs``), and each of
those computations stores only its group's rows. The tile loop enumerates exactly the
(group, row tile) pairs that hold rows (at most ``M / block_m + G - 1``; empty groups hold
none); the loop's static bound is that maximum and iterations past the actual count skip.
A TMA store has a static shape while a group's row count in a tile is only known at run time,
so the rows are stored as a run of power-of-two-high slices (the binary digits of the count).

Selected by ``GroupedMatmulConfig(warpgroups=2)``. Tiles for an H100 or H200: 128 x 256 x 64
or 256 x 128 x 64 with up to 4 pipeline stages (229,440 bytes of shared memory at 4). Tested in
JAX's Mosaic GPU interpreter against ``jax.lax.ragged_dot`` and lowered deviceless for an H100
(tests/test_grouped_matmul_2wg.py); not yet timed on a GPU. To time it against JAX's
one-warpgroup kernel at the language model's expert products (docs/benchmarks.md)::

    python -m experiments.bench_grouped --products --experts 8 --tokens 65536 \
        --widths 2048x4096 2048x2048 4096x2048 --warpgroups 1 2 \
        --tiles 128x128x64x4 128x256x64x4 256x128x64x4 128x256x64x3 256x128x64x3
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Columns of output each consumer warpgroup stages in shared memory per TMA store: 64 16-bit
# values are 128 bytes, the widest swizzle. The output is written in such column slices (one
# buffer per warpgroup, reused) so that the operand pipeline keeps its stages.
EPILOGUE_COLUMNS = 64
WGMMA_ROWS = 64  # a wgmma accumulator's rows are a multiple of 64
# Registers the memory warpgroup keeps (it only issues TMA copies); the consumers get the rest.
_MEMORY_REGISTERS = 40


def warpgroup_tile(block_m: int, block_n: int) -> tuple[int, int]:
    """``(rows, columns)`` of the output that one of the two consumer warpgroups accumulates:
    the program's tile halved along its longer side, along N when square or when halving the
    rows would leave fewer than the 64 a wgmma accumulator needs."""
    if block_m > block_n and block_m >= 2 * WGMMA_ROWS:
        return block_m // 2, block_n
    return block_m, block_n // 2


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory of one program, a bound: ``stages`` buffered ``[block_m, block_k]`` and
    ``[block_k, block_n]`` operand tiles with a full and an empty barrier each, and each consumer
    warpgroup's ``[rows, EPILOGUE_COLUMNS]`` output buffer."""
    rows, columns = warpgroup_tile(block_m, block_n)
    pipeline = stages * ((block_m + block_n) * block_k * itemsize + 16)
    return pipeline + 2 * rows * min(columns, EPILOGUE_COLUMNS) * itemsize


def _tile_of_loop_step(group_sizes, step, block_m: int):
    """The (group, row tile) pair of loop step ``step`` (int32 scalars), in group order.

    Group ``g`` spans rows ``[start, end)`` and holds the row tiles ``start // block_m`` through
    ``(end - 1) // block_m`` (none when empty). Returns ``(holds_rows, group, row_tile,
    first_row, end_row)``: whether ``step`` is below the number of pairs, then the pair's group,
    row tile, and the group's rows in that tile as ``[first_row, end_row)`` counted from the
    tile's first row. There are few groups, so the scan over them is unrolled, with selects
    instead of an early exit.
    """
    zero = jnp.int32(0)
    start = pairs_before = group = row_tile = group_start = group_end = zero
    for g in range(group_sizes.shape[0]):
        size = group_sizes[g]
        end = start + size
        first_tile = lax.div(start, jnp.int32(block_m))
        # (end - 1) // block_m for a nonempty group; the select keeps empty ones at zero tiles.
        tiles = lax.select(size > 0, lax.div(end - 1, jnp.int32(block_m)) - first_tile + 1, zero)
        mine = (pairs_before <= step) & (step < pairs_before + tiles)
        group = lax.select(mine, jnp.int32(g), group)
        row_tile = lax.select(mine, first_tile + step - pairs_before, row_tile)
        group_start = lax.select(mine, start, group_start)
        group_end = lax.select(mine, end, group_end)
        start, pairs_before = end, pairs_before + tiles
    tile_start = row_tile * block_m
    first_row = jnp.maximum(group_start, tile_start) - tile_start
    end_row = jnp.minimum(group_end, tile_start + block_m) - tile_start
    return step < pairs_before, group, row_tile, first_row, end_row


def _store_rows(out_smem, out_gmem, first: jax.Array, count: jax.Array, height: int) -> None:
    """TMA-stores rows ``[first, first + count)`` of ``out_smem`` to the same rows of
    ``out_gmem`` (``count <= height``, a power of two). A TMA store's shape is static, so there
    is one store per binary digit of ``count``, highest first."""
    offset = first
    rows = height
    while rows >= 1:
        @pl.when(count & rows != 0)
        def _(rows=rows, offset=offset):
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, rows)],
                                    out_gmem.at[pl.ds(offset, rows)])

        offset = offset + (count & rows)
        rows //= 2


def grouped_matmul_2wg(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int,
                       block_n: int, block_k: int, max_concurrent_steps: int,
                       grid_block_n: int = 1, transpose_rhs: bool = False,
                       num_programs: int = 132) -> jax.Array:
    """``[M, N]`` with the rows of group ``g`` equal to ``lhs_g @ rhs[g]`` (``rhs[g]^T`` with
    ``transpose_rhs``); rows past the groups unwritten.

    Args:
      lhs: ``[M, K]``, ``M`` a multiple of ``block_m``, ``K`` of ``block_k``.
      rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs``; ``N`` a multiple of
        ``block_n``; the dtype of ``lhs`` (16-bit).
      group_sizes: int32 ``[G]``, ``sum <= M``.
      block_m, block_n, block_k: the program's output tile and contraction step; the two
        consumer warpgroups split the output tile (:func:`warpgroup_tile`).
      max_concurrent_steps: operand pipeline stages.
      grid_block_n: width, in column tiles, of the bands the tile order snakes through.
      num_programs: programs of the persistent grid (one per SM: 132 on an H100 SXM5 or H200).
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if lhs.dtype != rhs.dtype or rhs.shape[2 if transpose_rhs else 1] != k:
        raise ValueError(f"grouped_matmul_2wg: lhs {lhs.shape} {lhs.dtype} does not match rhs "
                         f"{rhs.shape} {rhs.dtype} (transpose_rhs={transpose_rhs})")
    if m % block_m or n % block_n or k % block_k:
        raise ValueError(f"grouped_matmul_2wg: M={m}, N={n}, K={k} must be multiples of "
                         f"block_m={block_m}, block_n={block_n}, block_k={block_k}")
    wg_rows, wg_columns = warpgroup_tile(block_m, block_n)
    split_rows = wg_rows < block_m
    epilogue_columns = min(wg_columns, EPILOGUE_COLUMNS)
    # Static bound of the (group, row tile) pairs: each group boundary inside a tile adds one.
    row_tiles = m // block_m + num_groups - 1
    column_tiles = n // block_n

    def kernel(sizes_gmem, lhs_gmem, rhs_gmem, out_gmem, out_smem):
        def pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k // block_k,),
                memory_registers=_MEMORY_REGISTERS,
                in_specs=[
                    plgpu.BlockSpec((block_m, block_k), lambda kk: (0, kk)),
                    plgpu.BlockSpec((block_n, block_k), lambda kk: (0, kk)) if transpose_rhs
                    else plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, 0)),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=max_concurrent_steps,
                compute_context=compute_context,
            )

        # The operand buffers are allocated once for every tile, so the memory warpgroup can
        # start the next tile's loads while the consumers still store this one's output.
        unused = lambda *args, **kwargs: None  # the allocations depend on the specs only
        lhs_tile_shape = lhs_gmem.at[pl.ds(0, block_m)]
        rhs_tile_shape = (rhs_gmem.at[0].at[pl.ds(0, block_n)] if transpose_rhs
                          else rhs_gmem.at[0].at[:, pl.ds(0, block_n)])

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(unused, unused).get_allocations(lhs_tile_shape, rhs_tile_shape),
            collective_axes="wg")
        def _(allocations):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((row_tiles * column_tiles,), collective_axes="sm")
            def _(loop_info: plgpu.NDLoopInfo):
                tile_m, tile_n = plgpu.planar_snake(
                    loop_info.index[0], (row_tiles, column_tiles), 1, grid_block_n)
                holds_rows, group, row_tile, first_row, end_row = _tile_of_loop_step(
                    sizes_gmem, tile_m, block_m)
                # This warpgroup's part of the tile: rows [row0, row0 + wg_rows) and columns
                # [column0, column0 + wg_columns) of the program's block_m x block_n tile.
                row0 = wg * wg_rows if split_rows else 0
                column0 = 0 if split_rows else wg * wg_columns

                def multiply(_, lhs_smem, rhs_smem, acc):
                    lhs_part = lhs_smem.at[pl.ds(row0, wg_rows)]
                    if transpose_rhs:  # wgmma reads 16-bit operands transposed in place
                        rhs_part = rhs_smem.at[pl.ds(column0, wg_columns)].T
                    else:
                        rhs_part = rhs_smem.at[:, pl.ds(column0, wg_columns)]
                    plgpu.wgmma(acc, lhs_part, rhs_part)
                    # The step's buffers are released when the body returns, so its product
                    # must be done. The tensor cores stay busy all the same: while one
                    # warpgroup waits, the other's product runs. (Keeping one product in flight,
                    # delay_release=1, would leave the last step's buffers unreleased when the
                    # pipeline ends, and the next tile's first loads would overwrite them while
                    # they are read: the interpreter reports that as a barrier-phase error.)
                    plgpu.wgmma_wait(0)
                    return acc

                def store(run_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((wg_rows, wg_columns), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        result = acc[...].astype(out_gmem.dtype)
                        # The group's rows in this warpgroup's part, counted from its row0.
                        first = jnp.clip(first_row - row0, 0, wg_rows)
                        count = jnp.clip(end_row - row0, 0, wg_rows) - first
                        out_rows = out_gmem.at[pl.ds(row_tile * block_m + row0, wg_rows)]
                        for c in range(0, wg_columns, epilogue_columns):
                            # The buffer is reused: the previous slice's stores must have read it.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            out_smem[wg] = result[:, c:c + epilogue_columns]
                            plgpu.commit_smem()
                            columns = pl.ds(tile_n * block_n + column0 + c, epilogue_columns)
                            _store_rows(out_smem.at[wg], out_rows.at[:, columns], first, count,
                                        wg_rows)

                # Pairs past the actual count (the bound counts a boundary per group) skip.
                @pl.when(holds_rows)
                def _():
                    lhs_tile = lhs_gmem.at[pl.ds(row_tile * block_m, block_m)]
                    rhs_group = rhs_gmem.at[group]
                    rhs_tile = (rhs_group.at[pl.ds(tile_n * block_n, block_n)] if transpose_rhs
                                else rhs_group.at[:, pl.ds(tile_n * block_n, block_n)])
                    pipeline(multiply, store)(lhs_tile, rhs_tile, allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        scratch_types=dict(out_smem=plgpu.SMEM((2, wg_rows, epilogue_columns), lhs.dtype)),
        grid=(num_programs,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return call(group_sizes, lhs, rhs)
