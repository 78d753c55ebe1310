"""Grouped-GEMM expert FFN (sparsemixer_jax.kernels) against the layer's own dispatches.

The Mosaic GPU kernels run in JAX's Mosaic GPU interpreter on CPU (``interpret=True``): the
forward kernel, its ``transpose_rhs`` form (input gradient) and the transposed kernel (weight
gradient) are each checked against ``jax.lax.ragged_dot`` and its VJP, at shapes that cross
tile edges. Where an H100 lowering is available (the CUDA PJRT plugin), the config's tile rules
are checked against what that lowering accepts.

Interpreted kernels are slow (each simulates the kernel's persistent grid, 132 programs for the
forward kernel), so each compiled function below is built once per module and reused.
"""

from __future__ import annotations

import functools
import json
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import moe
from sparsemixer_jax.kernels import (
    GroupedMatmulConfig,
    check_grouped_supported,
    grouped_matmul,
)
from sparsemixer_jax.kernels import mosaic_grouped_matmul as mgm
from sparsemixer_jax.moe.dispatch import ExpertRows, grouped_ffn
from tests import kit


def _has_cpu_backend() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS names no cpu
        return False


# The interpreter runs each kernel in io_callbacks, which place their operands on a CPU device:
# on a GPU host JAX_PLATFORMS must list cpu too (cuda,cpu).
needs_cpu_backend = pytest.mark.skipif(
    not _has_cpu_backend(), reason="the Mosaic GPU interpreter's callbacks need a CPU device: "
    "JAX_PLATFORMS=cuda,cpu")
# Tests that take the CPU host's simulated devices (conftest: 8) as the default ones: on a GPU
# host the GPU is the default backend and the CPU devices are not what jax.devices() lists.
needs_cpu_default = pytest.mark.skipif(
    jax.default_backend() != "cpu" or jax.device_count() < 4,
    reason="needs the CPU as the default backend with its 8 simulated devices (conftest)")

# Widths an H100 lowering accepts for all three kernels (the weight-gradient kernel's tiles are
# >= 64), so weight_grad="auto" picks the kernel, as on a GPU; 200 rows: not a multiple of 64.
EMB, MLP, ROWS, RATE = 64, 128, 200, 0.25
# num_sms=4: the weight-gradient kernel's 4 programs each loop over several tiles.
TILES = dict(block_m=64, block_n=64, block_k=64, num_sms=4)
# Error bounds, as a fraction of the reference's largest magnitude:
# * float32 through the XLA impl: same float32 products, only summation order differs.
# * mosaic casts float32 to bfloat16 operands: bfloat16 rounding of inputs and of the hidden
#   activations (8 mantissa bits, 2^-8 ~ 4e-3 relative per rounding, a few roundings deep).
# * bfloat16 / float16 against _ragged_ffn in the same dtype: both accumulate in float32 and
#   round once per product, but in a different summation order, so results may differ by one
#   or two units in the last place of the compute dtype.
REL_TOL = {"f32_xla": 1e-5, "f32_as_bf16": 3e-2, "bfloat16": 2e-2, "float16": 4e-3}


def _params(key, num_groups, dtype):
    k = jax.random.split(key, 5)
    wi = jax.random.normal(k[0], (num_groups, EMB, MLP)) / np.sqrt(EMB)
    bi = 0.1 * jax.random.normal(k[1], (num_groups, MLP))
    wo = jax.random.normal(k[2], (num_groups, MLP, EMB)) / np.sqrt(MLP)
    bo = 0.1 * jax.random.normal(k[3], (num_groups, EMB))
    x = jax.random.normal(k[4], (ROWS, EMB))
    return tuple(a.astype(dtype) for a in (x, wi, bi, wo, bo))


