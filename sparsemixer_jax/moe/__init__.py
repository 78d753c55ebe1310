"""Mixture-of-experts feed-forward layers: the routed layer, its dispatch, expert parallelism.

* :mod:`~sparsemixer_jax.moe.layer`: :class:`MoEFeedForward`, the layer models use, and
  :func:`fold_omega` for after training.
* :mod:`~sparsemixer_jax.moe.dispatch`: the expert FFN over rows, by layout (ragged, padded,
  capacity) and the measured choice behind ``dispatch="auto"``.
* :mod:`~sparsemixer_jax.moe.expert_parallel`: the same FFN with experts split over a mesh.
* :mod:`~sparsemixer_jax.moe.diagnostics`: per-layer router diagnostics.
"""

from sparsemixer_jax.moe.dispatch import (
    ACTIVATIONS,
    AUTO_DISPATCH,
    DISPATCHES,
    GROUPED_IMPLS,
    activation_fn,
    capacity_keep,
    expert_capacity,
    expert_ffn,
    resolve_dispatch,
)
from sparsemixer_jax.moe.expert_parallel import expert_parallel_ffn
from sparsemixer_jax.moe.layer import MoEFeedForward, fold_omega

__all__ = [
    "ACTIVATIONS",
    "AUTO_DISPATCH",
    "DISPATCHES",
    "GROUPED_IMPLS",
    "MoEFeedForward",
    "activation_fn",
    "capacity_keep",
    "expert_capacity",
    "expert_ffn",
    "expert_parallel_ffn",
    "fold_omega",
    "resolve_dispatch",
]
