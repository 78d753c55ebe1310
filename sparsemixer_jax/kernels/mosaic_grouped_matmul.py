"""Grouped matmul with a custom VJP whose three products run on JAX's Mosaic GPU Pallas kernels.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``: rows of ``lhs`` are
sorted by group, group ``g`` owns the next ``group_sizes[g]`` rows and is multiplied by
``rhs[g]``; rows past ``sum(group_sizes)`` output zeros (as :func:`jax.lax.ragged_dot`).

Implementations (``GroupedMatmulConfig.impl``):

* ``"mosaic"``: Hopper (sm90) only, or the Mosaic GPU interpreter on CPU.

  - forward ``lhs @ rhs[g]``: ``ragged_dot_mgpu.ragged_dot``;
  - input gradient ``dout @ rhs[g]^T``: the same kernel on the weights transposed to
    ``[G, N, K]`` by XLA (the kernel's ``transpose_rhs=True`` form would skip that copy, but the
    interpreter cannot run transposed wgmma operands, so only the form that is tested is used;
    the copy is ``G * K * N`` elements, small next to the activations);
  - weight gradient ``lhs_g^T @ dout_g``: ``transposed_ragged_dot_mgpu.transposed_ragged_dot``
    (``weight_grad="kernel"``), GPU only: the interpreter fails on it (transposed wgmma
    operands, ``layout_cast``, and a crash in XLA:CPU's compiler on its host code). Under
    interpret mode the weight gradient is the XLA formulation (``weight_grad="xla"``); the
    kernel path has a GPU-only test and a CPU test of its padding and masking with the kernel
    swapped for its reference.

  The kernels take one dtype for both operands and write their output in it (accumulating in
  float32): operands are cast to ``compute_dtype`` (bfloat16 or float16), the output is in
  ``compute_dtype``.
* ``"xla"``: the same custom VJP with :func:`jax.lax.ragged_dot` (and ``ragged_dot_general``
  for the weight gradient) as the three products, float32 accumulation, output rounded to the
  operand dtype: the reference formulation, runs on every backend.
* ``"tokamax"``: ``tokamax.ragged_dot`` (its own kernels and VJP; the operands are cast as for
  ``"mosaic"``). tokamax needs Python >= 3.12 and jax >= 0.11.1 and is imported only when
  asked for; where it is missing the call raises an ImportError saying so.

Shape rules of the kernels, met here: ``K`` a multiple of ``block_k`` (blocks shrink to a power
of two dividing the width, at least 16, else a ValueError); the rows are padded to a multiple
of ``block_m`` when they are not already (:func:`sparsemixer_jax.kernels.grouped_ffn` pads
once up front so no copy happens here). ``ragged_dot_mgpu`` hard-codes 132 SMs (H100 SXM,
H200); on a GPU with fewer SMs its persistent grid still computes the right result, in more
waves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("mosaic", "xla", "tokamax")
WEIGHT_GRADS = ("auto", "kernel", "xla")
_MIN_BLOCK = 16
_H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static settings of :func:`grouped_matmul` (hashable: one compiled VJP per config).

    Attributes:
      impl: ``"mosaic"``, ``"xla"`` or ``"tokamax"`` (module docstring).
      block_m: rows per kernel tile; rows are padded to a multiple of it.
      block_n, block_k: output-feature and contraction tiles, shrunk to a power of two that
        divides the width when they do not.
      max_concurrent_steps, grid_block_n: pipelining depth and tile-order swizzle of the
        kernels.
      weight_grad: ``"kernel"`` (transposed Mosaic kernel, GPU only), ``"xla"``, or ``"auto"``
        (``"xla"`` in interpret mode, else ``"kernel"``). Ignored by ``impl="xla"``.
      interpret: run the Mosaic kernels in JAX's Mosaic GPU interpreter (CPU, tests).
      num_sms: SMs of the weight-gradient kernel's persistent grid; None: the target
        device's ``core_count``, else 132 (:func:`sm_count`).
      compute_dtype: operand dtype of the kernels; None: float16 stays float16, everything else
        is cast to bfloat16 (``"mosaic"``), or no cast at all (``"xla"``).
    """

    impl: str = "mosaic"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1
    weight_grad: str = "auto"
    interpret: bool = False
    compute_dtype: Any = None
    num_sms: int | None = None

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
        if self.compute_dtype is not None:
            # Canonical and hashable, so equal configs share one compiled function.
            object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))

    def operand_dtype(self, dtype) -> jnp.dtype:
        """The dtype the operands of this config's products are cast to."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        dtype = jnp.dtype(dtype)
        if self.impl == "xla":
            return dtype
        return dtype if dtype in (jnp.float16, jnp.bfloat16) else jnp.dtype(jnp.bfloat16)

    def resolved_weight_grad(self) -> str:
        if self.impl != "mosaic":
            return "xla"
        if self.weight_grad == "auto":
            return "xla" if self.interpret else "kernel"
        return self.weight_grad


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

    ``device``; else the first device of ``mesh``; else of ``array`` (a committed concrete
    array); else of the mesh in context (``jax.set_mesh``: its devices outside ``jit``, its
    ``AbstractDevice`` inside); else ``jax.config.jax_default_device``; else
    ``jax.devices()[0]``. A compile-only device (``jax.experimental.topologies``) set in any of
    these places is what is asked, so a CPU host can build for an H100 without one.
    """
    if device is not None:
        return device
    if mesh is not None:
        return mesh.devices.flat[0]
    if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
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
    """Streaming multiprocessors the weight-gradient kernel's persistent grid spans.

    ``config.num_sms`` when set; else the target device's ``core_count`` (GPU devices, their
    ``AbstractDevice.num_cores`` inside ``jit``); else 132, the SM count of H100 SXM5 and H200
    (NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3; H200 is the same GH100 die).
    """
    if config.num_sms is not None:
        return config.num_sms
    device = target_device(device)
    count = getattr(device, "core_count", None) or getattr(device, "num_cores", None)
    return int(count) if count else _H100_SMS


