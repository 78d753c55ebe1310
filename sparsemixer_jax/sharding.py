"""Expert parallelism for :class:`sparsemixer_jax.moe.MoEFeedForward` on a ``("data", "expert")``
mesh.

Layout:

* Expert weights ``[N, ...]`` are split over ``"expert"``: each device of an expert group holds
  ``N / E`` consecutive experts (``E`` = size of the expert axis). Everything else (router,
  ``omega``, the rest of the model) is replicated, and the batch is split over ``"data"``.
* The router runs outside :func:`jax.shard_map`, under plain ``jit`` partitioning, on the full
  logits with one key: routing decisions and random draws do not depend on the mesh (threefry is
  partitionable), and the router's custom VJP stays in ordinary autodiff.
* Only the expert FFN runs inside :func:`jax.shard_map`. The tokens of a data shard are split
  into ``E`` equal chunks, one per device of the expert group. Each device sends every token of
  its chunk to the device owning its expert with :func:`jax.lax.all_to_all` (fixed slots: ``c``
  per destination, ``c`` = chunk size, so nothing is ever dropped), runs its local experts on
  what it received, and sends the outputs back with a second ``all_to_all``.
* Gradients: the transpose of ``shard_map`` sums the gradient of the expert weights over
  ``"data"`` (they are unvarying there) and ``jit`` reduces the replicated params; no manual
  ``psum`` is written here.

Cost note: buffers are sized for the worst case (all tokens of a chunk to one device), so each
device runs its local experts over ``E * c`` rows, i.e. the whole data shard, padded. Capacity
mode decides drops globally before the exchange (so results equal one device) but does not shrink
these buffers; a ``ragged_all_to_all`` exchange would.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.moe import expert_ffn

AXES = ("data", "expert")


def make_mesh(data: int, expert: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, expert)`` mesh with axis names ``("data", "expert")``.

    ``data=-1`` uses every device not taken by the expert axis. Raises ValueError when the sizes
    do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if expert < 1:
        raise ValueError(f"mesh expert axis must be >= 1, got {expert}")
    if data == -1:
        if len(devices) % expert:
            raise ValueError(
                f"mesh: {len(devices)} devices do not divide into expert axis {expert}"
            )
        data = len(devices) // expert
    if data < 1:
        raise ValueError(f"mesh data axis must be >= 1 (or -1), got {data}")
    if data * expert != len(devices):
        raise ValueError(
            f"mesh data={data} x expert={expert} = {data * expert} devices, but "
            f"{len(devices)} devices are available"
        )
    grid = np.array(devices, dtype=object).reshape(data, expert)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def check_mesh(mesh: Mesh, num_experts: int) -> None:
    """Raise ValueError unless ``mesh`` has axes ``("data", "expert")`` and the expert axis
    divides ``num_experts``."""
    if set(mesh.axis_names) != set(AXES):
        raise ValueError(f"mesh axes must be {AXES}, got {mesh.axis_names}")
    expert = mesh.shape["expert"]
    if num_experts % expert:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the mesh expert axis ({expert})"
        )


def check_batch(mesh: Mesh, batch: int) -> None:
    """Raise ValueError unless the batch divides by the mesh's data axis."""
    data = mesh.shape["data"]
    if batch % data:
        raise ValueError(f"batch size {batch} is not divisible by the mesh data axis ({data})")


