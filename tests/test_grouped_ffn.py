"""Grouped-GEMM expert FFN (sparsemixer_jax.kernels) against the layer's own dispatches.

The Mosaic GPU kernels run in JAX's Mosaic GPU interpreter on CPU (``interpret=True``): the
forward kernel and the input gradient (the same kernel on transposed weights) are proven here;
the weight-gradient kernel cannot run in the interpreter, so it has a GPU-only test plus CPU
tests of its reference formulation and of the padding around it.

Interpreted kernels are slow (each simulates the kernel's 132 SM threads), so each compiled
function below is built once per module and reused by several cases.
"""

from __future__ import annotations

import functools
import itertools
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
from sparsemixer_jax.moe.dispatch import grouped_ffn

EMB, MLP, ROWS, RATE = 64, 128, 200, 0.25  # 200 rows: not a multiple of the 64-row tile
TILES = dict(block_m=64, block_n=64, block_k=64)
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
        y = ffn(x, group, jnp.arange(ROWS) * 3 + 1, wi, bi, wo, bo, jax.random.key(3), RATE)
        return jnp.sum(y.astype(jnp.float32) * _weights(jnp.float32)), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)

    @jax.jit
    def run(x, group, wi, bi, wo, bo):
        (_, y), grads = grad(x, wi, bi, wo, bo, group)
        return y, grads

    return run


reference = _value_and_grads(moe.dispatch._ragged_ffn)
padded_reference = _value_and_grads(
    lambda *a: moe.dispatch._padded_ffn(*a, capacity=None))
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
    y = jax.jit(functools.partial(grouped_ffn, impl="xla"), static_argnums=8)(
        x, group, jnp.arange(ROWS) * 3 + 1, *params, jax.random.key(3), RATE)
    y_ref = reference(x, group, *params)[0]
    y_off = moe.dispatch._ragged_ffn(x, group, jnp.arange(ROWS), *params, None, 0.0)
    chex.assert_trees_all_close(y, y_ref, atol=1e-5)
    assert float(jnp.abs(y - y_off).max()) > 1e-2


# ---- Mosaic GPU kernels in the interpreter -------------------------------------------------


@pytest.mark.parametrize("case", ["mixed", "one_expert", "all_dropped"])
def test_mosaic_bfloat16_forward_and_grads(case):
    # One compiled function (G = 4, bfloat16) for every group layout: group is a traced input.
    x, *params = _params(jax.random.key(1), 4, jnp.bfloat16)
    group = _groups(case, 4)
    got = mosaic_grouped(x, group, *params)
    _assert_close(got, reference(x, group, *params), REL_TOL["bfloat16"])
    _check_zero_rows(got[0], group, 4)


@pytest.mark.slow  # fast counterparts: the same kernels at N = 2 and 4
def test_mosaic_float16_eight_experts():
    x, *params = _params(jax.random.key(2), 8, jnp.float16)
    group = _groups("mixed", 8)
    got = mosaic_grouped(x, group, *params)
    _assert_close(got, reference(x, group, *params), REL_TOL["float16"])


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


def test_mosaic_matmul_zeros_rows_past_the_groups():
    # The kernel leaves rows past sum(group_sizes) unwritten (NaN in the interpreter); the
    # wrapper must return zeros there, as lax.ragged_dot does.
    lhs = jax.random.normal(jax.random.key(4), (128, 64), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(5), (3, 64, 64), jnp.bfloat16)
    sizes = jnp.array([50, 0, 60], jnp.int32)
    config = GroupedMatmulConfig(interpret=True, **TILES)
    got = jax.jit(grouped_matmul, static_argnums=3)(lhs, rhs, sizes, config)
    want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert np.all(np.asarray(got[110:]) == 0)
    _assert_close(got, want.astype(jnp.bfloat16), REL_TOL["bfloat16"])


# ---- the weight-gradient kernel: GPU only; its formulation and padding on CPU ---------------


def test_weight_grad_reference_formulation():
    lhs = jax.random.normal(jax.random.key(6), (100, 32))
    dout = jax.random.normal(jax.random.key(7), (100, 48))
    sizes = jnp.array([30, 0, 65], jnp.int32)  # 5 rows past the groups
    got = mgm._xla_weight_grad(lhs, dout, sizes)
    bounds = np.cumsum([0, 30, 0, 65])
    want = np.stack([np.asarray(lhs[a:b]).T @ np.asarray(dout[a:b])
                     for a, b in itertools.pairwise(bounds)])
    chex.assert_trees_all_close(got, want, atol=1e-4)