def _groups(case: str, num_groups: int) -> jax.Array:
    """Row experts crossing tile edges: ``mixed`` has an empty expert and dropped rows."""
    rows = np.arange(ROWS)
    if case == "mixed":
        group = jax.random.randint(jax.random.key(7), (ROWS,), 0, num_groups + 1)
        group = jnp.where(group == 1, 0, group)  # expert 1 gets no row
        return group.at[:3].set(num_groups).astype(jnp.int32)  # and some rows have no expert
    if case == "one_expert":
        return jnp.full((ROWS,), num_groups - 1, jnp.int32)
    if case == "all_dropped":
        return jnp.full((ROWS,), num_groups, jnp.int32)
    if case == "capacity":  # Switch capacity: rows past the capacity arrive without expert
        group = jnp.asarray(rows % num_groups, jnp.int32)
        keep = moe.capacity_keep(group, jnp.ones(ROWS, bool), num_groups, ROWS // num_groups // 2)
        return jnp.where(keep, group, num_groups)
    raise ValueError(case)


def _weights(dtype) -> jax.Array:
    return jnp.cos(jnp.arange(EMB, dtype=jnp.float32)).astype(dtype)  # a generic cotangent


def _value_and_grads(ffn):
    """jit(x, group, params...) -> (y, grads w.r.t. x, wi, bi, wo, bo) with dropout on."""

    def loss(x, wi, bi, wo, bo, group):
        y = ffn(ExpertRows(x, group, jnp.arange(ROWS) * 3 + 1, wi, bi, wo, bo,
                           jax.random.key(3), RATE))
        return jnp.sum(y.astype(jnp.float32) * _weights(jnp.float32)), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)

    @jax.jit
    def run(x, group, wi, bi, wo, bo):
        (_, y), grads = grad(x, wi, bi, wo, bo, group)
        return y, grads

    return run


reference = _value_and_grads(moe.dispatch.ragged_ffn)
padded_reference = _value_and_grads(
    lambda rows: moe.dispatch.padded_ffn(rows, capacity=None))
xla_grouped = _value_and_grads(functools.partial(grouped_ffn, impl="xla"))
mosaic_grouped = _value_and_grads(functools.partial(grouped_ffn, impl="mosaic", interpret=True,
                                                    **TILES))


def _assert_close(actual, expected, rel):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.all(np.isfinite(a)), "non-finite output (unwritten kernel rows leaked?)"
        chex.assert_trees_all_close(a, e, atol=rel * max(1.0, float(np.abs(e).max())), rtol=0)


def _check_zero_rows(y, group, num_groups):
    dropped = np.asarray(group) >= num_groups
    assert np.all(np.asarray(y, np.float32)[dropped] == 0)


# ---- the XLA reference formulation (fast; every shape class) -------------------------------


@pytest.mark.parametrize("num_groups", [2, 8])
@pytest.mark.parametrize("case", ["mixed", "one_expert", "all_dropped", "capacity"])
def test_xla_impl_matches_ragged_and_padded(num_groups, case):
    x, *params = _params(jax.random.key(num_groups), num_groups, jnp.float32)
    group = _groups(case, num_groups)
    got = xla_grouped(x, group, *params)
    _assert_close(got, reference(x, group, *params), REL_TOL["f32_xla"])
    _assert_close(got, padded_reference(x, group, *params), REL_TOL["f32_xla"])
    _check_zero_rows(got[0], group, num_groups)


def test_dropout_masks_are_moe_masks():
    # Same rate and key: the grouped FFN drops exactly the units row_dropout drops, so with
    # dropout on it matches the reference but not the no-dropout output.
    x, *params = _params(jax.random.key(0), 4, jnp.float32)
    group = _groups("mixed", 4)
    y = jax.jit(functools.partial(grouped_ffn, impl="xla"))(
        ExpertRows(x, group, jnp.arange(ROWS) * 3 + 1, *params, jax.random.key(3), RATE))
    y_ref = reference(x, group, *params)[0]
    y_off = moe.dispatch.ragged_ffn(ExpertRows(x, group, jnp.arange(ROWS), *params))
    chex.assert_trees_all_close(y, y_ref, atol=1e-5)
    assert float(jnp.abs(y - y_off).max()) > 1e-2


def test_padded_block_rows_is_an_argument():
    # The padded layout's tiling is passed in (benchmarks sweep it); any block size gives the
    # same rows through the same experts.
    x, *params = _params(jax.random.key(9), 4, jnp.float32)
    group = _groups("mixed", 4)
    ffn = jax.jit(moe.expert_ffn, static_argnames=("dispatch", "block_rows"))
    want = ffn(x, group, jnp.arange(ROWS), tuple(params), dispatch="ragged")
    assert moe.dispatch.padded_block_rows(ROWS, 4) == 32
    got = ffn(x, group, jnp.arange(ROWS), tuple(params), dispatch="padded", block_rows=8)
    chex.assert_trees_all_close(got, want, atol=1e-5)  # 8-row blocks, the default: 32
    with pytest.raises(ValueError, match="block_rows must be >= 1"):
        moe.dispatch.padded_ffn(ExpertRows(x, group, jnp.arange(ROWS), *params), None,
                                block_rows=0)