def _trimmed(spec: P) -> P:
    """``spec`` without trailing ``None``s: ``P("expert", None)`` -> ``P("expert")``.

    Same layout, but jit compares shardings by their spec: outputs come back trimmed, so
    untrimmed inputs would make the second training step recompile.
    """
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def state_shardings(state, mesh: Mesh):
    """NamedShardings for an ``nnx.State``: from each variable's ``out_sharding`` annotation
    (the MoE expert weights carry ``("expert", ...)``), replicated where there is none."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, _trimmed(spec)),
                        nnx.get_partition_spec(state))


def shard_state(obj: nnx.Module | nnx.Pytree, mesh: Mesh) -> None:
    """Place the state of ``obj`` (a model, or an ``nnx.Optimizer``) on ``mesh``, in place.

    Shard every stateful object passed to a jitted step, the optimizer included, so the step's
    outputs come back with the shardings of its inputs (otherwise the second step recompiles).
    """
    state = nnx.state(obj)
    nnx.update(obj, jax.tree.map(_place, state, state_shardings(state, mesh)))


def _place(value: jax.Array, target: NamedSharding) -> jax.Array:
    """``jax.device_put`` that also works when the mesh spans several processes.

    ``device_put`` only reaches this process's devices. With several processes every host holds
    the same initial value (same seed), and each builds its own shards from it.
    """
    if jax.process_count() == 1:
        return jax.device_put(value, target)
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):  # RNG stream keys: place the raw data
        data = np.asarray(jax.random.key_data(value))
        placed = jax.make_array_from_callback(data.shape, target, lambda index: data[index])
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(value))
    data = np.asarray(value)
    return jax.make_array_from_callback(data.shape, target, lambda index: data[index])


def expert_parallel_ffn(
    x: jax.Array,
    group: jax.Array,
    token_ids: jax.Array,
    params: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    mesh: Mesh,
    dispatch: str,
    dropout_key: jax.Array | None = None,
    dropout_rate: float = 0.0,
) -> jax.Array:
    """:func:`sparsemixer_jax.moe.expert_ffn` with experts split over the mesh's expert axis.

    Args:
      x: ``[B, T, emb]`` in the compute dtype, ``B`` divisible by the data axis. ``T`` counts
        rows: for top-k the layer passes ``T * k`` rows per sequence (each token repeated once
        per chosen expert), and nothing here depends on which.
      group: int32 ``[B, T]`` global expert per row, ``N`` (= number of experts) for none.
      token_ids: int32 ``[B, T]`` global row ids (seed the dropout masks).
      params: ``(wi [N, emb, mlp], bi [N, mlp], wo [N, mlp, emb], bo [N, emb])``.

    Returns: ``[B, T, emb]``, equal to the single-device ``expert_ffn`` (dropless).
    """
    check_batch(mesh, x.shape[0])
    num_experts = params[0].shape[0]
    check_mesh(mesh, num_experts)
    data, n_exp_dev = mesh.shape["data"], mesh.shape["expert"]
    local_experts = num_experts // n_exp_dev
    batch, length, emb = x.shape
    per_shard = batch // data * length  # tokens of one data shard
    chunk = -(-per_shard // n_exp_dev)  # tokens per device after splitting over "expert"
    pad = chunk * n_exp_dev - per_shard

    def to_chunks(a: jax.Array, fill) -> jax.Array:
        # [B, T, ...] -> [data * E * chunk, ...]: data shard d, chunk e sits at block d * E + e,
        # which is exactly how P(("data", "expert")) splits the leading axis.
        a = a.reshape(data, per_shard, *a.shape[2:])
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return a.reshape(data * n_exp_dev * chunk, *a.shape[2:])

    xs = to_chunks(x, 0)
    gs = to_chunks(group.astype(jnp.int32), num_experts)  # padding rows: no expert
    ids = to_chunks(token_ids.astype(jnp.int32), 0)
    has_key = dropout_key is not None and dropout_rate > 0

    def local(xc, gc, ic, wi, bi, wo, bo, *key):
        # xc [chunk, emb], gc/ic [chunk]; wi.. hold this device's local experts.
        dest = gc // local_experts  # owning device on the expert axis; n_exp_dev = none
        rank = jnp.sum(
            (jnp.cumsum(jax.nn.one_hot(dest, n_exp_dev, dtype=jnp.int32), axis=0) - 1)
            * jax.nn.one_hot(dest, n_exp_dev, dtype=jnp.int32),
            axis=-1,
        )  # position among this chunk's tokens bound to the same device
        slot = jnp.where(dest < n_exp_dev, dest * chunk + rank, n_exp_dev * chunk)
        size = n_exp_dev * chunk
        send_x = jnp.zeros((size, emb), xc.dtype).at[slot].set(xc, mode="drop")
        send_g = jnp.full((size,), local_experts, jnp.int32).at[slot].set(
            gc - dest * local_experts, mode="drop")
        send_i = jnp.zeros((size,), jnp.int32).at[slot].set(ic, mode="drop")

        def exchange(a):
            a = a.reshape(n_exp_dev, chunk, *a.shape[1:])
            a = jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)
            return a.reshape(size, *a.shape[2:])

        recv_x, recv_g, recv_i = exchange(send_x), exchange(send_g), exchange(send_i)
        out = expert_ffn(recv_x, recv_g, recv_i, (wi, bi, wo, bo), dispatch=dispatch,
                         dropout_key=key[0] if key else None, dropout_rate=dropout_rate)
        back = exchange(out)  # back[slot] = output for the token sent into that slot
        return back.at[slot].get(mode="fill", fill_value=0)

    tokens = P(("data", "expert"))
    experts = P("expert")
    in_specs = (tokens, tokens, tokens, experts, experts, experts, experts)
    args = (xs, gs, ids, *params)
    if has_key:
        in_specs += (P(),)
        args += (dropout_key,)
    out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tokens)(*args)
    out = out.reshape(data, n_exp_dev * chunk, emb)[:, :per_shard]
    return out.reshape(batch, length, emb)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of ``[B, ...]`` inputs: batch over every device, ``("data", "expert")``.

    The layers outside the MoE blocks are then split over the whole mesh rather than repeated
    on each device of an expert group, and the MoE block finds each device's tokens already
    where :func:`expert_parallel_ffn` wants them (``B`` a multiple of the mesh size).
    """
    return NamedSharding(mesh, P(("data", "expert")))