class _JaxWithDevice:
    """The ``jax`` module as ``transposed_ragged_dot_mgpu`` sees it while it builds its grid.

    That kernel sizes its persistent grid with ``jax.devices()[0].core_count``: the first
    device of the default backend, which on a CPU host (the interpreter, a compile-only H100
    target) is a CPU without ``core_count``. It has no argument for it, so for the duration
    of one call its module-level ``jax`` is this view, whose ``devices()`` answers with the
    SM count of the device the computation targets; every other name is ``jax``'s own.
    """

    def __init__(self, num_sms: int):
        self._device = types.SimpleNamespace(core_count=num_sms)

    def devices(self, *args, **kwargs):
        del args, kwargs
        return [self._device]

    def __getattr__(self, name):
        return getattr(jax, name)


@contextlib.contextmanager
def _kernel_sm_count(module: types.ModuleType, num_sms: int):
    seen = module.jax
    module.jax = _JaxWithDevice(num_sms)
    try:
        yield
    finally:
        module.jax = seen


def _fit_block(block: int, dim: int, what: str) -> int:
    """The largest power of two <= ``block`` dividing ``dim`` (the kernels need whole tiles)."""
    while block >= _MIN_BLOCK:
        if dim % block == 0:
            return block
        block //= 2
    raise ValueError(
        f"grouped matmul impl='mosaic': {what}={dim} must be a multiple of {_MIN_BLOCK}")


def _rows_valid(rows: int, group_sizes: jax.Array) -> jax.Array:
    """bool ``[rows, 1]``: True on rows that belong to a group."""
    return (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]


def _pad_rows(a: jax.Array, multiple: int) -> jax.Array:
    pad = -a.shape[0] % multiple
    return a if pad == 0 else jnp.pad(a, [(0, pad), (0, 0)])


def _interpreting(config: GroupedMatmulConfig):
    if not config.interpret:
        return contextlib.nullcontext()
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

    return interpret_params.force_gpu_interpret_mode()