@pytest.mark.parametrize("rows, groups, block", [
    (128, 4, 32),  # rows / N below 128: rows / N
    (1024, 8, 128),  # rows / N = 128: unchanged
    (4096, 16, 128),  # rows / N = 256, rows / 4N = 64: lowered to 128, not below
    (4096, 8, 128),  # the CPU language model's step (2,048 tokens, top-2 of 8): not 512
    (8192, 8, 256),  # rows / 4N = 256
    (2**17, 8, 512),  # rows / 4N >= 512: the cap, as before
])
def test_padded_block_rows_bounds_the_padding(rows, groups, block):
    # At most a quarter of the rows are padding once blocks of 128 rows allow it.
    assert moe.dispatch.padded_block_rows(rows, groups) == block


# ---- Mosaic GPU kernels in the interpreter -------------------------------------------------


_MATMUL_CONFIG = GroupedMatmulConfig(interpret=True, weight_grad="kernel", block_m=64,
                                     block_n=64, block_k=64, max_concurrent_steps=2)


@jax.jit
def _kernel_value_and_vjp(lhs, rhs, sizes, cotangent):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, _MATMUL_CONFIG), lhs, rhs)
    return out, vjp(cotangent)


@jax.jit
def _ragged_dot_value_and_vjp(lhs, rhs, sizes, cotangent):
    out, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
    return out, vjp(cotangent)


@needs_cpu_backend
@pytest.mark.parametrize("sizes", [(70, 0, 120), (0, 200, 0)])
def test_three_kernels_match_ragged_dot_and_its_vjp(sizes):
    # Forward (ragged_dot_mgpu), input gradient (its transpose_rhs form) and weight gradient
    # (transposed_ragged_dot_mgpu) in the interpreter against lax.ragged_dot's value and VJP in
    # float32 on the same bfloat16 values. 200 rows in 64-row tiles; (70, 0, 120): a group
    # crossing a tile edge, an empty group, 10 rows past the groups (NaN: must not leak);
    # (0, 200, 0): one group with every row. One compiled function for both.
    k = jax.random.split(jax.random.key(11), 3)
    lhs = jax.random.normal(k[0], (ROWS, EMB), jnp.bfloat16)
    rhs = jax.random.normal(k[1], (3, EMB, MLP), jnp.bfloat16)
    cotangent = jax.random.normal(k[2], (ROWS, MLP), jnp.bfloat16)
    sizes = jnp.array(sizes, jnp.int32)
    used = (np.arange(ROWS) < int(sizes.sum()))[:, None]
    got = _kernel_value_and_vjp(jnp.where(used, lhs, jnp.nan), rhs, sizes,
                                jnp.where(used, cotangent, jnp.nan))
    f32 = [a.astype(jnp.float32) for a in (lhs, rhs, cotangent)]
    want = _ragged_dot_value_and_vjp(jnp.where(used, f32[0], 0), f32[1], sizes,
                                     jnp.where(used, f32[2], 0))
    assert got[0].dtype == jnp.bfloat16
    assert np.all(np.asarray(got[0])[~used[:, 0]] == 0)
    assert np.all(np.asarray(got[1][0])[~used[:, 0]] == 0)
    # One bfloat16 rounding of each result (2^-8 relative) after float32 accumulation.
    _assert_close(got, want, 1e-2)


@needs_cpu_backend
@pytest.mark.parametrize("case", ["mixed", "all_dropped"])
def test_mosaic_bfloat16_forward_and_grads(case):
    # One compiled function (G = 4, bfloat16) for every group layout: group is a traced input.
    # weight_grad="auto" picks the weight-gradient kernel at these widths, as on a GPU.
    assert GroupedMatmulConfig(**TILES).resolved_weight_grad(EMB, MLP) == "kernel"
    x, *params = _params(jax.random.key(1), 4, jnp.bfloat16)
    group = _groups(case, 4)
    got = mosaic_grouped(x, group, *params)
    _assert_close(got, reference(x, group, *params), REL_TOL["bfloat16"])
    _check_zero_rows(got[0], group, 4)


