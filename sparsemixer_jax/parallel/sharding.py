"""The ``("data", "fsdp", "expert")`` device mesh and how model state and batches are placed on it.

Batches are split over every device (:func:`batch_sharding`). Parameters and optimizer state are
placed by logical axis names and the rules of ``config.mesh.rules``
(:mod:`sparsemixer_jax.parallel.partitioning`): by default the model width over ``"fsdp"`` (FSDP,
ZeRO-3
style: each device holds ``1 / fsdp`` of every matrix and of its Adam moments) and expert weights
``[N, ...]`` over ``"expert"`` too; ``"data"`` replicates them (data parallelism across groups of
``fsdp x expert`` devices). The exchange of tokens between expert devices is
:mod:`sparsemixer_jax.moe.expert_parallel`.
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

from sparsemixer_jax.parallel.partitioning import MESH_AXES, Partitioner, read_rules
from sparsemixer_jax.section import has_field, read_fields

if TYPE_CHECKING:  # only for annotations: the mesh and its checks need JAX alone
    from flax import nnx

def make_mesh(data: int, expert: int, devices: Sequence[jax.Device] | None = None, *,
              fsdp: int = 1) -> Mesh:
    """A ``(data, fsdp, expert)`` mesh with axis names ``("data", "fsdp", "expert")``
    (:data:`~sparsemixer_jax.parallel.partitioning.MESH_AXES`), all of them ``AxisType.Auto``.

    ``data=-1`` uses every device not taken by the fsdp and expert axes; ``devices`` (default:
    all) must number exactly ``data x fsdp x expert``. The devices are laid out by
    ``jax.make_mesh``, so neighbours in the mesh are neighbours in the hardware: on TPU along the
    slice's physical torus (``devices`` should then be a whole slice or a sub-block of it), on
    GPU in device-id order, on CPU in ``devices`` order. Neighbouring mesh positions share an
    expert group, then an fsdp group: the axes that exchange the most (all-to-all of tokens,
    all-gathers of weights) stay on the fastest links. A TPU mesh axis that is no product of
    whole torus axes (8 on a 4x4x4 slice) splits one of them. Raises ValueError when the sizes
    do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if expert < 1 or fsdp < 1:
        raise ValueError(f"mesh expert and fsdp axes must be >= 1, got expert={expert}, "
                         f"fsdp={fsdp}")
    inner = fsdp * expert
    if data == -1:
        if len(devices) % inner:
            what = f"expert axis {expert}" if fsdp == 1 else f"fsdp x expert = {inner}"
            raise ValueError(f"mesh: {len(devices)} devices do not divide into {what}")
        data = len(devices) // inner
    if data < 1:
        raise ValueError(f"mesh data axis must be >= 1 (or -1), got {data}")
    if data * inner != len(devices):
        sizes = f"data={data} x expert={expert}" if fsdp == 1 else \
            f"data={data} x fsdp={fsdp} x expert={expert}"
        raise ValueError(f"mesh {sizes} = {data * inner} devices, but {len(devices)} devices "
                         "are available")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh((data, fsdp, expert), MESH_AXES, axis_types=axis_types,
                             devices=devices)
    except NotImplementedError as err:
        if "allow_split_physical_axes" not in str(err):
            raise
    # An axis that is no product of whole torus axes (8 on a TPU v5p 4x4x4 slice: 4 x 2):
    # jax.make_mesh does not split a physical axis, mesh_utils does when asked; the mesh's
    # neighbours stay neighbours on the torus.
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_device_mesh((data, fsdp, expert), devices,
                                         allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def batch_groups(mesh: Mesh) -> int:
    """Into how many parts the batch is split before the expert axis: ``data x fsdp``."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_mesh(mesh: Mesh, num_experts: int) -> None:
    """Raise ValueError unless ``mesh`` has axes ``("data", "fsdp", "expert")`` and the expert
    axis divides ``num_experts``."""
    if set(mesh.axis_names) != set(MESH_AXES):
        raise ValueError(f"mesh axes must be {MESH_AXES}, got {mesh.axis_names}")
    expert = mesh.shape["expert"]
    if num_experts % expert:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the mesh expert axis ({expert})"
        )


def check_batch(mesh: Mesh, batch: int) -> None:
    """Raise ValueError unless the batch divides by the mesh's data (x fsdp) axes."""
    groups = batch_groups(mesh)
    if batch % groups:
        what = "data axis" if mesh.shape["fsdp"] == 1 else "data x fsdp axes"
        raise ValueError(f"batch size {batch} is not divisible by the mesh {what} ({groups})")


def state_shardings(state: Any, partitioner: Partitioner) -> Any:
    """NamedShardings for an ``nnx.State`` (or any tree of arrays): parameters, their gradients
    and optimizer moments by the partitioner's logical-axis rules; other arrays (RNG streams,
    counts) replicated."""
    return partitioner.shardings(state)


def shard_state(obj: nnx.Module | nnx.Pytree, mesh: Mesh | Partitioner,
                rules: Any = None) -> None:
    """Place the state of ``obj`` (a model, or an ``nnx.Optimizer``) on the mesh, in place: by
    the logical-axis rules (``rules``: ``config.mesh.rules``, None for the defaults) when given
    a mesh, or by ``mesh`` itself when it is a :class:`Partitioner`.

    Shard every stateful object passed to a jitted step, the optimizer included, so the step's
    inputs are placed as its outputs come back (otherwise the second step recompiles).
    """
    from flax import nnx  # here: the expert-parallel FFN uses this module's checks without Flax

    partitioner = mesh if isinstance(mesh, Partitioner) else Partitioner(mesh, rules)
    params, rest = nnx.state(obj, nnx.Param, ...)
    nnx.update(obj, place(params, partitioner.shardings(params, warn=True)),
               place(rest, state_shardings(rest, partitioner)))


def place(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays placed as ``shardings`` says (one process or several)."""
    return jax.tree.map(_place, tree, shardings)


def _place(value: jax.Array, target: NamedSharding) -> jax.Array:
    """``jax.device_put`` that also works when the mesh spans several processes.

    ``device_put`` only reaches this process's devices. With several processes every host holds
    the same initial value (same seed), and each builds its own shards from it; a value already
    on the mesh is resharded by the devices that hold it.
    """
    if jax.process_count() == 1:
        return jax.device_put(value, target)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        # Already global (the MoE layers make their expert weights on the mesh): no host may
        # hold all of it (an expert axis across processes), so it is resharded where it is.
        if value.sharding.is_equivalent_to(target, value.ndim):
            return value
        return jax.jit(lambda x: x, out_shardings=target)(value)
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):  # RNG stream keys: place the raw data
        data = np.asarray(jax.random.key_data(value))
        placed = jax.make_array_from_callback(data.shape, target, lambda index: data[index])
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(value))
    data = np.asarray(value)
    return jax.make_array_from_callback(data.shape, target, lambda index: data[index])


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of ``[B, ...]`` inputs: batch over every device, ``("data", "fsdp", "expert")``.

    The layers outside the MoE blocks are then split over the whole mesh rather than repeated
    on each device of an expert group (FSDP splits the batch as data parallelism does; only the
    weights are gathered), and the MoE block finds each device's tokens already where
    :func:`expert_parallel_ffn` wants them (``B`` a multiple of the mesh size).
    """
    return NamedSharding(mesh, P(MESH_AXES))


def rows_sharding(mesh: Mesh | None) -> NamedSharding | None:
    """The sharding the models keep their activations ``[B, ...]`` in between layers: rows over
    every mesh axis (for the ``(data, fsdp, expert)`` mesh, as :func:`batch_sharding` places the
    batch); None without a mesh (or on one device), where :func:`keep_rows_split` changes
    nothing."""
    return None if mesh is None or mesh.size == 1 else NamedSharding(mesh, P(mesh.axis_names))


def keep_rows_split(x: jax.Array, rows: NamedSharding | None) -> jax.Array:
    """``x [B, ...]`` constrained to stay split by rows (``rows``: :func:`rows_sharding`), or
    unchanged when ``rows`` is None or the mesh does not divide ``B``.

    With parameters split over the model width (FSDP), XLA could otherwise gather the
    activations instead of the weights (compute every row's logits on every device), or carry
    an activation's gradient in the width split of the weight it meets and reshard it back.
    The constraint holds in both passes: the transpose of a sharding constraint is the same
    constraint on the cotangent."""
    if rows is None or x.shape[0] % rows.mesh.size:
        return x
    return jax.lax.with_sharding_constraint(x, rows)


def whole_sharding(mesh: Mesh | None) -> NamedSharding | None:
    """Replicated on every device of ``mesh``; None without a mesh (or on one device)."""
    return None if mesh is None or mesh.size == 1 else NamedSharding(mesh, P())


def lookup_rows(table: jax.Array, ids: jax.Array, whole: NamedSharding | None) -> jax.Array:
    """``table[ids]`` (``jnp.take`` along axis 0, as ``nnx.Embed``): ``table [V, emb]``, int
    ``ids [...]`` -> ``[..., emb]``, from the table gathered whole first (``whole``:
    :func:`whole_sharding`; None: as it is).

    Why whole: the table is split over its width (``embed`` over ``fsdp``) and the ids by rows.
    The gradient of the lookup is a scatter-add of the rows' gradients into the table; left to
    itself, XLA scatters into the width-split table, so it must reshard the row-split gradient
    to the width split. Where the two splits use different mesh axes (rows over
    ``fsdp x expert``, width over ``fsdp``), the SPMD partitioner of XLA's GPU and CPU
    compilers does that by replicating the gradient ("involuntary full rematerialization").
    From the whole table (FSDP's all-gather before use) each device scatters its own rows into
    a whole-table gradient and XLA reduce-scatters it to the width split, as for any matmul
    weight; that buffer is the price (docs/tpu.md gives the translation model's figures).
    """
    if whole is not None:
        table = jax.lax.with_sharding_constraint(table, whole)
    return jnp.take(table, ids, axis=0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``config.mesh``: the ``(data, fsdp, expert)`` device mesh and the rules placing logical
    axis names on it.

    ``data = -1`` takes every device the fsdp and expert axes leave. ``fsdp`` splits parameters,
    gradients and optimizer state (and the batch); ``expert`` splits the experts (and the batch);
    ``data`` replicates the parameters. ``rules``: ``(logical name, mesh axes)`` pairs
    (:func:`sparsemixer_jax.parallel.partitioning.read_rules`; in a config, a mapping of logical
    name to a
    mesh axis, a list of them, or None).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    rules: tuple[tuple[str, tuple[str, ...]], ...] = read_rules(None)

    @classmethod
    def from_config(cls, section: Any, where: str = "config.mesh.") -> MeshConfig:
        fields = read_fields(cls, section, where, skip=("rules",))
        rules = section["rules"] if has_field(section, "rules") else None
        if rules is not None and not hasattr(rules, "items"):
            raise ValueError(f"{where}rules must map logical axis names to mesh axes, got "
                             f"{rules!r}")
        mesh = cls(**fields, rules=read_rules(
            None if rules is None else dict(rules.items()), where + "rules"))
        if mesh.expert < 1 or mesh.fsdp < 1 or (mesh.data < 1 and mesh.data != -1):
            raise ValueError(f"{where.rstrip('.')}: expert and fsdp must be >= 1 and data >= 1 "
                             f"or -1, got data={mesh.data}, fsdp={mesh.fsdp}, "
                             f"expert={mesh.expert}")
        return mesh

    def sizes(self, devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, expert)`` over ``devices`` (``data = -1`` resolved); ValueError when
        the fsdp and expert axes do not divide them."""
        inner = self.fsdp * self.expert
        if self.data != -1:
            return self.data, self.fsdp, self.expert
        if devices % inner:
            raise ValueError(f"config.mesh: fsdp={self.fsdp} x expert={self.expert} does not "
                             f"divide the {devices} devices")
        return devices // inner, self.fsdp, self.expert


def device_mesh(section: MeshConfig) -> Mesh | None:
    """The mesh the mesh section ``section`` describes (a run's ``run.mesh``), or None for a
    single device; ``config.model.num_experts`` must divide by its expert axis
    (:func:`sparsemixer_jax.training.config.validate`).

    ``mesh.data = -1`` takes every device the fsdp and expert axes leave. A single process may
    ask for fewer devices than it has (the first ones are used); several processes must use
    them all.
    """
    available = jax.device_count()
    data, fsdp, expert = section.sizes(available)
    wanted = data * fsdp * expert
    if wanted > available or (wanted < available and jax.process_count() > 1):
        raise ValueError(
            f"config.mesh asks for data={data} x fsdp={fsdp} x expert={expert} = {wanted} "
            f"devices but {available} are visible"
        )
    if wanted == 1:
        return None
    return make_mesh(data, expert, jax.devices()[:wanted], fsdp=fsdp)


def mesh_partitioner(section: MeshConfig, mesh: Mesh | None) -> Partitioner | None:
    """The :class:`Partitioner` of ``mesh`` with the mesh section's rules; None without a
    mesh."""
    return None if mesh is None else Partitioner(mesh, section.rules)