def test_weight_grad_kernel_padding_with_reference_kernel():
    # The transposed kernel needs whole tiles and masks the edge blocks by multiplying with 0;
    # the wrapper must pad rows and zero rows past the groups (NaN * 0 is NaN).
    calls = []

    def fake_kernel(lhs, rhs, *, group_sizes, block_m, block_n, block_k, **_):
        calls.append((lhs.shape, block_m, block_n, block_k))
        assert lhs.shape[0] % block_k == 0 and lhs.shape[1] % block_m == 0
        assert rhs.shape[1] % block_n == 0
        return mgm._xla_weight_grad(lhs, rhs, group_sizes)

    lhs = jax.random.normal(jax.random.key(8), (100, 64)).at[97:].set(jnp.nan)
    dout = jax.random.normal(jax.random.key(9), (100, 32)).at[97:].set(jnp.inf)
    sizes = jnp.array([40, 57], jnp.int32)
    config = GroupedMatmulConfig(block_n=64, block_k=64)
    got = mgm._mosaic_weight_grad(lhs, dout, sizes, config, kernel=fake_kernel)
    want = mgm._xla_weight_grad(lhs[:97], dout[:97], sizes)
    assert calls == [((128, 64), 64, 32, 64)]
    chex.assert_trees_all_close(got, want, atol=1e-4)


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
            grouped_ffn(x, _groups("mixed", 2), jnp.arange(ROWS), *params, None, 0.0)


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


def test_weight_grad_sm_count_from_device_or_config():
    # The transposed kernel's persistent grid spans one program per SM: the config's count,
    # else the target device's core_count, else H100's 132 (CPU devices have no core_count).
    assert mgm.sm_count(GroupedMatmulConfig(num_sms=78)) == 78
    assert mgm.sm_count(GroupedMatmulConfig(), _fake_device("cuda", "H800", core_count=114)) == 114
    assert mgm.sm_count(GroupedMatmulConfig()) == 132
    seen = []

    def spy_kernel(lhs, rhs, **_):
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as tmod

        seen.append(tmod.jax.devices()[0].core_count)
        return jnp.zeros((1, lhs.shape[1], rhs.shape[1]), lhs.dtype)

    lhs = jnp.ones((64, 64), jnp.bfloat16)
    mgm._mosaic_weight_grad(lhs, lhs, jnp.array([64], jnp.int32),
                            GroupedMatmulConfig(block_n=64, block_k=64, num_sms=7),
                            kernel=spy_kernel)
    assert seen == [7]
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as tmod

    assert tmod.jax is jax  # restored after the call


def test_config_validation_and_casts():
    with pytest.raises(ValueError, match="impl"):
        GroupedMatmulConfig(impl="triton")
    with pytest.raises(ValueError, match="block_m"):
        GroupedMatmulConfig(block_m=48)
    with pytest.raises(ValueError, match="multiple of 16"):
        mgm._fit_block(64, 40, "width")
    assert mgm._fit_block(128, 192, "width") == 64
    assert GroupedMatmulConfig().operand_dtype(jnp.float32) == jnp.bfloat16
    assert GroupedMatmulConfig().operand_dtype(jnp.float16) == jnp.float16
    assert GroupedMatmulConfig(impl="xla").operand_dtype(jnp.float32) == jnp.float32
    assert GroupedMatmulConfig(interpret=True).resolved_weight_grad() == "xla"
    assert GroupedMatmulConfig().resolved_weight_grad() == "kernel"


def test_tokamax_impl_or_its_missing_package_error():
    x, *params = _params(jax.random.key(6), 4, jnp.bfloat16)
    group = _groups("mixed", 4)
    ffn = functools.partial(grouped_ffn, impl="tokamax")
    try:
        import tokamax  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"impl='tokamax' needs the tokamax package"):
            ffn(x, group, jnp.arange(ROWS), *params, None, 0.0)
        return
    _assert_close(_value_and_grads(ffn)(x, group, *params), reference(x, group, *params),
                  REL_TOL["bfloat16"])


def test_inside_shard_map_with_local_experts():
    # The expert-parallel layer runs the FFN per device on its local experts (G = N / devices).
    # The XLA impl: the Mosaic GPU interpreter inside a multi-device shard_map on CPU can hang
    # (its simulated devices meet at a thread barrier that XLA:CPU's callbacks need not reach
    # together); the per-shard FFN is the same function either way.
    from sparsemixer_jax import sharding

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


@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
def test_benchmark_runs_tiny_in_interpret_mode(tmp_path):
    from sparsemixer_jax.benchmarks import grouped_ffn as benchmark

    out = tmp_path / "grouped.json"
    result = benchmark.main(["--interpret", "--tiny", "--experts", "2", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == result
    names = {row["dispatch"] for row in saved["rows"]}
    assert {"dense", "padded", "grouped", "padded_cap1.0", "padded_cap1.25"} <= names
    assert all(row["ms"] > 0 for row in saved["rows"])
    assert saved["environment"]["jax"] == jax.__version__