@needs_cpu_backend
@pytest.mark.slow  # fast counterparts: the same kernels at N = 2 and 4, one group above
def test_mosaic_float16_eight_experts_and_one_expert():
    x, *params = _params(jax.random.key(2), 8, jnp.float16)
    group = _groups("mixed", 8)
    got = mosaic_grouped(x, group, *params)
    _assert_close(got, reference(x, group, *params), REL_TOL["float16"])
    x, *params = _params(jax.random.key(1), 4, jnp.bfloat16)
    group = _groups("one_expert", 4)
    _assert_close(mosaic_grouped(x, group, *params), reference(x, group, *params),
                  REL_TOL["bfloat16"])


def test_mosaic_float32_params_cast_to_bfloat16_and_back():
    # Traced only: float32 in, bfloat16 operands in every product, float32 out and gradients.
    x, *params = _params(jax.random.key(3), 2, jnp.float32)
    y, grads = jax.eval_shape(mosaic_grouped, x, _groups("capacity", 2), *params)
    assert y.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in grads)
    jaxpr = str(jax.make_jaxpr(mosaic_grouped)(x, _groups("capacity", 2), *params))
    assert "bf16[" in jaxpr


@needs_cpu_backend
@pytest.mark.slow  # fast counterpart: the casts above; the kernels at bfloat16 above
def test_mosaic_float32_params_two_experts_capacity():
    # float32 parameters run as bfloat16 operands: everything equals the reference run on the
    # bfloat16-cast inputs; the output also equals the float32 reference at bfloat16 tolerance
    # (its gradients need not: a hidden unit whose pre-activation rounds across 0 flips ReLU's
    # derivative). Gradients come back in float32.
    x, *params = _params(jax.random.key(3), 2, jnp.float32)
    group = _groups("capacity", 2)
    got = mosaic_grouped(x, group, *params)
    assert all(g.dtype == jnp.float32 for g in got[1])
    as_bf16 = [a.astype(jnp.bfloat16) for a in (x, *params)]
    _assert_close(got, reference(as_bf16[0], group, *as_bf16[1:]), REL_TOL["bfloat16"])
    _assert_close(got[0], padded_reference(x, group, *params)[0], REL_TOL["f32_as_bf16"])
    _check_zero_rows(got[0], group, 2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels need a GPU")
def test_gpu_mosaic_all_products_with_weight_grad_kernel():
    try:
        check_grouped_supported()
    except ValueError as err:
        pytest.skip(str(err))
    x, *params = _params(jax.random.key(1), 4, jnp.bfloat16)
    ffn = _value_and_grads(functools.partial(grouped_ffn, impl="mosaic", weight_grad="kernel",
                                             **TILES))
    for case in ("mixed", "one_expert", "all_dropped"):
        group = _groups(case, 4)
        _assert_close(ffn(x, group, *params), reference(x, group, *params), REL_TOL["bfloat16"])


# ---- device checks, config, expert parallelism, benchmark -----------------------------------


def _fake_device(platform, kind, capability=None, **attributes):
    device = types.SimpleNamespace(platform=platform, device_kind=kind, **attributes)
    if capability is not None:
        device.compute_capability = capability
    return device


def test_check_grouped_supported_messages():
    check_grouped_supported(_fake_device("gpu", "NVIDIA H100 80GB HBM3", "9.0"))
    with pytest.raises(ValueError, match=r"sm90.*NVIDIA A100-SXM4-40GB.*capability 8\.0"):
        check_grouped_supported(_fake_device("gpu", "NVIDIA A100-SXM4-40GB", "8.0"))
    with pytest.raises(ValueError, match=r"platform 'cpu'.*interpret=True"):
        check_grouped_supported(_fake_device("cpu", "cpu"))
    check_grouped_supported(_fake_device("cpu", "cpu"), interpret=True)
    if jax.default_backend() == "cpu":
        x, *params = _params(jax.random.key(0), 2, jnp.bfloat16)
        with pytest.raises(ValueError, match="sm90"):
            grouped_ffn(ExpertRows(x, _groups("mixed", 2), jnp.arange(ROWS), *params))


@needs_cpu_default
def test_device_check_asks_the_target_device():
    # A compile-only H100 (jax.experimental.topologies) reports platform "cuda" and its kind;
    # the check asks it, not the host's first device, wherever it is named: as the device, as
    # the first device of a mesh, or as a mesh's AbstractDevice inside jit (no capability).
    h100 = _fake_device("cuda", "NVIDIA H100 80GB HBM3", core_count=132)
    mesh = types.SimpleNamespace(devices=np.array([h100, h100]))
    assert mgm.target_device(mesh=mesh) is h100
    check_grouped_supported(mesh=mesh)
    check_grouped_supported(_fake_device("cuda", "NVIDIA H200"))  # kind only
    with pytest.raises(ValueError, match=r"NVIDIA L4"):
        check_grouped_supported(_fake_device("cuda", "NVIDIA L4"))
    assert mgm.target_device() == jax.devices()[0]  # nothing named: the default device
    x = jax.device_put(jnp.ones(3), jax.devices()[1])
    assert mgm.target_device(array=x) == jax.devices()[1]
    cpu_mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])
    with jax.set_mesh(cpu_mesh):
        assert mgm.target_device() == jax.devices()[2]
        seen = []
        jax.jit(lambda v: seen.append(mgm.target_device()) or v)(1.0)
        assert seen[0].platform == "cpu" and not hasattr(seen[0], "id")  # the AbstractDevice
    # Inside jit without a mesh in context: the mesh of the traced array's sharding.
    sharded = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.NamedSharding(
        cpu_mesh, jax.sharding.PartitionSpec()))
    jax.jit(lambda v: seen.append(mgm.target_device(array=v)) or v).lower(sharded)
    assert seen[-1].device_kind == jax.devices()[2].device_kind and not hasattr(seen[-1], "id")


