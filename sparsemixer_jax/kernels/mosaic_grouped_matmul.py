"""Grouped matmul with a custom VJP whose three products run on JAX's Mosaic GPU Pallas kernels.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``: rows of ``lhs`` are
sorted by group, group ``g`` owns the next ``group_sizes[g]`` rows and is multiplied by
``rhs[g]``; rows past ``sum(group_sizes)`` output zeros (as :func:`jax.lax.ragged_dot`).

Implementations (``GroupedMatmulConfig.impl``):

* ``"mosaic"``: Hopper (sm90) GPUs, or JAX's Mosaic GPU interpreter on any backend
  (``interpret=True`` or ``force_gpu_interpret_mode()``), where all three products are tested
  against :func:`jax.lax.ragged_dot` and its VJP.

  - forward ``lhs @ rhs[g]``: ``ragged_dot_mgpu.ragged_dot`` (one consumer warpgroup per
    program), or with ``warpgroups=2`` our two-warpgroup kernel
    (:mod:`~sparsemixer_jax.kernels.grouped_matmul_2wg`, for 128 x 256 and 256 x 128 tiles);
  - input gradient ``dout @ rhs[g]^T``: the same kernel with ``transpose_rhs=True`` (it reads
    the weights transposed in shared memory, no copy);
  - weight gradient ``lhs_g^T @ dout_g``: ``transposed_ragged_dot_mgpu.transposed_ragged_dot``
    through :func:`transposed_ragged_dot`, or with ``warpgroups=2`` ours
    (``weight_grad="kernel"``; ``"auto"`` picks it where both widths are multiples of 64, its
    smallest tile, else the XLA formulation).

  The kernels take one 16-bit dtype for both operands and write their output in it
  (accumulating in float32): operands are cast to ``compute_dtype`` (bfloat16 or float16), the
  output is in ``compute_dtype``. :class:`GroupedMatmulConfig` refuses at construction the tiles
  an H100 lowering refuses (:func:`tile_errors`).
* ``"xla"``: the same custom VJP with :func:`jax.lax.ragged_dot` (and ``ragged_dot_general``
  for the weight gradient) as the three products, float32 accumulation, output rounded to the
  operand dtype: the reference formulation, runs on every backend.
* ``"tokamax"``: ``tokamax.ragged_dot`` (its own kernels and VJP; the operands are cast as for
  ``"mosaic"``). Optional (``requirements-tokamax.txt``), imported only when asked for; where it
  is missing the call raises an ImportError saying so. tokamax picks its kernel by the default
  device's GPU generation, so on a CPU host it runs its XLA path (tested); its Mosaic kernels
  refuse the interpreter there ("Unsupported GPU architecture") and are untested here.

Shape rules, met here: ``K`` and ``N`` multiples of 16 (tiles shrink to a power of two dividing
the width, else a ValueError); the rows are padded to a multiple of ``block_m`` when they are not
already (:func:`sparsemixer_jax.moe.dispatch.grouped_ffn` pads once up front so no copy happens
here). ``ragged_dot_mgpu`` hard-codes a persistent grid of 132 programs (the SMs of an H100 SXM5
or H200); on a GPU with fewer SMs it still computes the right result, in more waves. The
weight-gradient kernel's grid and the two-warpgroup kernel's are :func:`sm_count`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("mosaic", "xla", "tokamax")
WEIGHT_GRADS = ("auto", "kernel", "xla")
_MIN_BLOCK = 16
# The accumulator of Hopper's wgmma has a multiple of 64 rows ("The accumulator's first dimension
# must be a multiple of 64"): block_m of the forward kernels, both output tiles of the
# weight-gradient kernel, whose token tile block_k must be >= 64 as well (16 and 32 fail a layout
# cast of its edge masks). Found by lowering for an H100 (tests/test_grouped_ffn.py re-checks).
_WGMMA_ROWS = 64
_MAX_BLOCK_N = 256  # wgmma: "N must be a multiple of 8 and <= 256"
# Shared memory per block with opt-in on compute capability 9.0: 227 KiB (CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability"); Mosaic GPU's limit for an H100.
H100_SMEM_BYTES = 232_448
_BARRIER_BYTES = 8  # one mbarrier per pipeline stage
# SMs of an H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3) and of an
# H200 (the same GH100 configuration).
H100_SMS = 132
_MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int,
               itemsize: int = 2) -> int:
    """Shared memory of one ``ragged_dot_mgpu`` program: ``stages`` buffered ``[block_m,
    block_k]`` and ``[block_k, block_n]`` operand tiles and a barrier each; the output tile
    is staged afterwards in the same memory. Matches Mosaic GPU's count (524,320 bytes for
    256x256x128 at 4 stages, 262,160 at 2). The weight-gradient kernel is the same formula with
    its token tile as ``block_k`` and its two output tiles as ``block_m``, ``block_n``. A bound:
    the forward kernels buffer at most ``K / block_k`` stages, so narrow widths need less."""
    pipeline = stages * ((block_m + block_n) * block_k * itemsize + _BARRIER_BYTES)
    return max(pipeline, block_m * block_n * itemsize)


def tile_errors(block_m: int, block_n: int, block_k: int, stages: int,
                weight_grad_kernel: bool, warpgroups: int = 1) -> list[str]:
    """What an H100 lowering of the Mosaic kernels refuses in these tiles (empty: nothing).
    ``warpgroups=2``: the forward and input-gradient products run on
    :func:`~sparsemixer_jax.kernels.grouped_matmul_2wg.grouped_matmul_2wg`."""
    from sparsemixer_jax.kernels import grouped_matmul_2wg

    errors = []
    if block_m % _WGMMA_ROWS:
        errors.append(f"block_m={block_m} must be a multiple of {_WGMMA_ROWS} (wgmma accumulator "
                      f"rows)")
    if block_n > _MAX_BLOCK_N:
        errors.append(f"block_n={block_n} must be <= {_MAX_BLOCK_N} (wgmma N)")
    if stages < 2:
        errors.append(f"max_concurrent_steps={stages} must be >= 2 (JAX's kernels release "
                      f"each buffer one step late; one stage would not overlap loads and "
                      f"products)")
    used = smem_bytes(block_m, block_n, block_k, stages)
    if warpgroups == 2:
        used = grouped_matmul_2wg.smem_bytes(block_m, block_n, block_k, stages)
        rows, columns = grouped_matmul_2wg.warpgroup_tile(block_m, block_n)
        # 128 threads hold a warpgroup's float32 accumulator; a thread has at most 255 registers.
        if columns < _MIN_BLOCK:
            errors.append(f"warpgroups=2: block_n={block_n} leaves each warpgroup {columns} "
                          f"columns < {_MIN_BLOCK} (no shared-memory tiling fits them)")
        if rows * columns // 128 >= 255:
            errors.append(f"warpgroups=2: each warpgroup's {rows}x{columns} float32 accumulator "
                          f"needs {rows * columns // 128} registers per thread > 255")
    if weight_grad_kernel:
        if block_n < _WGMMA_ROWS or block_k < _WGMMA_ROWS:
            errors.append(f"the weight-gradient kernel needs block_n and block_k >= "
                          f"{_WGMMA_ROWS}, got {block_n} and {block_k} (or weight_grad='xla')")
        if warpgroups == 1:  # two warpgroups: the forward's tiles and shared memory
            used = max(used, smem_bytes(block_n, block_n, block_k, stages))
    if used > H100_SMEM_BYTES:
        errors.append(f"tiles need {used:,} bytes of shared memory > {H100_SMEM_BYTES:,} (an "
                      f"H100's); lower max_concurrent_steps={stages} or the tiles")
    return errors


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static settings of :func:`grouped_matmul` (hashable: one compiled VJP per config).

    Attributes:
      impl: ``"mosaic"``, ``"xla"`` or ``"tokamax"`` (module docstring).
      block_m: rows per kernel tile (a multiple of 64); rows are padded to a multiple of it.
      block_n, block_k: output-feature and contraction tiles, shrunk to a power of two that
        divides the width when they do not. ``block_k`` is also the weight-gradient kernel's
        token tile, ``block_n`` both its output tiles.
      max_concurrent_steps, grid_block_n: pipelining depth (>= 2) and tile-order swizzle of the
        kernels.
      warpgroups: consumer warpgroups per program of the Mosaic kernels: 1, JAX's
        ``ragged_dot_mgpu`` and ``transposed_ragged_dot_mgpu``; 2, ours
        (:mod:`~sparsemixer_jax.kernels.grouped_matmul_2wg`), which split a ``block_m x
        block_n`` output tile, the weight gradient's too (of ``[K, N]``, ``block_k`` rows a step).
      weight_grad: ``"kernel"`` (transposed Mosaic kernel), ``"xla"``, or ``"auto"``
        (``"kernel"`` where both widths of the weights are multiples of 64, else ``"xla"``).
        Ignored by the other impls.
      interpret: run the Mosaic kernels in JAX's Mosaic GPU interpreter (CPU, tests).
      compute_dtype: operand dtype of the kernels; None: float16 stays float16, everything else
        is cast to bfloat16 (``"mosaic"``, ``"tokamax"``), or no cast at all (``"xla"``).
      num_sms: programs of the weight-gradient kernel's persistent grid (and of the
        two-warpgroup kernel's); None: the target device's SM count (:func:`sm_count`).
      zero_past_groups: the caller guarantees that ``lhs`` and the output's cotangent are
        zero (finite suffices) on the rows past the groups, so the weight-gradient kernel
        needs no masked copies of them (:func:`sparsemixer_jax.moe.dispatch.grouped_ffn`'s
        operands are).

    With ``impl="mosaic"`` the tiles an H100 lowering refuses are refused here, one line each
    (:func:`tile_errors`), also under ``interpret=True``: the interpreter would run them.
    """

    impl: str = "mosaic"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1
    warpgroups: int = 1
    weight_grad: str = "auto"
    interpret: bool = False
    compute_dtype: Any = None
    num_sms: int | None = None
    zero_past_groups: bool = False

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"grouped matmul impl must be one of {IMPLS}, got {self.impl!r}")
        if self.weight_grad not in WEIGHT_GRADS:
            raise ValueError(
                f"weight_grad must be one of {WEIGHT_GRADS}, got {self.weight_grad!r}")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < _MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_BLOCK}, got {value}")
        if self.warpgroups not in (1, 2):
            raise ValueError(f"warpgroups must be 1 or 2, got {self.warpgroups}")
        if self.grid_block_n < 1 or (self.num_sms is not None and self.num_sms < 1):
            raise ValueError(f"grid_block_n and num_sms must be >= 1, got {self.grid_block_n} "
                             f"and {self.num_sms}")
        if self.compute_dtype is not None:
            # Canonical and hashable, so equal configs share one compiled function.
            object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))
        if self.impl != "mosaic":
            return
        if self.compute_dtype is not None and self.compute_dtype not in _MOSAIC_DTYPES:
            raise ValueError(f"impl='mosaic' computes in bfloat16 or float16 (wgmma transposes "
                             f"only 16-bit operands), got compute_dtype={self.compute_dtype}")
        errors = tile_errors(self.block_m, self.block_n, self.block_k,
                             self.max_concurrent_steps, self.weight_grad != "xla",
                             self.warpgroups)
        if errors:
            raise ValueError(f"GroupedMatmulConfig: {errors[0]}")

    def operand_dtype(self, dtype) -> jnp.dtype:
        """The dtype the operands of this config's products are cast to."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        dtype = jnp.dtype(dtype)
        if self.impl == "xla":
            return dtype
        return dtype if dtype in _MOSAIC_DTYPES else jnp.dtype(jnp.bfloat16)

    def resolved_weight_grad(self, k: int | None = None, n: int | None = None) -> str:
        """``"kernel"`` or ``"xla"``: how the weight gradient of ``[G, k, n]`` weights runs."""
        if self.impl != "mosaic":
            return "xla"
        if self.weight_grad != "auto":
            return self.weight_grad
        widths = [w for w in (k, n) if w is not None]
        return "kernel" if all(w % _WGMMA_ROWS == 0 for w in widths) else "xla"


def interpret_mode_active() -> bool:
    """True inside ``force_gpu_interpret_mode()`` (then every Mosaic kernel is interpreted)."""
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


# Hopper device kinds, for devices that report a kind but no compute capability (an
# AbstractDevice of a mesh seen inside jit).
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def target_device(device: Any = None, mesh: jax.sharding.Mesh | None = None,
                  array: Any = None) -> Any:
    """The device a computation is built for, most specific first.

    ``device``; else the first device of ``mesh``; else of ``array`` (a concrete array's
    device; a traced array's type names the ``AbstractDevice`` of the mesh its input shardings
    lie on); else of the mesh in context (``jax.set_mesh``: its devices outside ``jit``, its
    ``AbstractDevice`` inside); else ``jax.config.jax_default_device``; else
    ``jax.devices()[0]``. A compile-only device (``jax.experimental.topologies``) named in any
    of these places is what is asked, so a CPU host can build for an H100 without one.
    """
    if device is not None:
        return device
    if mesh is not None:
        return mesh.devices.flat[0]
    if isinstance(array, jax.core.Tracer):  # its type's mesh names the target's device kind
        abstract = getattr(getattr(jax.typeof(array), "sharding", None), "mesh", None)
        if getattr(abstract, "abstract_device", None) is not None:
            return abstract.abstract_device
    elif isinstance(array, jax.Array):
        return next(iter(array.devices()))
    try:
        context_mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jit: only the abstract mesh is known, with its device kind
        abstract = jax.sharding.get_abstract_mesh()
        if getattr(abstract, "abstract_device", None) is not None:
            return abstract.abstract_device
    else:
        if not context_mesh.empty:
            return context_mesh.devices.flat[0]
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return jax.devices(default)[0]
    return default if default is not None else jax.devices()[0]


def _is_hopper(device: Any) -> bool:
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        return str(capability).split(".")[0] == "9"
    words = re.split(r"[\s_-]+", str(getattr(device, "device_kind", "")).upper())
    return any(name in words for name in _HOPPER_KINDS)


def check_grouped_supported(device: Any = None, *, mesh: jax.sharding.Mesh | None = None,
                            interpret: bool = False) -> None:
    """Raises a one-line ValueError unless ``impl="mosaic"`` can be built for the target device.

    The Mosaic kernels use Hopper's wgmma and TMA: they need an sm90 NVIDIA GPU (H100, H200,
    GH200), or interpret mode (``interpret=True`` or JAX's ``force_gpu_interpret_mode``), which
    runs them on any backend. The device asked is :func:`target_device` of ``device`` and
    ``mesh``: a compile-only H100 from ``jax.experimental.topologies`` passes on a CPU host.
    """
    if interpret or interpret_mode_active():
        return
    device = target_device(device, mesh)
    platform = getattr(device, "platform", "?")
    kind = getattr(device, "device_kind", "?")
    if platform not in ("gpu", "cuda"):
        raise ValueError(
            f"grouped matmul impl='mosaic' needs an sm90 (Hopper) NVIDIA GPU, got platform "
            f"{platform!r} ({kind}); use impl='xla', or interpret=True to run the kernels in "
            f"the Mosaic GPU interpreter")
    if not _is_hopper(device):
        capability = getattr(device, "compute_capability", "?")
        raise ValueError(
            f"grouped matmul impl='mosaic' needs an sm90 (Hopper) GPU, got {kind} (compute "
            f"capability {capability}); use impl='xla'")


def sm_count(config: GroupedMatmulConfig, device: Any = None) -> int:
    """Programs in the weight-gradient kernel's persistent grid, one per SM.

    ``config.num_sms`` when set; else the target device's ``core_count`` (GPU devices, also
    compile-only ones; ``AbstractDevice.num_cores`` inside ``jit``); else :data:`H100_SMS`
    (132). Any count computes the same result; the device's own runs one wave.
    """
    if config.num_sms is not None:
        return config.num_sms
    device = target_device(device)
    count = getattr(device, "core_count", None) or getattr(device, "num_cores", None)
    return int(count) if count else H100_SMS


_SM_COUNT_LOCK = threading.Lock()


class _JaxWithSmCount:
    """The ``jax`` module as ``transposed_ragged_dot_mgpu`` sees it while it builds its grid.

    That kernel sizes its persistent grid with ``jax.devices()[0].core_count``: the first
    device of the default backend, which on a CPU host (the interpreter, a compile-only H100
    target) is a CPU without ``core_count``. It takes no argument for it, so for the duration
    of one call its module-level ``jax`` is this view, whose ``devices()`` answers with the
    SM count of the target; every other name is ``jax``'s own.
    """

    def __init__(self, num_sms: int):
        self._device = types.SimpleNamespace(core_count=num_sms)

    def devices(self, *args, **kwargs):
        del args, kwargs
        return [self._device]

    def __getattr__(self, name):
        return getattr(jax, name)


def transposed_ragged_dot(lhs: jax.Array, rhs: jax.Array, *, group_sizes: jax.Array,
                          block_m: int, block_n: int, block_k: int, max_concurrent_steps: int,
                          grid_block_n: int, num_sms: int) -> jax.Array:
    """``transposed_ragged_dot_mgpu.transposed_ragged_dot`` on a grid of ``num_sms`` programs.

    ``lhs [K, M]``, ``rhs [K, N]`` -> ``[G, M, N]`` with ``[g] = lhs_g^T @ rhs_g`` over the
    rows of group ``g``; the tiles as that function takes them, unchecked (the checked path is
    :func:`grouped_matmul`). JAX's function reads the grid size from ``jax.devices()[0]``; here
    it is an argument, so a CPU host (interpreter, compile-only H100) can run or lower it.
    """
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as kernel_module

    # Tracing in several threads at once (e.g. compiling two steps concurrently) must not see
    # another call's SM count: the swap is held under one lock for the whole call.
    with _SM_COUNT_LOCK:
        seen = kernel_module.jax
        kernel_module.jax = _JaxWithSmCount(num_sms)
        try:
            return kernel_module.transposed_ragged_dot(
                lhs, rhs, group_sizes=group_sizes, block_m=block_m, block_n=block_n,
                block_k=block_k, max_concurrent_steps=max_concurrent_steps,
                grid_block_n=grid_block_n)
        finally:
            kernel_module.jax = seen


def _fit_block(block: int, dim: int, what: str, smallest: int = _MIN_BLOCK) -> int:
    """The largest power of two <= ``block`` dividing ``dim`` (the kernels need whole tiles)."""
    while block >= smallest:
        if dim % block == 0:
            return block
        block //= 2
    raise ValueError(f"grouped matmul impl='mosaic': {what}={dim} must be a multiple of "
                     f"{smallest}")


def _rows_valid(rows: int, group_sizes: jax.Array) -> jax.Array:
    """bool ``[rows, 1]``: True on rows that belong to a group."""
    return (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]


def zero_unkept(keep: jax.Array, x: jax.Array, anchor: jax.Array) -> jax.Array:
    """``jnp.where(keep, x, 0)``, bit for bit, without a zero-filled array of ``x``'s shape.

    ``keep`` broadcasts against ``x``; ``anchor`` is any integer array the computation
    derives from its inputs (indices, group sizes), which the zero is computed from. With a
    literal ``0``, JAX broadcasts it to ``x``'s shape, and inside a differentiated
    ``lax.scan`` (a model's layer stack) it hoists that loop-invariant broadcast out of the
    loop: the compiled program keeps a zero-filled array as large as ``x`` in memory and every
    kernel that selects reads it as a second operand (XLA's select loads both sides). A zero
    computed from ``anchor`` varies with the loop, so its broadcast stays inside the kernel
    that reads it.
    """
    zero = (anchor.reshape(-1)[0] * 0).astype(x.dtype) if anchor.size else 0
    return jnp.where(keep, x, zero)


def _pad_rows(a: jax.Array, multiple: int) -> jax.Array:
    pad = -a.shape[0] % multiple
    return a if pad == 0 else jnp.pad(a, [(0, pad), (0, 0)])


def _interpreting(config: GroupedMatmulConfig):
    if not config.interpret:
        return contextlib.nullcontext()
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

    return interpret_params.force_gpu_interpret_mode()


def mosaic_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                  config: GroupedMatmulConfig, transpose_rhs: bool = False) -> jax.Array:
    """The forward (or, with ``transpose_rhs``, input-gradient) product of ``impl="mosaic"``
    alone, without a VJP: ``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` with
    ``transpose_rhs``), both in the compute dtype, -> ``[M, N]``; rows past the groups: zeros.
    ``ragged_dot_mgpu`` or, with ``config.warpgroups=2``, ``grouped_matmul_2wg``."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    from sparsemixer_jax.kernels import grouped_matmul_2wg

    rows, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # Two warpgroups split an N tile of 16 into 8-wide halves, which an H100 lowering refuses
    # for rhs [K, N] (no shared-memory tiling divides them): their tiles stop at 32.
    narrowest = 2 * _MIN_BLOCK if config.warpgroups == 2 else _MIN_BLOCK
    tiles = dict(block_m=config.block_m,
                 block_n=_fit_block(config.block_n, n, "output width", narrowest),
                 block_k=_fit_block(config.block_k, k, "contraction width"),
                 max_concurrent_steps=config.max_concurrent_steps,
                 grid_block_n=config.grid_block_n, transpose_rhs=transpose_rhs)
    with _interpreting(config):
        if config.warpgroups == 2:
            out = grouped_matmul_2wg.grouped_matmul_2wg(
                _pad_rows(lhs, config.block_m), rhs, group_sizes, **tiles,
                num_programs=sm_count(config, target_device(array=lhs)))
        else:
            out = ragged_dot_mgpu.ragged_dot(_pad_rows(lhs, config.block_m), rhs,
                                             group_sizes=group_sizes, **tiles)
    # The kernel never writes rows outside the groups (uninitialised memory, NaN in the
    # interpreter), and a NaN there would poison the transposed kernel's masked products.
    return zero_unkept(_rows_valid(rows, group_sizes), out[:rows], group_sizes)


def mosaic_weight_grad(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array,
                       config: GroupedMatmulConfig) -> jax.Array:
    """The weight-gradient product of ``impl="mosaic"`` alone: ``lhs [M, K]``, ``dout [M, N]``
    -> ``[G, K, N]`` with ``[g] = lhs_g^T @ dout_g`` on JAX's transposed Mosaic kernel
    (output tiles ``[block_n, block_n]``) or, with ``warpgroups=2``, ``grouped_weight_grad_2wg``
    (output tiles ``[block_m, block_n]``)."""
    k, n = lhs.shape[1], dout.shape[1]
    block_k = config.block_k
    # The kernel reads whole row blocks of each group and masks the edge blocks by multiplying
    # with 0; padding keeps the last block inside the arrays, and the rows past the groups are
    # zeroed since NaN * 0 is NaN.
    if not config.zero_past_groups:
        valid = _rows_valid(lhs.shape[0], group_sizes)
        lhs = zero_unkept(valid, lhs, group_sizes)
        dout = zero_unkept(valid, dout, group_sizes)
    lhs, dout = _pad_rows(lhs, block_k), _pad_rows(dout, block_k)
    tiles = dict(block_n=_fit_block(config.block_n, n, "weight-gradient columns", _WGMMA_ROWS),
                 block_k=block_k, max_concurrent_steps=config.max_concurrent_steps,
                 grid_block_n=config.grid_block_n)
    num_sms = sm_count(config, target_device(array=lhs))
    with _interpreting(config):
        if config.warpgroups == 2:
            from sparsemixer_jax.kernels import grouped_matmul_2wg

            return grouped_matmul_2wg.grouped_weight_grad_2wg(
                lhs, dout, group_sizes, num_programs=num_sms, **tiles,
                block_m=_fit_block(config.block_m, k, "weight-gradient rows", _WGMMA_ROWS))
        return transposed_ragged_dot(
            lhs, dout, group_sizes=group_sizes, num_sms=num_sms, **tiles,
            block_m=_fit_block(config.block_n, k, "weight-gradient rows", _WGMMA_ROWS))


def _varying_axes(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (none outside it)."""
    return jax.typeof(x).manual_axis_type.varying


def _vary_over(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` marked as varying over ``axes`` too (``pcast``'s transpose sums over them)."""
    missing = tuple(sorted(axes - _varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _xla_matmul(lhs, rhs, group_sizes) -> jax.Array:
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def _xla_weight_grad(lhs, dout, group_sizes) -> jax.Array:
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(lhs, dout, group_sizes, numbers,
                                     preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def _tokamax_matmul(lhs, rhs, group_sizes) -> jax.Array:
    try:
        import tokamax
    except ImportError as err:
        raise ImportError(
            "grouped matmul impl='tokamax' needs the tokamax package: pip install -r "
            f"requirements-tokamax.txt; or use impl='mosaic' or 'xla' ({err})") from err
    # Output in the operand dtype: tokamax's VJP multiplies the cotangent with the operands,
    # and with a float32 output (preferred_element_type) it meets bfloat16 weights there.
    return tokamax.ragged_dot(lhs, rhs, group_sizes)


@functools.cache
def _build(config: GroupedMatmulConfig) -> Callable:
    """The custom-VJP grouped matmul of ``config`` on operands already in the compute dtype."""
    mosaic = config.impl == "mosaic"

    def product(lhs, rhs, group_sizes, transpose_rhs=False):
        if mosaic:
            return mosaic_matmul(lhs, rhs, group_sizes, config, transpose_rhs)
        return _xla_matmul(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)

    @jax.custom_vjp
    def gmm(lhs, rhs, group_sizes):
        return product(lhs, rhs, group_sizes)

    def fwd(lhs, rhs, group_sizes):
        return product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(res, dout):
        lhs, rhs, group_sizes = res
        dout = dout.astype(lhs.dtype)
        dlhs = product(dout, rhs, group_sizes, transpose_rhs=True)
        if config.resolved_weight_grad(*rhs.shape[1:]) == "kernel":
            drhs = mosaic_weight_grad(lhs, dout, group_sizes, config)
        else:
            drhs = _xla_weight_grad(lhs, dout, group_sizes)
        # A Pallas kernel's result does not say which mesh axes it varies over; a custom VJP's
        # cotangents must vary exactly as their primals do.
        dlhs = _vary_over(dlhs, _varying_axes(lhs))
        drhs = _vary_over(drhs.astype(rhs.dtype), _varying_axes(rhs))
        return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)

    gmm.defvjp(fwd, bwd)
    return gmm


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
) -> jax.Array:
    """Grouped matmul ``[M, K] x [G, K, N] -> [M, N]`` with a custom VJP (module docstring).

    Args:
      lhs: ``[M, K]`` rows sorted by group.
      rhs: ``[G, K, N]`` one matrix per group.
      group_sizes: int ``[G]``, rows per group, ``sum <= M``; rows past the sum output zeros.
      config: implementation and tiles.

    Returns: ``[M, N]`` in ``config.operand_dtype(lhs.dtype)``. Gradients flow to ``lhs`` and
    ``rhs`` (cast back to their dtypes by the casts' own transposes).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: expected lhs [M, K] and rhs [G, K, N], got "
                         f"{lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must be [{rhs.shape[0]}], got "
                         f"{group_sizes.shape}")
    if config.impl == "mosaic":
        check_grouped_supported(target_device(array=lhs), interpret=config.interpret)
    dtype = config.operand_dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    args = (lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
    # Under shard_map (expert parallelism) the operands vary over different mesh axes: tokens
    # are replicated over `expert`, the local experts' weights are not. All three vary over every
    # one of those axes inside the custom VJP, so its cotangents have one type, and the sum that
    # a replicated operand's gradient needs comes from pcast's transpose, outside it.
    axes = frozenset().union(*(_varying_axes(a) for a in args))
    args = tuple(_vary_over(a, axes) for a in args)
    if config.impl == "tokamax":  # differentiated by tokamax's own VJP
        return _tokamax_matmul(*args)
    return _build(config)(*args)
