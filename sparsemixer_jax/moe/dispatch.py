"""The expert FFN over rows sorted by expert: how rows reach their expert (dispatch).

One row per token and chosen expert goes through its expert MLP. Dispatch is chosen by name:

* ``"ragged"`` (:func:`ragged_ffn`): tokens sorted by expert, grouped matmul with
  :func:`jax.lax.ragged_dot`.
* ``"grouped"`` (:func:`grouped_ffn`): tokens sorted by expert, grouped matmuls with a custom
  VJP on the kernels of :mod:`sparsemixer_jax.kernels` (``grouped_impl``): JAX's Mosaic GPU
  kernels on Hopper GPUs (``"mosaic"``, the default), ``tokamax.ragged_dot`` (``"tokamax"``,
  optional package) or ``jax.lax.ragged_dot`` (``"xla"``). Padded only at the end of the sorted
  rows, to a whole tile. The kernels compute in bfloat16 (float16 stays float16). ``auto`` does
  not pick it until a GPU measurement shows it faster than ``padded`` (:data:`AUTO_DISPATCH`).
* ``"padded"`` (:func:`padded_ffn`): tokens sorted by expert into a block-padded layout: each
  expert's group is padded to a multiple of a block of ``b`` rows, every block belongs to one
  expert, and one batched matmul multiplies each block by its expert's weights. Dropless with at
  most ``rows + N * b`` rows (``b`` at most about ``rows / N``, down to ``rows / 4N`` while
  that is 128 rows or more: :func:`padded_block_rows`), so the work is at most about twice a
  dense FFN whatever ``N``, and a quarter more where the rows allow it. In capacity mode it is
  the Switch layout ``[N, capacity, emb]`` (one block per expert).
* ``"auto"``: per backend, from the measured table :data:`AUTO_DISPATCH`.

Why ``auto`` picks ``padded`` on CPU and GPU: there XLA lowers ``ragged_dot`` to a dense dot
over all ``N`` groups with the other groups' rows masked, so it costs about ``N`` dense FFNs,
while the block-padded layout stays near one to two; ``docs/benchmarks.md`` has the
measurements (``python -m experiments.bench_dispatch`` on CPU, ``python -m experiments.benchmark
--sections moe_vs_dense`` on an H100). On a GPU ``ragged_dot`` can lower to grouped kernels
instead (:mod:`sparsemixer_jax.kernels.triton_ragged_dot`); then ``auto`` picks ``ragged``.

Randomness: the router key and the dropout key come from the module's own ``router`` and
``dropout`` RNG streams. Dropout masks are drawn per row from ``fold_in(key, row_id)`` with
``row_id = token_index * k + t`` for the token's ``t``-th expert (the token index when k = 1),
so they do not depend on where a token is computed (dispatch layout, device): the expert-parallel
layer (:mod:`sparsemixer_jax.moe.expert_parallel`) gives the same result as one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp

from sparsemixer_jax.kernels.mosaic_grouped_matmul import (
    GroupedMatmulConfig,
    grouped_matmul,
    interpret_mode_active,
    zero_unkept,
)

DISPATCHES = ("auto", "ragged", "padded", "grouped")
GROUPED_IMPLS = ("mosaic", "mosaic_2wg", "xla", "tokamax")
# ``"mosaic_2wg"``: the Mosaic kernels with two consumer warpgroups per program
# (:mod:`sparsemixer_jax.kernels.grouped_matmul_2wg`) on the 128 x 256 x 64 tiles they are for.
_TWO_WARPGROUPS = {"impl": "mosaic", "warpgroups": 2, "block_n": 256}
# The expert (and dense) FFN's nonlinearity: ReLU in the paper's fairseq translation Transformer,
# GELU in BERT / ELECTRA / COCO-LM, whose setting the pretraining experiment follows; SiLU in the
# gated (SwiGLU) experts of the decoder-only language models (Mixtral, Qwen, OLMoE, Phi-3.5-MoE).
ACTIVATIONS = ("relu", "gelu", "tanh", "silu")
# Suffix of the internal activation name of gated experts: ``"silu_glu"`` maps the fused hidden
# ``[..., 2 * mlp]`` (gate half first, then up) to ``silu(gate) * up`` ``[..., mlp]``.
GLU_SUFFIX = "_glu"
# gpt-oss's clamped SwiGLU, named with its two constants (gated experts only): see
# :func:`clamped_swiglu`.
_CLAMPED_SWIGLU = re.compile(r"clamped_swiglu\(limit=([^,]+),alpha=([^)]+)\)")


def clamped_swiglu(limit: float, alpha: float) -> str:
    """The activation name of gpt-oss's experts (gated experts only): of the gate ``g`` and up
    ``u`` halves, ``g' * sigmoid(alpha * g') * (u' + 1)`` with ``g' = min(g, limit)`` and
    ``u' = clip(u, -limit, limit)`` (transformers' ``GptOssExperts``)."""
    return f"clamped_swiglu(limit={float(limit)!r},alpha={float(alpha)!r})"


def is_activation(name: str) -> bool:
    """Whether ``name`` is in :data:`ACTIVATIONS` or a :func:`clamped_swiglu` name."""
    return name in ACTIVATIONS or bool(_CLAMPED_SWIGLU.fullmatch(name))


def _clamped_swiglu_glu(limit: float, alpha: float):
    def glu(h: jax.Array) -> jax.Array:
        gate, up = jnp.split(h, 2, axis=-1)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)

    return glu


def activation_fn(name: str):
    """The function ``name`` names: ``jax.nn.relu``, exact (erf) ``jax.nn.gelu`` (BERT's GELU,
    not the tanh approximation), ``tanh`` or ``jax.nn.silu``; ``"<name>_glu"`` is its gated
    form, ``[..., 2 * m] -> [..., m]``: ``act(h[..., :m]) * h[..., m:]`` (a
    :func:`clamped_swiglu` name has only a gated form)."""
    if name.endswith(GLU_SUFFIX):
        clamped = _CLAMPED_SWIGLU.fullmatch(name[: -len(GLU_SUFFIX)])
        if clamped:
            return _clamped_swiglu_glu(float(clamped[1]), float(clamped[2]))
        act = activation_fn(name[: -len(GLU_SUFFIX)])

        def glu(h: jax.Array) -> jax.Array:
            gate, up = jnp.split(h, 2, axis=-1)
            return act(gate) * up

        return glu
    if name == "silu":
        return jax.nn.silu
    if name == "relu":
        return jax.nn.relu
    if name == "gelu":
        return lambda h: jax.nn.gelu(h, approximate=False)
    if name == "tanh":  # the router benchmark's smallest expert family
        return jnp.tanh
    if _CLAMPED_SWIGLU.fullmatch(name):
        raise ValueError(f"activation {name!r} is for gated experts only")
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")


# What ``dispatch="auto"`` runs on each backend, from measurements (forward + backward of one
# MoE layer against the dense FFN of the same width, N = 2, 4, 8, 16):
# * cpu: "padded". ``python -m experiments.bench_dispatch`` on 2 cores of an AMD EPYC, jax 0.10.2,
#   float32, 4096 tokens, emb 512, mlp 2048: ragged / padded = 1.8x, 2.5x, 3.8x, 6.3x (module
#   docstring).
# * gpu: "padded". ``python -m experiments.benchmark --backend cuda --sections moe_vs_dense`` on
#   one H100 80GB, jax 0.11.2, CUDA 13, bf16, 32,768 tokens, emb 512, mlp 2048
#   (docs/benchmarks.md): ragged 147-203 ms, padded 4.3-4.9 ms, dense 1.7 ms. XLA:GPU lowers
#   ragged_dot to a dense dot over all groups; with the grouped Pallas/Triton lowering on
#   ("ragged" below) it is unmeasured.
# * tpu: "ragged" (lowers to TPU's native ragged dot). NOT measured: no TPU was available.
AUTO_DISPATCH = {"cpu": "padded", "gpu": "padded", "tpu": "ragged"}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
    """The concrete dispatch (``"ragged"`` or ``"padded"``) for ``dispatch`` on ``backend``.

    ``backend`` is a JAX platform name (default: ``jax.default_backend()``); ``"cuda"`` and
    ``"rocm"`` count as ``"gpu"``, unknown platforms get ``"padded"`` (dropless, at most about
    twice a dense FFN whatever the lowering). On a GPU ``auto`` picks ``"ragged"`` only while
    ``ragged_dot``'s grouped Pallas/Triton lowering is on
    (:func:`sparsemixer_jax.kernels.triton_ragged_dot.enable_triton_ragged_dot`).
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown dispatch {dispatch!r}; expected one of {DISPATCHES}")
    if dispatch != "auto":
        return dispatch
    backend = backend or jax.default_backend()
    if backend in _GPU_PLATFORMS:
        from sparsemixer_jax.kernels.triton_ragged_dot import triton_ragged_dot_enabled

        return "ragged" if triton_ragged_dot_enabled() else AUTO_DISPATCH["gpu"]
    return AUTO_DISPATCH.get(backend, "padded")