def test_weight_grad_sm_count_from_device_or_config():
    # The transposed kernel's persistent grid spans one program per SM: the config's count,
    # else the target device's core_count, else H100's 132 (CPU devices have no core_count).
    assert mgm.sm_count(GroupedMatmulConfig(num_sms=78)) == 78
    assert mgm.sm_count(GroupedMatmulConfig(), _fake_device("cuda", "H800", core_count=114)) == 114
    assert mgm.sm_count(GroupedMatmulConfig()) == 132
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    x = jnp.ones((128, 64), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda a: mgm.transposed_ragged_dot(
        a, a, group_sizes=jnp.array([100, 28], jnp.int32), block_m=64, block_n=64, block_k=64,
        max_concurrent_steps=2, grid_block_n=1, num_sms=7))(x))
    assert "grid=(7,)" in jaxpr
    assert transposed_ragged_dot_mgpu.jax is jax  # JAX's module is left as it was


def test_config_refuses_what_an_h100_lowering_refuses():
    # One line each; the numbers are Mosaic GPU's own (see the lowering test below).
    refusals = {
        "multiple of 64 \\(wgmma accumulator": dict(block_m=32),
        "block_n=512 must be <= 256": dict(block_n=512, max_concurrent_steps=2),
        "max_concurrent_steps=1 must be >= 2": dict(max_concurrent_steps=1),
        "weight-gradient kernel needs block_n and block_k >= 64": dict(block_k=32),
        "524,320 bytes of shared memory > 232,448": dict(block_m=256, block_n=256, block_k=128),
        "262,160 bytes": dict(block_m=256, block_n=256, block_k=128, max_concurrent_steps=2),
        "bfloat16 or float16": dict(compute_dtype=jnp.float32),
    }
    for message, fields in refusals.items():
        with pytest.raises(ValueError, match=message) as err:
            GroupedMatmulConfig(**fields)
        assert "\n" not in str(err.value)
    # The weight-gradient kernel's limits apply only where it runs.
    GroupedMatmulConfig(block_k=32, block_n=32, weight_grad="xla")
    GroupedMatmulConfig(impl="xla", block_m=32, compute_dtype=jnp.float32)
    assert mgm.smem_bytes(128, 128, 64, 4) == 131_104  # the default: 4 x (2 x 128 x 64 x 2 + 8)
    GroupedMatmulConfig(block_m=128, block_n=128, block_k=128, max_concurrent_steps=3)


