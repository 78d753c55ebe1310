"""Logical axis names of every parameter, and the rules that map them onto the device mesh.

Two tables, in the style of MaxText's and t5x's logical-axis partitioning:

* :data:`PARAMETER_AXES` names each dimension of every parameter of the project's models by what
  it indexes (``"vocab"``, ``"embed"``, ``"mlp"``, ``"heads"``, ``"expert"``, ...), keyed by the
  parameter's path (its module and name). Scanned layer stacks (the decoder-only LMs) add a
  leading ``"layers"`` dimension. The models hold no sharding code: one table names them all, and
  the Adam moments, whose paths end in their parameter's, get the same names.
* The *rules* (``config.mesh.rules``, :data:`DEFAULT_RULES`) map each logical name to a mesh
  axis (``"data"``, ``"fsdp"``, ``"expert"``), a list of them, or None (not split). The defaults
  split the model width ``embed`` over ``fsdp`` and the experts over ``expert``: expert weights
  ``[N, emb, mlp]`` are split over both, every other matrix over ``fsdp``. Norm scales (and
  ``omega``) are ``"norm"``, left whole: they are small, and split they would make XLA reshard
  the activations they scale to compute their gradient.

:class:`Partitioner` (a mesh and its rules; hashable, a static argument of the compiled steps)
turns a tree of arrays into its shardings and constrains a traced tree to them, so parameters,
gradients and optimizer state stay sharded through every step; the all-gathers before use and the
reduce-scatters of gradients are XLA's (the SPMD partitioner), none is written here. A dimension
that its mesh axes do not divide is left whole (small vectors, odd vocabularies), as is an
array whose path matches no entry (a warning names it).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

# Logical names, what each dimension indexes.
LOGICAL_AXES = (
    "layers",  # the repeats of a scanned layer stack
    "vocab",  # token rows / logits
    "embed",  # the model width
    "mlp",  # hidden width of a feed-forward layer or an expert
    "heads",  # attention projections' width (heads x head_dim, flattened)
    "expert",  # the experts of an MoE layer
    "routes",  # the router's logits (one per expert; the router runs whole)
    "score",  # a projection to one value (a gate, the discriminator's score)
    "norm",  # scales and shifts multiplying or added to activations: norms, omega, Admin
    "qk_norm",  # per-head or full query/key norm weights
    "position",  # learned absolute positions
    "segment",  # segment (sentence A/B) embeddings
    "buckets",  # relative-position buckets
    "bias_heads",  # a logit bias per attention head (relative positions; gpt-oss's sinks)
    "conv_taps",  # the taps of a causal convolution over positions (Gated DeltaNet's)
    "latent",  # latent attention's low-rank width (DeepSeek-V3's q_lora_rank, kv_lora_rank)
)

# The device mesh's axis names, outermost first (sparsemixer_jax.parallel.sharding.make_mesh builds
# it).
MESH_AXES = ("data", "fsdp", "expert")

# Where each logical name goes by default: a mesh axis, a tuple of them, or None (not split).
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": None,
    "embed": "fsdp",
    "mlp": None,
    "heads": None,
    "expert": "expert",
    "routes": None,
    "score": None,
    "norm": None,
    "qk_norm": None,
    "position": None,
    "segment": None,
    "buckets": None,
    "bias_heads": None,
    "conv_taps": None,
    "latent": None,
}

_ATTENTION_IN = r"(query|key|value|q_proj|k_proj|v_proj)"
_ATTENTION_OUT = r"(out|o_proj)"

# (pattern, names): the first pattern that matches the end of a parameter's path ("/"-joined
# module names, list indices and the parameter's name) with as many names as the array has
# dimensions (one fewer in a scanned stack: "layers" comes first) names it. Specific heads before
# the generic projections whose names they share.
PARAMETER_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # MoE experts, stacked [N, ...] (sparsemixer_jax.moe.MoEFeedForward)
    (r"(^|/)(wi|w_gate|w_up)", ("expert", "embed", "mlp")),
    (r"(^|/)(wo|w_down)", ("expert", "mlp", "embed")),
    (r"(^|/)bi", ("expert", "mlp")),
    (r"(^|/)bo", ("expert", "embed")),
    (r"(^|/)(b_gate|b_up)", ("expert", "mlp")),
    (r"(^|/)b_down", ("expert", "embed")),
    (r"(^|/)omega", ("norm",)),
    (r"router/kernel", ("embed", "routes")),
    (r"router/[a-z_]+", ("routes",)),  # its bias, and any per-expert vector of a router
    # heads projecting to one value, or from the width to the width
    (r"(discriminator_head/out|shared_experts/gate)/kernel", ("embed", "score")),
    (r"discriminator_head/out/bias", ("score",)),
    (r"(generator_head|discriminator_head)/dense/kernel", ("embed", "mlp")),
    (r"(generator_head|discriminator_head)/dense/bias", ("mlp",)),
    (r"(lm_head|generator_head)/kernel", ("embed", "vocab")),
    (r"(lm_head|generator_head)/bias", ("vocab",)),
    # Gated DeltaNet (linear attention): its projections, convolution [channels, taps] and
    # per-value-head decay parameters
    (r"linear_attn/in_proj_[a-z]+/kernel", ("embed", "heads")),
    (r"linear_attn/out_proj/kernel", ("heads", "embed")),
    (r"linear_attn/conv1d", ("heads", "conv_taps")),
    (r"linear_attn/(A_log|dt_bias)", ("bias_heads",)),
    # attention
    (_ATTENTION_IN + r"/kernel", ("embed", "heads")),
    (_ATTENTION_IN + r"/bias", ("heads",)),
    (_ATTENTION_OUT + r"/kernel", ("heads", "embed")),
    (_ATTENTION_OUT + r"/bias", ("embed",)),
    (r"(q_norm|k_norm)/weight", ("qk_norm",)),
    (r"position_bias/table/embedding", ("buckets", "bias_heads")),
    (r"self_attn/sinks", ("bias_heads",)),
    # latent attention: the width to a low-rank latent, the latent to the heads
    (r"(q_a_proj|kv_a_proj_with_mqa)/kernel", ("embed", "latent")),
    (r"(q_a_proj|kv_a_proj_with_mqa)/bias", ("latent",)),
    (r"(q_b_proj|kv_b_proj)/kernel", ("latent", "heads")),
    # dense feed-forward layers (and the MoE layer's shared experts)
    (r"(wi|w_gate|w_up|gate_proj|up_proj)/kernel", ("embed", "mlp")),
    (r"(wi|w_gate|w_up|gate_proj|up_proj)/bias", ("mlp",)),
    (r"(wo|w_down|down_proj)/kernel", ("mlp", "embed")),
    (r"(wo|w_down|down_proj)/bias", ("embed",)),
    # embeddings
    (r"(^|/)(embed|embed_tokens|token)/embedding", ("vocab", "embed")),
    (r"position/embedding", ("position", "embed")),
    (r"segment/embedding", ("segment", "embed")),
    # norms and residual scales
    (r"norm/(scale|bias|weight)", ("norm",)),
    (r"residual_scale", ("norm",)),
)
_COMPILED = tuple((re.compile(pattern + "$"), names) for pattern, names in PARAMETER_AXES)


def path_name(path: tuple[Any, ...]) -> str:
    """``"a/b/0/c"`` of a ``jax.tree_util`` key path (an ``nnx.Variable``'s ``value`` left out)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name != "value":
                parts.append(key.name)
        else:
            parts.append(str(getattr(key, "key", key)))
    return "/".join(parts)


def logical_axes_of(path: str, ndim: int) -> tuple[str, ...] | None:
    """The logical names of the dimensions of the parameter at ``path`` (``"/"``-joined) with
    ``ndim`` dimensions; None when :data:`PARAMETER_AXES` does not name it."""
    if ndim == 0:
        return ()
    for stacked in (False, True):  # a scanned stack adds a leading "layers" dimension
        for pattern, names in _COMPILED:
            if len(names) + stacked == ndim and pattern.search(path):
                return ("layers", *names) if stacked else names
    return None


def logical_axes(tree: Any) -> Any:
    """The tree of logical names (tuples, None where unnamed) of a tree of arrays."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: logical_axes_of(path_name(path), len(leaf.shape)), tree)


def read_rules(rules: Mapping[str, Any] | None, where: str = "config.mesh.rules"
               ) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rules as sorted ``(logical name, mesh axes)`` pairs: :data:`DEFAULT_RULES` updated
    with ``rules`` (a mapping of logical name to a mesh axis, a list of them, or None / ``""``
    for not split). ValueError (one line) for an unknown logical name or mesh axis."""
    merged = dict(DEFAULT_RULES)
    for name, value in (rules or {}).items():
        if name not in LOGICAL_AXES:
            raise ValueError(f"{where}.{name}: unknown logical axis; choose from {LOGICAL_AXES}")
        merged[name] = value
    out = []
    for name, value in sorted(merged.items()):
        axes = () if value in (None, "") else (value,) if isinstance(value, str) else tuple(value)
        for axis in axes:
            if axis not in MESH_AXES:
                raise ValueError(f"{where}.{name}={value!r}: mesh axes are {MESH_AXES} (or None)")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{where}.{name}={value!r} names a mesh axis twice")
        out.append((name, axes))
    return tuple(out)


class Partitioner:
    """A mesh and the rules placing logical names on it: the shardings of any tree whose leaf
    paths end in parameter paths (parameters, gradients, optimizer state, the layer state).

    Hashable (by mesh and rules): the compiled steps take it as a static argument.
    """

    def __init__(self, mesh: Mesh, rules: Any = None):
        self.mesh = mesh
        self.rules = rules if isinstance(rules, tuple) else read_rules(rules)
        self._axes = dict(self.rules)
        self._unnamed: set[str] = set()

    def __hash__(self) -> int:
        return hash((self.mesh, self.rules))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Partitioner) and self.mesh == other.mesh
                and self.rules == other.rules)

    def __repr__(self) -> str:
        return f"Partitioner(mesh={dict(self.mesh.shape)}, rules={dict(self.rules)})"

    def spec(self, names: tuple[str, ...] | None, shape: tuple[int, ...]) -> P:
        """The ``PartitionSpec`` of an array of ``shape`` with logical ``names``: each name's
        mesh axes (of more than one device) where they divide the dimension and no earlier
        dimension took them; trailing unsplit dimensions trimmed (jit returns specs trimmed;
        equal specs avoid recompiles)."""
        if not names:
            return P()
        used: set[str] = set()
        parts: list[Any] = []
        for name, size in zip(names, shape, strict=True):
            # axes of size 1 split nothing: left out, so specs read as what is split
            axes = tuple(a for a in self._axes.get(name, ())
                         if a not in used and self.mesh.shape[a] > 1)
            if axes and size % math.prod(self.mesh.shape[a] for a in axes) == 0:
                used.update(axes)
                parts.append(axes[0] if len(axes) == 1 else axes)
            else:
                parts.append(None)
        while parts and parts[-1] is None:
            parts.pop()
        return P(*parts)

    def sharding_of(self, path: str, shape: tuple[int, ...], warn: bool = False
                    ) -> NamedSharding:
        """The sharding of the array at ``path``; ``warn``: say so (once) when the table does
        not name it (for parameters; other state, such as RNG streams, is replicated)."""
        names = logical_axes_of(path, len(shape))
        if names is None and warn and path not in self._unnamed:
            self._unnamed.add(path)
            logger.warning("no logical axis names for the parameter %s %s: replicated", path,
                           tuple(shape))
        return NamedSharding(self.mesh, self.spec(names, tuple(shape)))

    def shardings(self, tree: Any, warn: bool = False) -> Any:
        """A ``NamedSharding`` for every array (or shape) of ``tree``."""
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: self.sharding_of(path_name(path), leaf.shape, warn), tree)

    def constrain(self, tree: Any) -> Any:
        """``tree`` (traced) constrained to :meth:`shardings`: XLA keeps it so, gathering and
        reduce-scattering where the computation needs it whole."""
        return jax.lax.with_sharding_constraint(tree, self.shardings(tree))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def constrain(partitioner: Partitioner | None, tree: Any) -> Any:
    """``partitioner.constrain(tree)``, or ``tree`` itself on one device (no partitioner)."""
    return tree if partitioner is None else partitioner.constrain(tree)
