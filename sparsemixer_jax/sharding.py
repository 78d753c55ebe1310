"""The ``("data", "expert")`` device mesh and how model state and batches are placed on it.

Expert weights ``[N, ...]`` are split over ``"expert"``; everything else is replicated; batches
are split over every device (:func:`batch_sharding`). The exchange of tokens between expert
devices is :mod:`sparsemixer_jax.moe.expert_parallel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.section import read_fields

if TYPE_CHECKING:  # only for annotations: the mesh and its checks need JAX alone
    from flax import nnx

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
    # Imported here: the expert-parallel FFN uses this module's mesh checks without Flax.
    from flax import nnx

    return jax.tree.map(lambda spec: NamedSharding(mesh, _trimmed(spec)),
                        nnx.get_partition_spec(state))


def shard_state(obj: nnx.Module | nnx.Pytree, mesh: Mesh) -> None:
    """Place the state of ``obj`` (a model, or an ``nnx.Optimizer``) on ``mesh``, in place.

    Shard every stateful object passed to a jitted step, the optimizer included, so the step's
    outputs come back with the shardings of its inputs (otherwise the second step recompiles).
    """
    from flax import nnx  # see state_shardings

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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of ``[B, ...]`` inputs: batch over every device, ``("data", "expert")``.

    The layers outside the MoE blocks are then split over the whole mesh rather than repeated
    on each device of an expert group, and the MoE block finds each device's tokens already
    where :func:`expert_parallel_ffn` wants them (``B`` a multiple of the mesh size).
    """
    return NamedSharding(mesh, P(("data", "expert")))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``config.mesh``: the ``(data, expert)`` device mesh; ``data = -1`` takes every device the
    expert axis leaves."""

    data: int = -1
    expert: int = 1

    @classmethod
    def from_config(cls, section: Any, where: str = "config.mesh.") -> MeshConfig:
        mesh = cls(**read_fields(cls, section, where))
        if mesh.expert < 1 or (mesh.data < 1 and mesh.data != -1):
            raise ValueError(f"{where.rstrip('.')}: expert must be >= 1 and data >= 1 or -1, got "
                             f"{dataclasses.asdict(mesh)}")
        return mesh


def mesh_from_config(config: Any) -> Mesh | None:
    """The mesh of ``config.mesh`` (a :class:`MeshConfig` or the section it is read from), or
    None for a single device; ``config.model.num_experts`` must divide by its expert axis
    (:func:`sparsemixer_jax.config.validate`).

    ``mesh.data = -1`` takes every device the expert axis leaves. A single process may ask for
    fewer devices than it has (the first ones are used); several processes must use them all.
    """
    available = jax.device_count()
    mesh = config.mesh if isinstance(config.mesh, MeshConfig) else MeshConfig.from_config(
        config.mesh)
    expert, data = mesh.expert, mesh.data
    if data == -1:
        if available % expert:
            raise ValueError(f"config.mesh.expert={expert} does not divide the {available} devices")
        data = available // expert
    wanted = data * expert
    if wanted > available or (wanted < available and jax.process_count() > 1):
        raise ValueError(
            f"config.mesh asks for data={data} x expert={expert} = {wanted} devices but "
            f"{available} are visible"
        )
    if wanted == 1:
        return None
    return make_mesh(data, expert, jax.devices()[:wanted])