def test_config_validation_and_casts():
    with pytest.raises(ValueError, match="impl"):
        GroupedMatmulConfig(impl="triton")
    with pytest.raises(ValueError, match="block_m"):
        GroupedMatmulConfig(block_m=48)
    x = jnp.ones((64, 40), jnp.bfloat16)  # a width no 16-wide tile divides
    with pytest.raises(ValueError, match="contraction width=40 must be a multiple of 16"):
        grouped_matmul(x, jnp.ones((1, 40, 64), jnp.bfloat16), jnp.array([64]),
                       GroupedMatmulConfig(interpret=True, block_m=64))
    assert GroupedMatmulConfig().operand_dtype(jnp.float32) == jnp.bfloat16
    assert GroupedMatmulConfig().operand_dtype(jnp.float16) == jnp.float16
    assert GroupedMatmulConfig(impl="xla").operand_dtype(jnp.float32) == jnp.float32
    # "auto": the weight-gradient kernel where both widths fit its 64-wide tiles.
    assert GroupedMatmulConfig(interpret=True).resolved_weight_grad(64, 128) == "kernel"
    assert GroupedMatmulConfig().resolved_weight_grad(16, 128) == "xla"
    assert GroupedMatmulConfig(weight_grad="xla").resolved_weight_grad(64, 64) == "xla"


def _h100_devices():
    return kit.target_devices_or_skip("h100:1x1")[1]