def expert_capacity(capacity_factor: float, num_tokens: int, num_experts: int) -> int:
    """Switch capacity ``ceil(capacity_factor * num_tokens / num_experts)`` (at least 1)."""
    return max(1, math.ceil(capacity_factor * num_tokens / num_experts))


def _rank_in_group(group: jax.Array, num_groups: int) -> jax.Array:
    """For int ``group`` ``[R]``, the number of earlier rows in the same group: int32 ``[R]``.

    Rows with ``group >= num_groups`` (the "no group" sentinel) get an unspecified rank.
    """
    one_hot = jax.nn.one_hot(group, num_groups, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=-1)


def _add_bias(h: jax.Array, bias: jax.Array | None, index, *, block: bool = False) -> jax.Array:
    """``h + bias[index]`` per row (``block``: per block of rows, ``h [K, b, m]``); ``h`` itself
    where the experts have no biases (gated experts), so they add no zeros."""
    if bias is None:
        return h
    b = bias[index]
    return h + (b[:, None, :] if block else b)


def row_dropout(
    h: jax.Array, token_ids: jax.Array, key: jax.Array | None, rate: float
) -> jax.Array:
    """Inverted dropout on ``h`` ``[..., mlp]`` with one mask per token id ``[...]``.

    The mask of a row depends only on ``key`` and its token id, not on the row's position, so
    every dispatch layout and mesh drops the same units.
    """
    if key is None or rate <= 0.0:
        return h
    flat_ids = token_ids.reshape(-1)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, flat_ids)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, (h.shape[-1],)))(keys)
    keep = keep.reshape(h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0.0).astype(h.dtype)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("x", "group", "token_ids", "wi", "bi", "wo", "bo", "drop_key"),
                   meta_fields=("rate",))