def _mosaic_matmul(lhs, rhs, group_sizes, config: GroupedMatmulConfig) -> jax.Array:
    """``ragged_dot_mgpu`` on ``lhs [M, K]``, ``rhs [G, K, N]``; rows past the groups: zeros."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    rows, k = lhs.shape
    n = rhs.shape[-1]
    out = None
    with _interpreting(config):
        out = ragged_dot_mgpu.ragged_dot(
            _pad_rows(lhs, config.block_m), rhs, group_sizes=group_sizes.astype(jnp.int32),
            block_m=config.block_m, block_n=_fit_block(config.block_n, n, "output width"),
            block_k=_fit_block(config.block_k, k, "contraction width"),
            max_concurrent_steps=config.max_concurrent_steps,
            grid_block_n=config.grid_block_n)
    # The kernel never writes rows outside the groups (uninitialised memory, NaN in the
    # interpreter), and a NaN there would poison the transposed kernel's masked products.
    return jnp.where(_rows_valid(rows, group_sizes), out[:rows], 0)


def _mosaic_weight_grad(lhs, dout, group_sizes, config: GroupedMatmulConfig,
                        kernel: Callable | None = None) -> jax.Array:
    """``[G, K, N]`` with ``[g] = lhs_g^T @ dout_g`` on ``transposed_ragged_dot_mgpu``.

    ``kernel`` replaces the Mosaic kernel (same signature) so the padding around it can be
    tested where the kernel cannot run.
    """
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    if kernel is None:
        kernel = transposed_ragged_dot_mgpu.transposed_ragged_dot
    k, n = lhs.shape[1], dout.shape[1]
    block_k = config.block_k
    # The kernel reads whole row blocks of each group; padding rows keeps the last block inside
    # the arrays (the masked tail rows are zero, see _mosaic_matmul).
    valid = _rows_valid(lhs.shape[0], group_sizes)
    lhs = _pad_rows(jnp.where(valid, lhs, 0), block_k)
    dout = _pad_rows(jnp.where(valid, dout, 0), block_k)
    with _interpreting(config), _kernel_sm_count(transposed_ragged_dot_mgpu, sm_count(config)):
        return kernel(
            lhs, dout, group_sizes=group_sizes.astype(jnp.int32),
            block_m=_fit_block(config.block_n, k, "weight-gradient rows"),
            block_n=_fit_block(config.block_n, n, "weight-gradient columns"),
            block_k=block_k, max_concurrent_steps=config.max_concurrent_steps,
            grid_block_n=config.grid_block_n)


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
            "grouped matmul impl='tokamax' needs the tokamax package (Python >= 3.12, jax >= "
            f"0.11.1): pip install tokamax; or use impl='mosaic' or 'xla' ({err})") from err
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


@functools.cache
def _build(config: GroupedMatmulConfig) -> Callable:
    """The custom-VJP grouped matmul of ``config`` on operands already in the compute dtype."""
    mosaic = config.impl == "mosaic"
    weight_grad = config.resolved_weight_grad()

    def product(lhs, rhs, group_sizes):
        if mosaic:
            return _mosaic_matmul(lhs, rhs, group_sizes, config)
        return _xla_matmul(lhs, rhs, group_sizes)

    @jax.custom_vjp
    def gmm(lhs, rhs, group_sizes):
        return product(lhs, rhs, group_sizes)

    def fwd(lhs, rhs, group_sizes):
        return product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(res, dout):
        lhs, rhs, group_sizes = res
        dout = dout.astype(lhs.dtype)
        dlhs = product(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)
        if weight_grad == "kernel":
            drhs = _mosaic_weight_grad(lhs, dout, group_sizes, config)
        else:
            drhs = _xla_weight_grad(lhs, dout, group_sizes)
        return dlhs, drhs.astype(rhs.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)

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
    if config.impl == "tokamax":  # differentiated by tokamax's own VJP
        return _tokamax_matmul(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
    return _build(config)(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
