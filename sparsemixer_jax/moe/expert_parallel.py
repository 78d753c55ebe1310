"""Expert parallelism: the expert FFN with experts split over a ``("data", "fsdp", "expert")``
mesh.

* Expert weights ``[N, ...]`` are split over ``"expert"``: each device of an expert group holds
  ``N / E`` consecutive experts (``E`` = size of the expert axis) while they run. At rest they
  may be split over ``"fsdp"`` too (:mod:`sparsemixer_jax.parallel.partitioning`); XLA gathers them
  over
  ``"fsdp"`` on the way in. The batch is split over ``"data"`` and ``"fsdp"`` (together: the
  data groups) and, inside this function, over ``"expert"``.
* The router runs outside :func:`jax.shard_map`, under plain ``jit`` partitioning, on the full
  logits with one key: routing decisions and random draws do not depend on the mesh (threefry is
  partitionable), and the router's custom VJP stays in ordinary autodiff.
* Only the expert FFN runs inside :func:`jax.shard_map`. The tokens of a data shard are split
  into ``E`` equal chunks, one per device of the expert group. Each device sends every token of
  its chunk to the device owning its expert with :func:`jax.lax.all_to_all` (fixed slots: ``c``
  per destination, ``c`` = chunk size, so nothing is ever dropped), runs its local experts on
  what it received (any dispatch of :func:`sparsemixer_jax.moe.dispatch.expert_ffn`), and sends
  the outputs back with a second ``all_to_all``.
* Gradients: the transpose of ``shard_map`` sums the gradient of the expert weights over
  ``"data"`` and ``"fsdp"`` (they are unvarying there) and ``jit`` reduces (or reduce-scatters,
  for sharded parameters) the rest; no manual ``psum`` is written here.

Cost: by default every buffer has room for the worst case (all rows of a chunk bound for one
device: ``c`` slots per destination), so each device runs its local experts over ``E * c`` rows,
the whole data shard, where a balanced routing sends it ``c``: ``E`` times the expert FLOPs and
memory the routing needs. ``buffer_factor = f > 0`` gives each (sender, receiver) pair
``ceil(f * c / E)`` slots instead (:func:`buffer_slots`), ``f`` times a balanced routing's
share, so each device's experts run over ``f * c`` rows; the rows of a chunk past their
destination's slots, in row order, are dropped (:func:`buffer_overflow`: the layer marks them
unserved before the exchange and counts them in its ``dropped_fraction``). That is GShard's
capacity per group of tokens, here per chunk and device, so which rows drop depends on the mesh;
``f = 0`` keeps the dropless worst case, whose results equal one device's. Capacity mode
(``capacity_factor``) decides its drops globally before the exchange and does not size these
buffers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.moe.dispatch import expert_ffn
from sparsemixer_jax.parallel.partitioning import MESH_AXES
from sparsemixer_jax.parallel.sharding import batch_groups, check_batch, check_mesh


def expert_parallel_ffn(
    x: jax.Array,
    group: jax.Array,
    token_ids: jax.Array,
    params: tuple[jax.Array, ...],
    *,
    mesh: Mesh,
    dispatch: str,
    dropout_key: jax.Array | None = None,
    dropout_rate: float = 0.0,
    grouped_impl: str = "mosaic",
    activation: str = "relu",
    buffer_factor: float = 0.0,
) -> jax.Array:
    """:func:`sparsemixer_jax.moe.expert_ffn` with experts split over the mesh's expert axis.

    Args:
      x: ``[B, T, emb]`` in the compute dtype, ``B`` divisible by the data x fsdp axes. ``T`` counts
        rows: for top-k the layer passes ``T * k`` rows per sequence (each token repeated once
        per chosen expert), and nothing here depends on which.
      group: int32 ``[B, T]`` global expert per row, ``N`` (= number of experts) for none.
      token_ids: int32 ``[B, T]`` global row ids (seed the dropout masks).
      params: ``(wi [N, emb, mlp], bi [N, mlp], wo [N, mlp, emb], bo [N, emb])``, or gated
        experts' ``(w_gate, w_up, w_down)`` (:func:`sparsemixer_jax.moe.dispatch.is_gated`);
        every array is split over the expert axis.
      activation: the experts' nonlinearity (:data:`sparsemixer_jax.moe.ACTIVATIONS`).
      buffer_factor: 0 = room for every row (dropless); ``f > 0``: ``ceil(f * c / E)`` slots
        per destination (:func:`buffer_slots`). Rows past their slots output zeros; mark them
        unserved beforehand with :func:`buffer_overflow` to count them.

    Returns: ``[B, T, emb]``, equal to the single-device ``expert_ffn`` on the rows served
    (every row when ``buffer_factor = 0``).
    """
    check_batch(mesh, x.shape[0])
    num_experts = params[0].shape[0]
    check_mesh(mesh, num_experts)
    data, n_exp_dev = batch_groups(mesh), mesh.shape["expert"]
    batch, length, emb = x.shape
    per_shard, chunk = _chunking(mesh, batch, length)
    slots = buffer_slots(buffer_factor, chunk, n_exp_dev)
    to_chunks = functools.partial(_to_chunks, shards=data, per_shard=per_shard,
                                  devices=n_exp_dev, chunk=chunk)
    xs = to_chunks(x, 0)
    gs = to_chunks(group.astype(jnp.int32), num_experts)  # padding rows: no expert
    ids = to_chunks(token_ids.astype(jnp.int32), 0)
    has_key = dropout_key is not None and dropout_rate > 0
    local = functools.partial(
        _local_expert_ffn, num_params=len(params), local_experts=num_experts // n_exp_dev,
        devices=n_exp_dev, slots=slots,
        ffn=functools.partial(expert_ffn, dispatch=dispatch, dropout_rate=dropout_rate,
                              grouped_impl=grouped_impl, activation=activation))
    tokens = P(MESH_AXES)
    experts = P("expert")
    in_specs = (tokens, tokens, tokens) + (experts,) * len(params)
    args = (xs, gs, ids, *params)
    if has_key:
        in_specs += (P(),)
        args += (dropout_key,)
    out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tokens)(*args)
    out = out.reshape(data, n_exp_dev * chunk, emb)[:, :per_shard]
    return out.reshape(batch, length, emb)


def buffer_slots(buffer_factor: float, chunk: int, devices: int) -> int:
    """Slots each device of the expert axis (``devices`` of them) gives each sender's chunk of
    ``chunk`` rows: ``chunk`` (every row fits) when ``buffer_factor`` is 0, else
    ``ceil(buffer_factor * chunk / devices)``, at least 1 and at most ``chunk``."""
    if buffer_factor < 0:
        raise ValueError(f"buffer_factor must be >= 0 (0 = room for every row), got "
                         f"{buffer_factor}")
    if buffer_factor == 0:
        return chunk
    return min(chunk, max(1, math.ceil(buffer_factor * chunk / devices)))


def buffer_overflow(group: jax.Array, *, mesh: Mesh, num_experts: int,
                    buffer_factor: float) -> jax.Array:
    """bool ``[B, T]``: the rows of ``group`` (int32 ``[B, T]``, global expert per row, ``N``
    for none) that :func:`expert_parallel_ffn` with ``buffer_factor`` has no slot for: in each
    chunk, the rows bound for a device past its :func:`buffer_slots`, in row order. All False
    when ``buffer_factor`` is 0. Plain array code, split by rows as the exchange splits them."""
    batch, length = group.shape
    if buffer_factor == 0:
        return jnp.zeros((batch, length), bool)
    data, devices = batch_groups(mesh), mesh.shape["expert"]
    per_shard, chunk = _chunking(mesh, batch, length)
    slots = buffer_slots(buffer_factor, chunk, devices)
    gs = _to_chunks(group.astype(jnp.int32), num_experts, shards=data, per_shard=per_shard,
                    devices=devices, chunk=chunk).reshape(data * devices, chunk)
    dest = gs // (num_experts // devices)
    over = (dest < devices) & (_ranks(dest, devices) >= slots)
    return over.reshape(data, devices * chunk)[:, :per_shard].reshape(batch, length)


def _chunking(mesh: Mesh, batch: int, length: int) -> tuple[int, int]:
    """``(per_shard, chunk)``: the rows of one data shard of a ``[batch, length]`` batch, and
    the rows of each of its chunks, one per device of the expert axis (the last padded)."""
    per_shard = batch // batch_groups(mesh) * length
    return per_shard, -(-per_shard // mesh.shape["expert"])


def _to_chunks(a: jax.Array, fill, *, shards: int, per_shard: int, devices: int,
               chunk: int) -> jax.Array:
    """``a [B, T, ...]`` -> ``[shards * devices * chunk, ...]``: each data shard's
    ``per_shard`` rows padded with ``fill`` to ``devices`` chunks of ``chunk`` rows. Data shard
    ``d``'s chunk ``e`` sits at block ``d * devices + e``, which is exactly how
    ``P(("data", "fsdp", "expert"))`` splits the leading axis."""
    pad = chunk * devices - per_shard
    a = a.reshape(shards, per_shard, *a.shape[2:])
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    return a.reshape(shards * devices * chunk, *a.shape[2:])


def _local_expert_ffn(xc, gc, ic, *rest, num_params: int, local_experts: int, devices: int,
                      slots: int, ffn) -> jax.Array:
    """One device's part inside ``shard_map``: its chunk's rows (``xc [chunk, emb]``, global
    experts ``gc`` and row ids ``ic`` ``[chunk]``) sent to the devices owning their experts,
    ``ffn`` (:func:`~sparsemixer_jax.moe.dispatch.expert_ffn` with the layer's options) run on
    the rows received, the outputs sent back: ``[chunk, emb]``. ``rest`` holds this device's
    ``num_params`` expert arrays, then the dropout key if there is one. Each destination has
    ``slots`` rows of the send buffer; rows past them output zeros."""
    local_params, key = rest[:num_params], rest[num_params:]
    size = devices * slots
    dest = gc // local_experts  # owning device on the expert axis; devices = none
    slot = _send_slots(dest, devices, slots)
    send_x = jnp.zeros((size, xc.shape[-1]), xc.dtype).at[slot].set(
        xc, mode="drop", unique_indices=True)
    send_g = jnp.full((size,), local_experts, jnp.int32).at[slot].set(
        gc - dest * local_experts, mode="drop", unique_indices=True)
    send_i = jnp.zeros((size,), jnp.int32).at[slot].set(ic, mode="drop",
                                                        unique_indices=True)
    exchange = functools.partial(_exchange, devices=devices, chunk=slots)
    recv_x, recv_g, recv_i = exchange(send_x), exchange(send_g), exchange(send_i)
    out = ffn(recv_x, recv_g, recv_i, tuple(local_params), dropout_key=key[0] if key else None)
    back = exchange(out)  # back[slot] = output for the row sent into that slot
    return back.at[slot].get(mode="fill", fill_value=0, unique_indices=True)


def _send_slots(dest: jax.Array, devices: int, slots: int) -> jax.Array:
    """int32 ``[chunk]``: the slot of each row of a chunk in the send buffer
    ``[devices * slots]``, ``dest * slots`` plus its rank among the chunk's rows bound to the
    same device ``dest`` (``devices`` for a row without expert).

    Rows without expert, and rows ranked past their destination's ``slots``, get distinct slots
    past the end (dropped), so every slot is unique and the scatter can say so: differentiating
    a scatter that may write a slot twice makes JAX scatter an id per element, a uint32 array
    of the whole buffer's shape (``[devices * slots, emb]``) kept for the backward pass."""
    rank = _ranks(dest, devices)
    kept = (dest < devices) & (rank < slots)
    return jnp.where(kept, dest * slots + rank, devices * slots + jnp.arange(dest.shape[-1]))


def _ranks(dest: jax.Array, devices: int) -> jax.Array:
    """int32 ``[..., chunk]``: each row's rank, in row order along the last axis, among the
    rows bound for the same device (``dest``; rows with ``dest >= devices`` rank 0)."""
    bound = jax.nn.one_hot(dest, devices, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(bound, axis=-2) - 1) * bound, axis=-1)


def _exchange(a: jax.Array, *, devices: int, chunk: int) -> jax.Array:
    """``a [devices * chunk, ...]``: block ``e`` (``chunk`` rows) sent to device ``e`` of the
    expert axis, and
    block ``e`` of the result received from it (:func:`jax.lax.all_to_all`)."""
    a = a.reshape(devices, chunk, *a.shape[1:])
    a = jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)
    return a.reshape(devices * chunk, *a.shape[2:])