@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """What every dispatch function takes: the rows, the experts they go to, and the dropout
    between the experts' two matmuls (a pytree; ``rate`` is static).

    Attributes:
      x: ``[R, emb]`` rows.
      group: int ``[R]``, expert of each row in ``[0, G)``; ``G`` or more: no expert (dropped by
        capacity, padding), the row outputs zeros.
      token_ids: int ``[R]``, global row ids that seed the dropout masks (:func:`row_dropout`).
      wi, bi, wo, bo: ``[G, emb, mlp]``, ``[G, mlp]``, ``[G, mlp, emb]``, ``[G, emb]``; the
        biases None where the experts have none (:func:`ungate`).
      drop_key, rate: activation dropout key (None: no dropout) and rate.
    """

    x: jax.Array
    group: jax.Array
    token_ids: jax.Array
    wi: jax.Array
    bi: jax.Array | None
    wo: jax.Array
    bo: jax.Array | None
    drop_key: jax.Array | None = None
    rate: float = 0.0


def ragged_ffn(rows: ExpertRows, activation: str = "relu") -> jax.Array:
    """Each row through its expert: rows sorted by expert, grouped matmuls with ``ragged_dot``.
    Returns ``[R, emb]``.
    """
    x, group, token_ids, wi, bi, wo, bo = (rows.x, rows.group, rows.token_ids, rows.wi, rows.bi,
                                           rows.wo, rows.bo)
    num_groups = wi.shape[0]
    order = jnp.argsort(group, stable=True)  # sentinel rows (group == G) sort last
    sorted_group = group[order]
    group_sizes = jnp.bincount(group, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    safe = jnp.minimum(sorted_group, num_groups - 1)
    h = _add_bias(jax.lax.ragged_dot(x[order], wi, group_sizes), bi, safe)
    h = row_dropout(activation_fn(activation)(h), token_ids[order], rows.drop_key, rows.rate)
    y = _add_bias(jax.lax.ragged_dot(h, wo, group_sizes), bo, safe)
    y = jnp.where((sorted_group < num_groups)[:, None], y, 0)
    # Undo the sort with a scatter (its transpose is a gather, cheaper than a second argsort).
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def padded_block_rows(rows: int, num_groups: int) -> int:
    """Block size of the padded layout: a power of two near ``rows / num_groups``, in [8, 512],
    lowered towards ``rows / (4 num_groups)`` while that stays at least 128 rows.

    Padding costs at most ``num_groups * (block - 1)`` rows, and the layout computes them all
    (its block count is static); smaller blocks mean more blocks and so more gathered weight
    copies. ``rows / num_groups`` bounds both by about twice the dense cost;
    ``rows / (4 num_groups)`` bounds the padding by a quarter, and blocks of 128 rows or more
    keep the weight copies few (docs/benchmarks.md: at 4,096 rows and 8 experts, 128-row blocks
    made the CPU training step 1.15-1.25x faster than 512-row ones). From ``rows >= 2048
    num_groups`` both give 512.
    """
    groups = max(num_groups, 1)
    block = min(512, max(8, _power_of_two_at_most(rows // groups)))
    return min(block, max(128, _power_of_two_at_most(rows // (4 * groups))))


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n < 2``)."""
    return 1 << (max(1, n).bit_length() - 1)


def padded_ffn(rows: ExpertRows, capacity: int | None, activation: str = "relu", *,
               block_rows: int | None = None) -> jax.Array:
    """Each row through its expert in the block-padded layout: one batched matmul over blocks.

    Returns ``[R, emb]``. With ``capacity``: one block of ``capacity`` rows per group,
    the Switch ``[G, capacity, emb]`` layout, no weight gather; rows past the capacity output
    zeros. Dropless (``capacity=None``): blocks of ``block_rows`` rows, by default
    :func:`padded_block_rows`.
    """
    x, group, token_ids, wi, bi, wo, bo = (rows.x, rows.group, rows.token_ids, rows.wi, rows.bi,
                                           rows.wo, rows.bo)
    drop_key, rate = rows.drop_key, rows.rate
    rows, emb = x.shape
    num_groups = wi.shape[0]
    valid = group < num_groups
    rank = _rank_in_group(group, num_groups)
    if capacity is not None:
        valid = valid & (rank < capacity)  # over-capacity rows would spill into the next block
        block, num_blocks = capacity, num_groups
        slot = jnp.where(valid, group * capacity + rank, num_blocks * block + jnp.arange(rows))
        block_group = jnp.arange(num_groups)
    else:
        block = padded_block_rows(rows, num_groups) if block_rows is None else block_rows
        if block < 1:
            raise ValueError(f"padded_ffn: block_rows must be >= 1, got {block}")
        num_blocks = -(-rows // block) + num_groups  # sum_g ceil(n_g / b) <= ceil(R / b) + G
        counts = jnp.bincount(group, length=num_groups + 1)[:num_groups]
        padded = (counts + block - 1) // block * block
        start = jnp.cumsum(padded) - padded  # first slot of each group
        first = start[jnp.minimum(group, num_groups - 1)]
        slot = jnp.where(valid, first + rank, num_blocks * block + jnp.arange(rows))
        # Block k belongs to the group whose padded range holds slot k * b; blocks past the last
        # group hold no rows and reuse the last group's weights (their output is discarded).
        block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_blocks) * block,
                                       side="right")
        block_group = jnp.minimum(block_group, num_groups - 1)
    size = num_blocks * block
    # Rows without expert point past the end, each to its own slot, and are dropped: every slot
    # is unique and the scatter says so. Differentiating a scatter that may write a slot twice
    # makes JAX scatter an id per element, a uint32 array of the whole [size, emb] buffer.
    xb = jnp.zeros((size, emb), x.dtype).at[slot].set(x, mode="drop", unique_indices=True)
    ids = jnp.zeros((size,), token_ids.dtype).at[slot].set(token_ids, mode="drop",
                                                            unique_indices=True)
    xb = xb.reshape(num_blocks, block, emb)
    if capacity is not None:
        wi_b, wo_b, pick = wi, wo, slice(None)
    else:
        wi_b, wo_b, pick = wi[block_group], wo[block_group], block_group
    h = _add_bias(jnp.einsum("kbe,kem->kbm", xb, wi_b), bi, pick, block=True)
    h = row_dropout(activation_fn(activation)(h), ids.reshape(num_blocks, block), drop_key, rate)
    yb = _add_bias(jnp.einsum("kbm,kme->kbe", h, wo_b), bo, pick, block=True)
    y = yb.reshape(size, emb).at[slot].get(mode="fill", fill_value=0, unique_indices=True)
    return jnp.where(valid[:, None], y, 0)


def grouped_ffn(
    rows: ExpertRows,
    *,
    impl: str = "mosaic",
    activation: str = "relu",
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    max_concurrent_steps: int = 4,
    grid_block_n: int = 1,
    warpgroups: int = 1,
    weight_grad: str = "auto",
    interpret: bool = False,
    compute_dtype=None,
    num_sms: int | None = None,
) -> jax.Array:
    """Each row through its expert with grouped matmuls.

    Long only by its signature and arguments (the kernel's tuning knobs, passed through): the
    body, sorting rows by expert, two grouped matmuls and the way back, is about 40 lines.

    Args:
      rows: the rows, their experts and the dropout (:class:`ExpertRows`).
      activation: ``"relu"`` or ``"gelu"`` (:data:`ACTIVATIONS`).
      impl, block_m, block_n, block_k, max_concurrent_steps, grid_block_n, warpgroups,
        weight_grad, interpret, compute_dtype, num_sms: :class:`GroupedMatmulConfig`. With
        ``impl="mosaic"`` (and ``"tokamax"``) the matmul operands (``x``, ``wi``, the hidden
        activations, ``wo``) are cast to bfloat16 unless they are float16 (or to
        ``compute_dtype``); biases, ReLU and dropout run in that dtype too, as
        :func:`ragged_ffn` does in a bfloat16 model.

    Returns: ``[R, emb]`` in the dtype of ``x``, zeros on rows without expert.
    """
    config = GroupedMatmulConfig(
        impl=impl, block_m=block_m, block_n=block_n, block_k=block_k,
        max_concurrent_steps=max_concurrent_steps, grid_block_n=grid_block_n,
        warpgroups=warpgroups, weight_grad=weight_grad, interpret=interpret,
        compute_dtype=compute_dtype, num_sms=num_sms)
    x, group, token_ids, wi, bi, wo, bo = (rows.x, rows.group, rows.token_ids, rows.wi, rows.bi,
                                           rows.wo, rows.bo)
    drop_key, rate = rows.drop_key, rows.rate
    rows = x.shape[0]
    num_groups = wi.shape[0]
    dtype = config.operand_dtype(jnp.result_type(x.dtype, wi.dtype))
    group = group.astype(jnp.int32)
    order = jnp.argsort(group, stable=True)  # rows without expert sort last
    group_sizes = jnp.bincount(group, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    # Pad once here (gather the pad rows from row 0: they lie past the groups and are ignored)
    # so the kernels get whole row tiles without copying the activations again.
    padded_rows = -(-rows // block_m) * block_m if impl == "mosaic" else rows
    gather, sorted_group = order, group[order]
    if padded_rows > rows:
        # Only where there is padding: under expert parallelism, in a differentiated scan, a
        # zero-size array here becomes a zero-size residual between the two parts JAX splits
        # the shard_map into, and XLA's Shardy import crashes on it (a segmentation fault in
        # ManualComputationUnusedInputsPattern, jax 0.11.2; lab/shardy_zero_size_residual.py).
        gather = jnp.concatenate([order, jnp.zeros((padded_rows - rows,), order.dtype)])
        sorted_group = jnp.concatenate(
            [sorted_group, jnp.full((padded_rows - rows,), num_groups, jnp.int32)])
    served = group < num_groups  # [rows]: rows an expert serves
    valid = sorted_group < num_groups  # [padded_rows]: exactly the rows inside the groups
    position = jnp.zeros((rows,), jnp.int32).at[order].set(
        jnp.arange(rows, dtype=jnp.int32), unique_indices=True)  # sorted position of each row
    safe = jnp.minimum(sorted_group, num_groups - 1)

    # The rows move by gathers both ways (each permutation's transpose is the other's gather):
    # no scatter, no zero-filled buffer. Rows past the groups are zero in the sorted operands
    # and their cotangents, which lets the kernels' weight gradients skip masking them.
    config = dataclasses.replace(config, zero_past_groups=True)
    xs = move_rows(x.astype(dtype), gather, valid, position, served)
    # Only the hidden activations are kept for the activation's backward pass, not its
    # intermediate products (prevent_cse=False: XLA may fuse the recomputation).
    activate = jax.checkpoint(activation_fn(activation), prevent_cse=False)
    h = grouped_matmul(xs, wi.astype(dtype), group_sizes, config)
    h = _add_bias(h, None if bi is None else bi.astype(dtype), safe)
    h = row_dropout(activate(h), token_ids[gather], drop_key, rate)
    y = _add_bias(grouped_matmul(h, wo.astype(dtype), group_sizes, config),
                  None if bo is None else bo.astype(dtype), safe)
    # Back to row order; rows without expert output zeros.
    return move_rows(y, position, served, gather, valid).astype(x.dtype)


@jax.custom_vjp
def move_rows(x: jax.Array, take: jax.Array, keep: jax.Array, take_back: jax.Array,
              keep_back: jax.Array) -> jax.Array:
    """``where(keep, x[take], 0)``: rows of ``x [R, d]`` moved to ``[len(take), d]``.

    ``take_back [R]`` and ``keep_back [R]`` describe the inverse: every row ``r`` of ``x`` is
    read by at most one kept output row, ``take_back[r]``, and by none unless ``keep_back[r]``.
    The transpose is then the gather ``where(keep_back, g[take_back], 0)``, not a scatter-add
    into zeros, and nothing but the indices is kept for the backward pass.
    """
    return zero_unkept(keep[:, None], x[take], take).astype(x.dtype)


def _move_rows_fwd(x, take, keep, take_back, keep_back):
    return move_rows(x, take, keep, take_back, keep_back), (take, keep, take_back, keep_back)


def _move_rows_bwd(residuals, cotangent):
    take, keep, take_back, keep_back = residuals
    return move_rows(cotangent, take_back, keep_back, take, keep), None, None, None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def expert_ffn(
    x: jax.Array,
    group: jax.Array,
    token_ids: jax.Array,
    params: tuple[jax.Array, ...],
    *,
    dispatch: str,
    dropout_key: jax.Array | None = None,
    dropout_rate: float = 0.0,
    capacity: int | None = None,
    grouped_impl: str = "mosaic",
    activation: str = "relu",
    block_rows: int | None = None,
) -> jax.Array:
    """Each row through its expert: ``Dense -> activation -> dropout -> Dense``.

    Args:
      x: ``[R, emb]`` rows in the compute dtype.
      group: int32 ``[R]``, the expert of each row in ``[0, G)``; ``G`` (or more) means "no
        expert": the row outputs zeros.
      token_ids: int32 ``[R]``, a global id per row that seeds its dropout mask.
      params: ``(wi [G, emb, mlp], bi [G, mlp], wo [G, mlp, emb], bo [G, emb])`` in the compute
        dtype, or for gated experts without biases (:func:`is_gated`)
        ``(w_gate [G, emb, mlp], w_up [G, emb, mlp], w_down [G, mlp, emb])``:
        ``(act(x w_gate) * (x w_up)) w_down``, with ``activation`` as ``act`` (SwiGLU with
        ``"silu"``).
      dispatch: ``"ragged"``, ``"padded"`` or ``"grouped"``.
      dropout_key: key of the activation dropout, or None for no dropout.
      capacity: ``"padded"`` only: the Switch layout with this many slots per group; rows past
        it (in row order) output zeros. The layer drops tokens before (``capacity_keep``), so
        its groups always fit.
      grouped_impl: ``"grouped"`` only: ``"mosaic"`` (Hopper kernels; interpreted on any
        backend inside ``force_gpu_interpret_mode()``), ``"mosaic_2wg"`` (the same with two
        consumer warpgroups on 128 x 256 tiles), ``"tokamax"`` or ``"xla"``
        (:data:`GROUPED_IMPLS`). The first two compute in bfloat16 (float16 stays float16); a
        float32 ``x`` gets a one-line warning saying so.
      activation: a name in :data:`ACTIVATIONS`.
      block_rows: ``"padded"`` dropless only: rows per block, default
        :func:`padded_block_rows`.

    Returns: ``[R, emb]`` in the dtype of ``x``, zeros on rows without expert.
    """
    wi, bi, wo, bo, activation = ungate(params, activation)
    rows = ExpertRows(x, group.astype(jnp.int32), token_ids, wi, bi, wo, bo, dropout_key,
                      dropout_rate)
    if dispatch == "ragged":
        return ragged_ffn(rows, activation)
    if dispatch == "padded":
        return padded_ffn(rows, capacity, activation, block_rows=block_rows)
    if dispatch == "grouped":
        if grouped_impl != "xla" and jnp.dtype(x.dtype) == jnp.float32:
            warnings.warn(
                f"dispatch='grouped' with grouped_impl={grouped_impl!r} computes the expert FFN "
                "in bfloat16 (its kernels take 16-bit operands), not in the layer's float32 "
                "(config.model.compute_dtype); set compute_dtype='bfloat16', or "
                "grouped_impl='xla' for float32", stacklevel=2)
        kernel = _TWO_WARPGROUPS if grouped_impl == "mosaic_2wg" else {"impl": grouped_impl}
        return grouped_ffn(rows, activation=activation, **kernel,
                           interpret=kernel["impl"] == "mosaic" and interpret_mode_active())
    raise ValueError(
        f"expert_ffn: dispatch must be 'ragged', 'padded' or 'grouped', got {dispatch!r}")


def is_gated(params: tuple[jax.Array, ...]) -> bool:
    """Whether expert params are the gated ``(w_gate, w_up, w_down)`` (three arrays; with
    biases ``(w_gate, w_up, w_down, b_gate, b_up, b_down)``, six) rather than
    ``(wi, bi, wo, bo)``."""
    if len(params) not in (3, 4, 6):
        raise ValueError(f"expert params must be (wi, bi, wo, bo), (w_gate, w_up, w_down) or "
                         f"(w_gate, w_up, w_down, b_gate, b_up, b_down), got {len(params)} "
                         "arrays")
    return len(params) != 4


def ungate(params: tuple[jax.Array, ...], activation: str):
    """``(wi, bi, wo, bo, activation)`` the dispatch functions take, for either kind of expert.

    Gated experts become one first matmul with ``wi = [w_gate | w_up]`` ``[G, emb, 2 * mlp]``
    and the activation ``activation + "_glu"`` that splits its output again (gate half first,
    as Hugging Face's fused ``gate_up_proj`` is laid out); biases are None (none is added)
    unless the experts have them (``bi = [b_gate | b_up]``, ``bo = b_down``). One wide matmul
    instead of two reads the rows once, and every dispatch (and the grouped kernels) takes it
    unchanged.
    """
    if not is_gated(params):
        return (*params, activation)
    w_gate, w_up, w_down = params[:3]
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gated experts: w_gate {w_gate.shape} and w_up {w_up.shape} differ")
    bi = bo = None
    if len(params) == 6:
        b_gate, b_up, bo = params[3:]
        bi = jnp.concatenate([b_gate, b_up], axis=-1)
    return (jnp.concatenate([w_gate, w_up], axis=-1), bi, w_down, bo, activation + GLU_SUFFIX)


def capacity_keep(
    expert: jax.Array, active: jax.Array, num_experts: int, capacity: int
) -> jax.Array:
    """Switch-style dropping: bool ``[...]``, True for tokens among the first ``capacity``
    active tokens (in flattened token order) routed to their expert.

    ``expert`` int ``[...]``, ``active`` bool ``[...]`` (padding is False and takes no slot).
    """
    flat_expert = jnp.where(active, expert, num_experts).reshape(-1)
    rank = _rank_in_group(flat_expert, num_experts)
    return (active.reshape(-1) & (rank < capacity)).reshape(expert.shape)
