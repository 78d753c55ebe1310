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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("mosaic", "xla", "tokamax")
WEIGHT_GRADS = ("auto", "kernel", "xla")
_MIN_BLOCK = 16


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


def check_grouped_supported(device: Any = None, *, interpret: bool = False) -> None:
    """Raises a one-line ValueError unless ``impl="mosaic"`` can run on ``device``.

    The Mosaic kernels use Hopper's wgmma and TMA: they need an sm90 NVIDIA GPU (H100, H200,
    GH200), or interpret mode (``interpret=True`` or JAX's ``force_gpu_interpret_mode``), which
    runs them on any backend. ``device`` defaults to ``jax.devices()[0]``.
    """
    if interpret or interpret_mode_active():
        return
    device = jax.devices()[0] if device is None else device
    platform = getattr(device, "platform", "?")
    kind = getattr(device, "device_kind", "?")
    if platform not in ("gpu", "cuda"):
        raise ValueError(
            f"grouped matmul impl='mosaic' needs an sm90 (Hopper) NVIDIA GPU, got platform "
            f"{platform!r} ({kind}); use impl='xla', or interpret=True to run the kernels in "
            f"the Mosaic GPU interpreter")
    capability = str(getattr(device, "compute_capability", "?"))
    if capability.split(".")[0] != "9":
        raise ValueError(
            f"grouped matmul impl='mosaic' needs an sm90 (Hopper) GPU, got {kind} (compute "
            f"capability {capability}); use impl='xla'")


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
    if kernel is None:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        kernel = transposed_ragged_dot_mgpu.transposed_ragged_dot
    k, n = lhs.shape[1], dout.shape[1]
    block_k = config.block_k
    # The kernel reads whole row blocks of each group; padding rows keeps the last block inside
    # the arrays (the masked tail rows are zero, see _mosaic_matmul).
    valid = _rows_valid(lhs.shape[0], group_sizes)
    lhs = _pad_rows(jnp.where(valid, lhs, 0), block_k)
    dout = _pad_rows(jnp.where(valid, dout, 0), block_k)
    with _interpreting(config):
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
        check_grouped_supported(interpret=config.interpret)
    dtype = config.operand_dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    if config.impl == "tokamax":  # differentiated by tokamax's own VJP
        return _tokamax_matmul(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
    return _build(config)(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
