"""The two-warpgroup grouped matmul (sparsemixer_jax.kernels.grouped_matmul_2wg).

Its three products (forward, input gradient with ``transpose_rhs``, weight gradient) run in
JAX's Mosaic GPU interpreter on CPU through ``GroupedMatmulConfig(warpgroups=2)`` and are
checked against ``jax.lax.ragged_dot`` and its VJP; the kernels are lowered for a compile-only
H100 (skipped without the CUDA PJRT plugin) at the tiles they are meant for, and the config
refuses what that lowering refuses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax.kernels import GroupedMatmulConfig, grouped_matmul, mosaic_matmul
from sparsemixer_jax.kernels import grouped_matmul_2wg as kernel
from tests import kit
from tests.test_grouped_ffn import needs_cpu_backend

# 200 rows (not a multiple of the 128-row tiles: padded), a contraction of two 64-wide steps.
ROWS, K, N, GROUPS = 200, 128, 128, 4


def _config(block_m: int, block_n: int) -> GroupedMatmulConfig:
    # num_sms=4: each interpreted program loops over several tiles (the interpreter runs every
    # program; 132 would be slow).
    return GroupedMatmulConfig(interpret=True, warpgroups=2, block_m=block_m, block_n=block_n,
                               block_k=64, max_concurrent_steps=2, num_sms=4,
                               weight_grad="kernel")


@functools.cache
def _kernel_value_and_vjp(block_m: int, block_n: int):
    config = _config(block_m, block_n)

    @jax.jit
    def fn(lhs, rhs, sizes, cotangent):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, config), lhs, rhs)
        return out, vjp(cotangent)

    return fn


@jax.jit
def _ragged_dot_value_and_vjp(lhs, rhs, sizes, cotangent):
    out, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    return out, vjp(cotangent)


def test_warpgroups_split_the_longer_side_of_the_tile():
    assert kernel.warpgroup_tile(256, 128) == (128, 128)
    assert kernel.warpgroup_tile(128, 256) == (128, 128)
    assert kernel.warpgroup_tile(128, 128) == (128, 64)
    assert kernel.warpgroup_tile(64, 32) == (64, 16)  # 32 rows would be below wgmma's 64


@needs_cpu_backend
@pytest.mark.parametrize("tile", [(128, 64), (64, 128)], ids=["rows_split", "columns_split"])
@pytest.mark.parametrize("sizes", [(70, 0, 120, 0), (64, 1, 127, 0)])
def test_three_products_match_ragged_dot_and_its_vjp(tile, sizes):
    # (70, 0, 120, 0): a boundary inside the first row tile (in the second warpgroup's half
    # when the rows are split), empty groups, 10 rows past the groups. (64, 1, 127, 0): a
    # boundary on the warpgroups' split, a one-row group (both edges of the weight gradient's
    # 64-row step masked at once), 8 rows past the groups. The rows past the groups hold NaN in
    # lhs and the cotangent: they must come out as zeros, nothing leaks. The weight gradient's
    # tiles: [128, 64] split by rows, [64, 128] by columns, as the forward's.
    k = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(k[0], (ROWS, K), jnp.bfloat16)
    rhs = jax.random.normal(k[1], (GROUPS, K, N), jnp.bfloat16)
    cotangent = jax.random.normal(k[2], (ROWS, N), jnp.bfloat16)
    sizes = jnp.array(sizes, jnp.int32)
    used = (np.arange(ROWS) < int(sizes.sum()))[:, None]
    out, (dlhs, drhs) = _kernel_value_and_vjp(*tile)(
        jnp.where(used, lhs, jnp.nan), rhs, sizes, jnp.where(used, cotangent, jnp.nan))
    # The reference: float32 products of the same bfloat16 values.
    f32 = [a.astype(jnp.float32) for a in (lhs, rhs, cotangent)]
    want, (want_dlhs, want_drhs) = _ragged_dot_value_and_vjp(
        jnp.where(used, f32[0], 0), f32[1], sizes, jnp.where(used, f32[2], 0))
    assert out.dtype == dlhs.dtype == drhs.dtype == jnp.bfloat16
    assert np.all(np.asarray(drhs)[np.asarray(sizes) == 0] == 0)  # empty groups: zero gradient
    for got, expected in ((out, want), (dlhs, want_dlhs), (drhs, want_drhs)):
        got, expected = np.asarray(got, np.float32), np.asarray(expected)
        if got.shape[0] == ROWS:
            assert np.all(got[~used[:, 0]] == 0)
        # The kernels accumulate in float32 (the same products, another summation order: error
        # ~ K * 2^-24 relative) and rounds once to bfloat16 (at most 2^-9 of the magnitude).
        # 2^-8 of the largest magnitude bounds both (the contraction: K or the group's rows).
        assert np.max(np.abs(got - expected)) <= 2.0 ** -8 * np.abs(expected).max()


def _lowering_error(product, transpose_rhs: bool) -> str | None:
    """None if ``product(lhs, rhs, group_sizes, transpose_rhs=...)`` lowers for a compile-only
    H100, else the first line of its error. Widths of 512, a contraction of 1024: every pipeline
    stage is used."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(kit.target_devices_or_skip("h100:1x1")[1], ("x",))
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))
    rhs = (GROUPS, 512, 1024) if transpose_rhs else (GROUPS, 1024, 512)
    try:
        with jax.set_mesh(mesh):
            text = jax.jit(functools.partial(product, transpose_rhs=transpose_rhs)).lower(
                spec((1024, 1024), jnp.bfloat16), spec(rhs, jnp.bfloat16),
                spec((GROUPS,), jnp.int32)).as_text()
    except Exception as err:  # lowering raises ValueError, AssertionError, VerificationError
        return f"{type(err).__name__}: {(str(err).strip() or '-').splitlines()[0]}"
    assert text.count("custom_call @mosaic_gpu") == 1
    return None


