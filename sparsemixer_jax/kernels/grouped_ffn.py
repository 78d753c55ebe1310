"""Expert FFN on grouped matmuls: the ``"grouped"`` dispatch of the MoE layer.

Same contract as ``moe._ragged_ffn`` (see ``moe.expert_ffn``): rows sorted by expert, ``Dense ->
ReLU -> dropout -> Dense`` with per-expert weights and biases, the same per-row dropout masks,
zeros on rows without expert, unsorted at the end. The two products are
:func:`~sparsemixer_jax.kernels.mosaic_grouped_matmul.grouped_matmul` (Mosaic GPU kernels on
Hopper, or the XLA reference). Groups need not align to tiles: the forward kernel handles ragged
group boundaries itself, so the sorted rows are only padded at the end, to a multiple of
``block_m``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.kernels.mosaic_grouped_matmul import GroupedMatmulConfig, grouped_matmul
from sparsemixer_jax.moe import _dropout


def grouped_ffn(
    x: jax.Array,
    group: jax.Array,
    token_ids: jax.Array,
    wi: jax.Array,
    bi: jax.Array,
    wo: jax.Array,
    bo: jax.Array,
    drop_key: jax.Array | None,
    rate: float,
    *,
    impl: str = "mosaic",
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    max_concurrent_steps: int = 4,
    grid_block_n: int = 1,
    weight_grad: str = "auto",
    interpret: bool = False,
    compute_dtype=None,
) -> jax.Array:
    """Each row through its expert with grouped matmuls.

    Args:
      x: ``[R, emb]`` rows.
      group: int ``[R]``, expert of each row in ``[0, G)``; ``G`` or more: no expert (dropped by
        capacity, padding), the row outputs zeros.
      token_ids: int ``[R]``, global row ids that seed the dropout masks (``moe._dropout``).
      wi, bi, wo, bo: ``[G, emb, mlp]``, ``[G, mlp]``, ``[G, mlp, emb]``, ``[G, emb]``.
      drop_key, rate: activation dropout key (None: no dropout) and rate.
      impl, block_m, block_n, block_k, max_concurrent_steps, grid_block_n, weight_grad,
        interpret, compute_dtype: :class:`GroupedMatmulConfig`. With ``impl="mosaic"`` (and
        ``"tokamax"``) the matmul operands (``x``, ``wi``, the hidden activations, ``wo``) are
        cast to bfloat16 unless they are float16 (or to ``compute_dtype``); biases, ReLU and
        dropout run in that dtype too, as ``_ragged_ffn`` does in a bfloat16 model.

    Returns: ``[R, emb]`` in the dtype of ``x``, zeros on rows without expert.
    """
    config = GroupedMatmulConfig(
        impl=impl, block_m=block_m, block_n=block_n, block_k=block_k,
        max_concurrent_steps=max_concurrent_steps, grid_block_n=grid_block_n,
        weight_grad=weight_grad, interpret=interpret, compute_dtype=compute_dtype)
    rows = x.shape[0]
    num_groups = wi.shape[0]
    dtype = config.operand_dtype(jnp.result_type(x.dtype, wi.dtype))
    group = group.astype(jnp.int32)
    order = jnp.argsort(group, stable=True)  # rows without expert sort last
    group_sizes = jnp.bincount(group, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    # Pad once here (gather the pad rows from row 0: they lie past the groups and are ignored)
    # so the kernels get whole row tiles without copying the activations again.
    padded_rows = -(-rows // block_m) * block_m if impl == "mosaic" else rows
    gather = jnp.concatenate([order, jnp.zeros((padded_rows - rows,), order.dtype)])
    sorted_group = jnp.concatenate(
        [group[order], jnp.full((padded_rows - rows,), num_groups, jnp.int32)])
    valid = (sorted_group < num_groups)[:, None]
    safe = jnp.minimum(sorted_group, num_groups - 1)

    h = grouped_matmul(x.astype(dtype)[gather], wi.astype(dtype), group_sizes, config)
    h = h + bi.astype(dtype)[safe]
    h = _dropout(jax.nn.relu(h), token_ids[gather], drop_key, rate)
    y = grouped_matmul(h, wo.astype(dtype), group_sizes, config) + bo.astype(dtype)[safe]
    y = jnp.where(valid, y, 0)[:rows]
    # Undo the sort with a scatter (its transpose is a gather, cheaper than a second argsort).
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True).astype(x.dtype)
