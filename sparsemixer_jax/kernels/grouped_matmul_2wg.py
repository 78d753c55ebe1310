"""Grouped (ragged) matmul for Hopper with two consumer warpgroups per program (Pallas Mosaic GPU).

``grouped_matmul_2wg(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`` (``rhs [G, N, K]``
with ``transpose_rhs=True``, the input gradient's product): rows of ``lhs`` are sorted by group
and group ``g``'s rows are multiplied by ``rhs[g]``. Rows past ``sum(group_sizes)`` are never
written (the caller, :func:`sparsemixer_jax.kernels.mosaic_grouped_matmul.grouped_matmul`,
zeroes them). ``grouped_weight_grad_2wg(lhs [M, K], dout [M, N], group_sizes) -> [G, K, N]``
is the weight gradient, ``lhs_g^T @ dout_g`` per group. Operands share one 16-bit dtype;
accumulation is float32; the output is in the operand dtype.

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

Selected by ``GroupedMatmulConfig(warpgroups=2)`` for all three products. Tiles for an H100 or
H200: 128 x 256 x 64 or 256 x 128 x 64 with up to 4 pipeline stages (229,440 bytes of shared
memory at 4). Tested in JAX's Mosaic GPU interpreter against ``jax.lax.ragged_dot`` and its VJP
and lowered deviceless for an H100 (tests/test_grouped_matmul_2wg.py); not yet timed on a GPU.
To time them against JAX's one-warpgroup kernels at the language model's expert products
(docs/benchmarks.md)::

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


def _pipeline(body, compute_context, in_specs, steps, stages: int):
    """The operand pipeline shared by both consumer warpgroups: the memory warpgroup (the last
    of the three) loads ``steps`` operand tiles through ``stages`` buffers."""
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=_MEMORY_REGISTERS, in_specs=in_specs,
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
        compute_context=compute_context)


def _multiply(acc, lhs, rhs):
    """``acc += lhs @ rhs`` on the tensor cores, finished before the step's buffers are released.

    The step's buffers are released when the pipeline body returns, so its product must be done.
    The tensor cores stay busy all the same: while one warpgroup waits, the other's product
    runs. (Keeping one product in flight, delay_release=1, would leave the last step's buffers
    unreleased when the pipeline ends, and the next tile's first loads would overwrite them while
    they are read: the interpreter reports that as a barrier-phase error.)
    """
    plgpu.wgmma(acc, lhs, rhs)
    plgpu.wgmma_wait(0)
    return acc


def _write_output(result: jax.Array, out_smem, out_ref, store) -> None:
    """Writes ``result [rows, columns]`` (registers) to ``out_ref`` through this warpgroup's
    ``out_smem [rows, c]`` buffer, ``c`` columns at a time; ``store(smem, gmem)`` issues the TMA
    stores of one slice."""
    width = out_smem.shape[1]
    for c in range(0, result.shape[1], width):
        # The buffer is reused: the previous slice's stores must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[...] = result[:, c:c + width]
        plgpu.commit_smem()
        store(out_smem, out_ref.at[:, pl.ds(c, width)])


def _launch(kernel, out_type, wg_rows: int, wg_columns: int, num_programs: int, *args):
    """Runs ``kernel(*args, out, out_smem)`` on a persistent grid of ``num_programs`` programs of
    three warpgroups (two consumers, then the memory one); ``out_smem [2, wg_rows, c]`` holds
    each consumer's output slice."""
    columns = min(wg_columns, EPILOGUE_COLUMNS)
    call = plgpu.kernel(
        kernel, out_type=out_type,
        scratch_types=dict(out_smem=plgpu.SMEM((2, wg_rows, columns), out_type.dtype)),
        grid=(num_programs,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return call(*args)


def _warpgroup_parts(name: str, sizes: dict[str, int], tiles: dict[str, int], block_m: int,
                     block_n: int) -> tuple[int, int, bool]:
    """``(rows, columns, split_rows)`` of each consumer's part of a ``block_m x block_n`` tile,
    once each of ``sizes`` is checked to be a multiple of its tile in ``tiles``."""
    for (what, size), (tile, block) in zip(sizes.items(), tiles.items(), strict=True):
        if size % block:
            raise ValueError(f"{name}: {what}={size} must be a multiple of {tile}={block}")
    rows, columns = warpgroup_tile(block_m, block_n)
    return rows, columns, rows < block_m


def grouped_matmul_2wg(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int,
                       block_n: int, block_k: int, max_concurrent_steps: int,
                       grid_block_n: int = 1, transpose_rhs: bool = False,
                       num_programs: int = 132) -> jax.Array:
    """``[M, N]`` with the rows of group ``g`` equal to ``lhs_g @ rhs[g]`` (``rhs[g]^T`` with
    ``transpose_rhs``); rows past the groups unwritten.

    Long because the kernel is written inside it: its nested functions (the buffers' scope,
    the tile loop, the pipeline's step and epilogue) close over the static shapes and tiles,
    and each is a scope of the kernel (allocation, loop, warpgroup-specialized code).

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
    wg_rows, wg_columns, split_rows = _warpgroup_parts(
        "grouped_matmul_2wg", dict(M=m, N=n, K=k),
        dict(block_m=block_m, block_n=block_n, block_k=block_k), block_m, block_n)
    # Static bound of the (group, row tile) pairs: each group boundary inside a tile adds one.
    row_tiles = m // block_m + num_groups - 1
    column_tiles = n // block_n
    in_specs = [
        plgpu.BlockSpec((block_m, block_k), lambda kk: (0, kk)),
        plgpu.BlockSpec((block_n, block_k), lambda kk: (0, kk)) if transpose_rhs
        else plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, 0)),
    ]

    def rhs_tile(rhs_group, tile_n):
        columns = pl.ds(tile_n * block_n, block_n)
        return rhs_group.at[columns] if transpose_rhs else rhs_group.at[:, columns]

    def kernel(sizes_gmem, lhs_gmem, rhs_gmem, out_gmem, out_smem):
        # The operand buffers are allocated once for every tile, so the memory warpgroup can
        # start the next tile's loads while the consumers still store this one's output.
        unused = lambda *args, **kwargs: None  # the allocations depend on the specs only
        buffers = _pipeline(unused, unused, in_specs, k // block_k, max_concurrent_steps)

        @functools.partial(
            pl.run_scoped, collective_axes="wg", allocations=buffers.get_allocations(
                lhs_gmem.at[pl.ds(0, block_m)], rhs_tile(rhs_gmem.at[0], 0)))
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
                    return _multiply(acc, lhs_part, rhs_part)

                def store(run_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((wg_rows, wg_columns), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        # The group's rows in this warpgroup's part, counted from its row0.
                        first = jnp.clip(first_row - row0, 0, wg_rows)
                        count = jnp.clip(end_row - row0, 0, wg_rows) - first
                        out = out_gmem.at[pl.ds(row_tile * block_m + row0, wg_rows),
                                          pl.ds(tile_n * block_n + column0, wg_columns)]
                        _write_output(acc[...].astype(out_gmem.dtype), out_smem.at[wg], out,
                                      lambda smem, gmem: _store_rows(smem, gmem, first, count,
                                                                     wg_rows))

                # Pairs past the actual count (the bound counts a boundary per group) skip.
                @pl.when(holds_rows)
                def _():
                    _pipeline(multiply, store, in_specs, k // block_k, max_concurrent_steps)(
                        lhs_gmem.at[pl.ds(row_tile * block_m, block_m)],
                        rhs_tile(rhs_gmem.at[group], tile_n), allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(kernel, jax.ShapeDtypeStruct((m, n), lhs.dtype), wg_rows, wg_columns,
                   num_programs, group_sizes, lhs, rhs)


def grouped_weight_grad_2wg(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *,
                            block_m: int, block_n: int, block_k: int,
                            max_concurrent_steps: int, grid_block_n: int = 1,
                            num_programs: int = 132) -> jax.Array:
    """``[G, K, N]`` with ``[g] = lhs_g^T @ dout_g`` over the rows of group ``g`` (the weight
    gradient of :func:`grouped_matmul_2wg`'s forward product); empty groups: zeros.

    Long for the reason :func:`grouped_matmul_2wg` is: the kernel is written inside it.

    Args:
      lhs: ``[M, K]``, ``M`` a multiple of ``block_k``, ``K`` of ``block_m``; rows past the
        groups finite (zero: they are masked by multiplying with 0).
      dout: ``[M, N]``, ``N`` a multiple of ``block_n``, as ``lhs``'s dtype and rows.
      group_sizes: int32 ``[G]``, ``sum <= M``.
      block_m, block_n: the output tile ``[block_m, block_n]`` of ``[K, N]``, split between the
        consumer warpgroups (:func:`warpgroup_tile`); block_k: rows per step, a multiple of 64.
      max_concurrent_steps, grid_block_n, num_programs: as :func:`grouped_matmul_2wg`.

    Each output tile of each group contracts over the group's row tiles of ``block_k`` rows;
    the first and the last may hold rows of the neighbouring groups, which each consumer zeroes
    in shared memory, in its own part of the operand that the two split: its columns of
    ``lhs`` when they split the output's rows, of ``dout`` when they split its columns (the
    other operand is read by both, and a zero row of one operand is enough).
    """
    m, k = lhs.shape
    n = dout.shape[1]
    num_groups = group_sizes.shape[0]
    if lhs.dtype != dout.dtype or dout.shape[0] != m:
        raise ValueError(f"grouped_weight_grad_2wg: lhs {lhs.shape} {lhs.dtype} does not match "
                         f"dout {dout.shape} {dout.dtype}")
    wg_rows, wg_columns, split_rows = _warpgroup_parts(
        "grouped_weight_grad_2wg", dict(M=m, K=k, N=n),
        dict(block_k=block_k, block_m=block_m, block_n=block_n), block_m, block_n)
    row_tiles, column_tiles = k // block_m, n // block_n

    def kernel(sizes_gmem, lhs_gmem, dout_gmem, out_gmem, out_smem):
        def specs(first_block):
            return [plgpu.BlockSpec((block_k, block_m), lambda kk: (first_block + kk, 0)),
                    plgpu.BlockSpec((block_k, block_n), lambda kk: (first_block + kk, 0))]

        unused = lambda *args, **kwargs: None  # the allocations depend on the specs only
        # A static grid of max_concurrent_steps: every buffer the dynamic grids below use.
        buffers = _pipeline(unused, unused, specs(0), max_concurrent_steps, max_concurrent_steps)

        @functools.partial(
            pl.run_scoped, collective_axes="wg", allocations=buffers.get_allocations(
                lhs_gmem.at[:, pl.ds(0, block_m)], dout_gmem.at[:, pl.ds(0, block_n)]))
        def _(allocations):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((num_groups, row_tiles * column_tiles), collective_axes="sm")
            def _(loop_info: plgpu.NDLoopInfo):
                group = loop_info.index[0]
                tile_m, tile_n = plgpu.planar_snake(
                    loop_info.index[1], (row_tiles, column_tiles), 1, grid_block_n)
                start = sum(lax.select(g < group, sizes_gmem[g], jnp.int32(0))
                            for g in range(num_groups))
                size = sizes_gmem[group]
                first_block = lax.div(start, jnp.int32(block_k))
                last_block = lax.div(start + size - 1, jnp.int32(block_k))
                steps = lax.select(size > 0, last_block - first_block + 1, jnp.int32(0))
                row0 = wg * wg_rows if split_rows else 0
                column0 = 0 if split_rows else wg * wg_columns

                def multiply(index, lhs_smem, dout_smem, acc):
                    step = index[0]
                    lhs_part = lhs_smem.at[:, pl.ds(row0, wg_rows)]
                    dout_part = dout_smem.at[:, pl.ds(column0, wg_columns)]
                    masked = lhs_part if split_rows else dout_part

                    @pl.when((step == 0) | (step == steps - 1))
                    def _():
                        # Rows [first, last] of this step are the group's.
                        first = lax.select(step == 0, lax.rem(start, jnp.int32(block_k)),
                                           jnp.int32(0))
                        last = lax.select(step == steps - 1,
                                          lax.rem(start + size - 1, jnp.int32(block_k)),
                                          jnp.int32(block_k - 1))
                        rows = plgpu.layout_cast(
                            lax.broadcasted_iota(jnp.int32, masked.shape, 0), plgpu.Layout.WGMMA)
                        keep = (rows >= first) & (rows <= last)
                        masked[...] = masked[...] * keep.astype(masked.dtype)
                        plgpu.commit_smem()  # wgmma reads shared memory through the async proxy

                    return _multiply(acc, lhs_part.T, dout_part)

                def store(run_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((wg_rows, wg_columns), jnp.float32))
                    def _(acc):
                        run_pipeline(acc)
                        out = out_gmem.at[group, pl.ds(tile_m * block_m + row0, wg_rows),
                                          pl.ds(tile_n * block_n + column0, wg_columns)]
                        _write_output(acc[...].astype(out_gmem.dtype), out_smem.at[wg], out,
                                      plgpu.copy_smem_to_gmem)

                @pl.when(steps > 0)
                def _():
                    _pipeline(multiply, store, specs(first_block), steps, max_concurrent_steps)(
                        lhs_gmem.at[:, pl.ds(tile_m * block_m, block_m)],
                        dout_gmem.at[:, pl.ds(tile_n * block_n, block_n)],
                        allocations=allocations)

                # An empty group's gradient is zero: the consumers store their zero accumulators.
                @pl.when((steps == 0) & (wg < 2))
                def _():
                    store(lambda acc: None)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(kernel, jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype), wg_rows,
                   wg_columns, num_programs, group_sizes, lhs, dout)