def _tiles(block_m, block_n, block_k, stages):
    return dict(block_m=block_m, block_n=block_n, block_k=block_k,
                max_concurrent_steps=stages)


@pytest.mark.parametrize("tiles", [
    _tiles(128, 256, 64, 4),
    _tiles(256, 128, 64, 4),
    pytest.param(_tiles(128, 256, 64, 2), marks=pytest.mark.slow),
    pytest.param(_tiles(128, 256, 64, 3), marks=pytest.mark.slow),
    pytest.param(_tiles(256, 128, 64, 2), marks=pytest.mark.slow),
    pytest.param(_tiles(256, 128, 64, 3), marks=pytest.mark.slow),
])
def test_lowers_for_an_h100_at_the_tiles_it_is_for(tiles):
    # The value and both gradients of grouped_matmul: its three products, each our kernel,
    # lowered for a compile-only H100 (lhs [1024, 1024], rhs [4, 1024, 512]).
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(kit.target_devices_or_skip("h100:1x1")[1], ("x",))
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))
    config = GroupedMatmulConfig(warpgroups=2, weight_grad="kernel", **tiles)

    def loss(lhs, rhs, sizes):
        return jnp.sum(grouped_matmul(lhs, rhs, sizes, config).astype(jnp.float32))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
            spec((1024, 1024), jnp.bfloat16), spec((GROUPS, 1024, 512), jnp.bfloat16),
            spec((GROUPS,), jnp.int32)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("tiles,message", [
    # 5 x ((128 + 256) x 64 x 2 + 16) + 2 x 128 x 64 x 2: Mosaic GPU counts the same bytes.
    (_tiles(128, 256, 64, 5), "278,608 bytes of shared memory > 232,448"),
    (_tiles(64, 16, 16, 2), "leaves each warpgroup 8 columns < 16"),
])
def test_config_refuses_what_an_h100_lowering_refuses(tiles, message):
    with pytest.raises(ValueError, match=message) as err:
        GroupedMatmulConfig(warpgroups=2, weight_grad="xla", **tiles)
    assert "\n" not in str(err.value)
    # The same tiles given to the kernel itself, past the config's check, fail to lower.
    error = _lowering_error(functools.partial(kernel.grouped_matmul_2wg, **tiles), False)
    assert error is not None


def test_config_refuses_an_accumulator_larger_than_a_threads_registers():
    # Not a lowering error (an H100 lowering accepts 256 x 256): the accumulator alone would
    # need more registers than a thread has, so it would live in local memory.
    with pytest.raises(ValueError, match=r"256x128 float32 accumulator needs 256 registers"):
        GroupedMatmulConfig(warpgroups=2, block_m=256, block_n=256, max_concurrent_steps=2,
                            weight_grad="xla")
    GroupedMatmulConfig(warpgroups=2, block_m=256, block_n=128, weight_grad="xla")
    with pytest.raises(ValueError, match="warpgroups must be 1 or 2, got 4"):
        GroupedMatmulConfig(warpgroups=4)


@needs_cpu_backend
def test_one_step_pipelines_in_a_row():
    # K = 64: each tile's pipeline is one step, fewer than its 2 stages, and each of the 4
    # programs runs 3 of the 12 tiles in a row on the same buffers: the barriers must end every
    # tile's pipeline where the next one starts (the interpreter checks their phases; keeping
    # one product in flight, delay_release=1, fails here).
    config = _config(64, 64)
    k = jax.random.split(jax.random.key(6), 2)
    lhs = jax.random.normal(k[0], (256, 64), jnp.bfloat16)
    rhs = jax.random.normal(k[1], (3, 64, N), jnp.bfloat16)
    sizes = jnp.array((85, 85, 86), jnp.int32)
    got = np.asarray(jax.jit(lambda a, b, s: mosaic_matmul(a, b, s, config))(lhs, rhs, sizes),
                     np.float32)
    want = np.asarray(jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                                         sizes))
    # One bfloat16 rounding after float32 accumulation (as above).
    assert np.max(np.abs(got - want)) <= 2.0 ** -8 * np.abs(want).max()