def _h100_lowering_error(kernel, config: dict, dtype=jnp.bfloat16) -> str | None:
    """None if an H100 compile of ``kernel`` with the tiles ``grouped_matmul`` derives from
    ``config`` succeeds, else its error's first line. Widths of 256 (no tile shrinks), and a
    contraction of 1024 so the forward pipeline has every stage it may buffer."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(_h100_devices(), ("x",))
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))
    tiles = dict(block_m=config["block_m"], block_n=config["block_n"],
                 block_k=config["block_k"], max_concurrent_steps=config["max_concurrent_steps"],
                 grid_block_n=1)
    if kernel == "weight_grad":  # output tiles [block_n, block_n], token tile block_k
        tiles["block_m"] = config["block_n"]

        def fn(a, b, s):
            return mgm.transposed_ragged_dot(a, b, group_sizes=s, num_sms=132, **tiles)
        shapes = [(512, 256), (512, 256)]
    else:
        def fn(a, b, s):
            return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **tiles,
                                              transpose_rhs=kernel == "input_grad")
        shapes = [(512, 1024), (4, 256, 1024) if kernel == "input_grad" else (4, 1024, 256)]
    try:
        with jax.set_mesh(mesh):
            jax.jit(fn).lower(*(spec(s, dtype) for s in shapes), spec((4,), jnp.int32))
    except Exception as err:  # lowering raises ValueError, AssertionError, VerificationError
        return f"{type(err).__name__}: {(str(err).strip() or '-').splitlines()[0]}"
    return None


@needs_cpu_default
def test_grouped_ffn_lowers_for_a_compile_only_h100_from_a_cpu_host():
    # The expert FFN with all three kernels (weight_grad="auto" at these widths) lowered for an
    # H100 whose devices exist only as a topology: the device check asks the mesh of the
    # arguments' shardings (no jax.set_mesh), not the CPU host's first device.
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(_h100_devices(), ("x",))
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))
    ffn = _value_and_grads(functools.partial(grouped_ffn, impl="mosaic"))
    args = [spec((ROWS, EMB), jnp.bfloat16), spec((ROWS,), jnp.int32)] + [
        spec(s, jnp.bfloat16) for s in [(4, EMB, MLP), (4, MLP), (4, MLP, EMB), (4, EMB)]]
    text = ffn.lower(*args).as_text()
    # Two layers (wi, wo) x (forward, input gradient, weight gradient), all Mosaic kernels.
    assert text.count("custom_call @mosaic_gpu") == 6
    with pytest.raises(ValueError, match="platform 'cpu'"):
        ffn.lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))


def _check_rules_against_lowering(kernel, config, dtype, accepted):
    error = _h100_lowering_error(kernel, config, dtype)
    assert (error is None) == accepted, error
    fields = dict(config, compute_dtype=dtype,
                  weight_grad="kernel" if kernel == "weight_grad" else "xla")
    if accepted:
        GroupedMatmulConfig(**fields)
    else:
        with pytest.raises(ValueError):
            GroupedMatmulConfig(**fields)


def _tiles(m, n, k, steps=2):
    return dict(block_m=m, block_n=n, block_k=k, max_concurrent_steps=steps)


@pytest.mark.parametrize("kernel,config,accepted", [
    ("forward", _tiles(128, 128, 128, 3), True),
    ("forward", _tiles(128, 128, 128, 4), False),  # 262,176 bytes of shared memory
    ("weight_grad", _tiles(64, 64, 64), True),
    ("weight_grad", _tiles(64, 64, 32), False),  # a layout cast of the edge masks
])
def test_config_rules_match_an_h100_lowering(kernel, config, accepted):
    # Compiles for a compile-only H100 (skipped without the CUDA PJRT plugin): what the config
    # accepts compiles, what it refuses does not, so the rules follow JAX as it changes.
    _check_rules_against_lowering(kernel, config, jnp.bfloat16, accepted)


@pytest.mark.slow  # fast counterpart: the four boundary cases above
@pytest.mark.parametrize("kernel,config,dtype,accepted", [
    ("forward", _tiles(32, 128, 64), jnp.bfloat16, False),  # wgmma accumulator rows
    ("forward", _tiles(64, 16, 16), jnp.bfloat16, True),
    ("forward", _tiles(64, 64, 32), jnp.float32, False),  # "Only f16 WGMMA supports transposes"
    ("forward", _tiles(256, 256, 128), jnp.bfloat16, False),  # 262,160 bytes
    ("forward", _tiles(128, 512, 64), jnp.bfloat16, False),  # wgmma N <= 256
    ("input_grad", _tiles(128, 128, 64, 4), jnp.bfloat16, True),
    ("input_grad", _tiles(128, 128, 64, 4), jnp.float16, True),
    ("weight_grad", _tiles(128, 128, 64, 4), jnp.bfloat16, True),
    ("weight_grad", _tiles(128, 128, 16, 4), jnp.bfloat16, False),  # layout cast
    ("weight_grad", _tiles(64, 32, 64), jnp.bfloat16, False),  # output tiles < 64
    ("weight_grad", _tiles(64, 64, 64), jnp.float32, False),
    ("weight_grad", _tiles(64, 256, 128, 3), jnp.bfloat16, False),  # 393,240 bytes
])
def test_more_config_rules_match_an_h100_lowering(kernel, config, dtype, accepted):
    _check_rules_against_lowering(kernel, config, dtype, accepted)


def test_tokamax_impl_or_its_missing_package_error():
    x, *params = _params(jax.random.key(6), 4, jnp.bfloat16)
    group = _groups("mixed", 4)
    ffn = functools.partial(grouped_ffn, impl="tokamax")
    try:
        import tokamax  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"impl='tokamax' needs the tokamax package"):
            ffn(ExpertRows(x, group, jnp.arange(ROWS), *params))
        return
    _assert_close(_value_and_grads(ffn)(x, group, *params), reference(x, group, *params),
                  REL_TOL["bfloat16"])


@needs_cpu_default
def test_inside_shard_map_with_local_experts():
    # The expert-parallel layer runs the FFN per device on its local experts (G = N / devices).
    # The XLA impl: the Mosaic GPU interpreter inside a multi-device shard_map on CPU can hang
    # (its simulated devices meet at a thread barrier that XLA:CPU's callbacks need not reach
    # together); the per-shard FFN is the same function either way.
    from sparsemixer_jax.parallel import sharding

    mesh = sharding.make_mesh(2, 2, devices=jax.devices()[:4])
    x, *params = _params(jax.random.key(5), 4, jnp.float32)
    group = _groups("mixed", 4)
    xb, gb, ib = x.reshape(4, 50, EMB), group.reshape(4, 50), jnp.arange(ROWS).reshape(4, 50)
    key = jax.random.key(3)
    want = moe.expert_ffn(x, group, jnp.arange(ROWS), tuple(params), dispatch="ragged",
                          dropout_key=key, dropout_rate=RATE)

    got = jax.jit(lambda x, g, i, p: moe.expert_parallel_ffn(
        x, g, i, p, mesh=mesh, dispatch="grouped", dropout_key=key, dropout_rate=RATE,
        grouped_impl="xla"))(xb, gb, ib, tuple(params))
    _assert_close(got.reshape(ROWS, EMB), want, REL_TOL["f32_xla"])


@needs_cpu_backend
@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
def test_benchmark_runs_tiny_in_interpret_mode(tmp_path):
    from lab.benchmarks import grouped_ffn as benchmark

    out = tmp_path / "grouped.json"
    result = benchmark.main(["--interpret", "--tiny", "--experts", "2", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == result
    names = {row["dispatch"] for row in saved["rows"]}
    assert {"dense", "padded", "grouped", "padded_cap1.0", "padded_cap1.25"} <= names
    assert all(row["ms"] > 0 for row in saved["rows"])
    assert saved["environment"]["jax"] == jax.__version__


@needs_cpu_default
def test_grouped_matmul_gradients_under_expert_parallel_shard_map():
    """Expert parallelism: tokens replicated over the `expert` axis, each shard holding its own
    experts. The custom VJP's cotangents vary as their operands do (a Mosaic kernel's result
    carries no mesh axes: before, tracing the gradient failed), and the replicated tokens'
    gradient is summed over the shards, as JAX's own ``lax.ragged_dot`` gives it.

    The Mosaic path is traced and lowered (the interpreter does not run kernels of several
    simulated devices at once); the numbers come from the same custom VJP with ``impl="xla"``.
    """
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec
    x = jax.random.normal(jax.random.key(0), (128, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, 64, 64)).astype(jnp.bfloat16) / 8
    groups = jnp.array([[64, 64], [32, 96]], jnp.int32)  # two experts per shard

    def loss(product, x, w, groups):
        local = jax.shard_map(lambda x, w, g: product(x, w, g[0]), mesh=mesh,
                              in_specs=(spec(), spec("expert"), spec("expert")),
                              out_specs=spec("expert"))
        return jnp.sum(local(x, w, groups).astype(jnp.float32) ** 2)

    def reference(x, w, g):
        return jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32).astype(x.dtype)

    def grad_of(product):
        return jax.jit(jax.grad(functools.partial(loss, product), argnums=(0, 1)))

    mosaic = functools.partial(grouped_matmul, config=GroupedMatmulConfig(
        impl="mosaic", interpret=True, **TILES))
    xla = functools.partial(grouped_matmul, config=GroupedMatmulConfig(impl="xla"))
    with jax.set_mesh(mesh):
        w, groups = (jax.device_put(a, jax.NamedSharding(mesh, spec("expert")))
                     for a in (w, groups))
        lowered = grad_of(mosaic).lower(x, w, groups)
        assert [o.shape for o in jax.tree.leaves(lowered.out_info)] == [x.shape, w.shape]
        got, want = grad_of(xla)(x, w, groups), grad_of(reference)(x, w, groups)
    for g, r in zip(got, want, strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=0, atol=REL_TOL["bfloat16"] * np.abs(r).max())


def test_move_rows_transpose_is_the_inverse_gather():
    """move_rows' backward (a gather by the inverse indices) equals the VJP of the plain
    where(keep, x[take], 0), whose transpose is a scatter-add: both are exact (each row's
    cotangent is one cotangent row or zero), so they agree bit for bit."""
    from sparsemixer_jax.moe.dispatch import move_rows

    rows, padded, groups = 10, 16, 3
    group = jnp.array([2, 0, 3, 1, 0, 2, 3, 1, 0, 2])  # 3: no expert (two rows)
    order = jnp.argsort(group, stable=True)
    gather = jnp.concatenate([order, jnp.zeros((padded - rows,), order.dtype)])
    valid = jnp.concatenate([group[order] < groups, jnp.zeros((padded - rows,), bool)])
    position = jnp.argsort(order)
    served = group < groups
    x = jax.random.normal(jax.random.key(0), (rows, 4))
    g = jax.random.normal(jax.random.key(1), (padded, 4))

    def plain(x):
        return jnp.where(valid[:, None], x[gather], 0)

    out, vjp = jax.vjp(lambda x: move_rows(x, gather, valid, position, served), x)
    want, want_vjp = jax.vjp(plain, x)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(vjp(g)[0], want_vjp(g)[0])
    # and back to row order: the sorted rows' cotangent is the rows' own, or zero
    back, back_vjp = jax.vjp(lambda y: move_rows(y, position, served, gather, valid), out)
    np.testing.assert_array_equal(back, jnp.where(served[:, None], x, 0))
    np.testing.assert_array_equal(back_vjp(x)[0], plain(x))