@pytest.mark.slow  # the benchmark's path through the interpreter: 16 s on 2 cores
@needs_cpu_backend
def test_products_benchmark_runs_tiny_in_interpret_mode(tmp_path):
    # The command a GPU session runs at the language model's shapes, here on a CPU: both
    # kernels, both products, a refused config recorded as such, the JSON written.
    from lab.benchmarks import grouped_ffn as benchmark

    out = tmp_path / "products.json"
    result = benchmark.main(["--products", "--interpret", "--tiny", "--experts", "3",
                             "--widths", "64x128", "--warpgroups", "1", "2", "--tiles",
                             "64x64x64x2", "64x64x64x1", "--num-sms", "4", "--json", str(out)])
    rows = result["rows"]
    assert [(r["product"], r["warpgroups"], r["max_concurrent_steps"]) for r in rows] == [
        (p, wg, s) for p in ("forward", "input_grad", "weight_grad") for wg in (1, 2)
        for s in (2, 1)]
    for row in rows:
        if row["max_concurrent_steps"] == 1:
            assert row["error"].startswith("GroupedMatmulConfig: max_concurrent_steps=1")
        else:
            assert row["ms"] > 0 and row["tflops"] > 0, row
    assert out.exists()
    with pytest.raises(ValueError, match=r"--tiles '128x128': expected 4 positive integers"):
        benchmark.main(["--products", "--experts", "8", "--tiles", "128x128"])


def test_grouped_ffn_takes_two_warpgroups():
    # The expert FFN's grouped dispatch passes warpgroups through to its config (a tile only
    # two warpgroups refuse is refused), and lowered for a compile-only H100 its two layers'
    # three products each run on a Mosaic kernel.
    from jax.sharding import NamedSharding, PartitionSpec

    from sparsemixer_jax.moe.dispatch import ExpertRows, grouped_ffn

    mesh = jax.sharding.Mesh(kit.target_devices_or_skip("h100:1x1")[1], ("x",))
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))

    def loss(x, group, wi, bi, wo, bo, tile=128):
        y = grouped_ffn(ExpertRows(x, group, jnp.arange(x.shape[0]), wi, bi, wo, bo),
                        warpgroups=2, block_m=tile, block_n=tile, max_concurrent_steps=2)
        # Squared: the gradient of a plain sum would not need the second layer's output.
        return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32)))

    args = [spec((256, 128), jnp.bfloat16), spec((256,), jnp.int32)] + [
        spec(s, jnp.bfloat16) for s in [(4, 128, 256), (4, 256), (4, 256, 128), (4, 128)]]
    text = jax.jit(jax.grad(loss, argnums=(0, 2, 4))).lower(*args).as_text()
    assert text.count("custom_call @mosaic_gpu") == 6
    with pytest.raises(ValueError, match="warpgroups=2: each warpgroup's 256x128"):
        jax.eval_shape(functools.partial(loss, tile=256), *args)


def test_the_mosaic_2wg_impl_runs_the_two_warpgroup_kernels_on_128x256_tiles(monkeypatch):
    # model.grouped_impl="mosaic_2wg" reaches grouped_ffn as the Mosaic impl with two
    # warpgroups and 256-wide output tiles; "mosaic" as JAX's one-warpgroup kernels.
    from sparsemixer_jax.moe import dispatch

    seen = []
    monkeypatch.setattr(dispatch, "grouped_ffn",
                        lambda rows, **kwargs: seen.append(kwargs) or rows.x)
    x, group = jnp.ones((4, 8), jnp.bfloat16), jnp.zeros((4,), jnp.int32)
    params = (jnp.ones((2, 8, 16), jnp.bfloat16), jnp.ones((2, 16), jnp.bfloat16),
              jnp.ones((2, 16, 8), jnp.bfloat16), jnp.ones((2, 8), jnp.bfloat16))
    for impl in ("mosaic_2wg", "mosaic"):
        dispatch.expert_ffn(x, group, jnp.arange(4), params, dispatch="grouped",
                            grouped_impl=impl)
    assert {k: seen[0].get(k) for k in ("impl", "warpgroups", "block_n")} == {
        "impl": "mosaic", "warpgroups": 2, "block_n": 256}
    assert seen[1]["impl"] == "mosaic" and "warpgroups" not in seen[1]
