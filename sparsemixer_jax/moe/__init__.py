"""Mixture-of-experts feed-forward layers: the routed layer, its dispatch, expert parallelism.

* :mod:`~sparsemixer_jax.moe.config`: :class:`MoEConfig`, the layers' config section.
* :mod:`~sparsemixer_jax.moe.layer`: :class:`MoEFeedForward`, the layer models use, and
  :func:`fold_omega` for after training.
* :mod:`~sparsemixer_jax.moe.dispatch`: the expert FFN over rows, by layout (ragged, padded,
  capacity) and the measured choice behind ``dispatch="auto"``.
* :mod:`~sparsemixer_jax.moe.expert_parallel`: the same FFN with experts split over a mesh.
* :mod:`~sparsemixer_jax.moe.diagnostics`: per-layer router diagnostics.
* :mod:`~sparsemixer_jax.moe.shared`: shared experts beside the routed ones.
* :mod:`~sparsemixer_jax.moe.balancing`: bias balancing's step after each update.
* :mod:`~sparsemixer_jax.moe.unchosen`: what DenseMixer and Default MoE compute for the experts
  a token did not choose.

Only :mod:`~sparsemixer_jax.moe.layer` needs Flax; its names are loaded on first use, so the
pure functions (dispatch, expert parallelism, diagnostics) import with JAX alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsemixer_jax.lazy_names import lazy_names
from sparsemixer_jax.moe.config import MoEConfig
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

if TYPE_CHECKING:
    from sparsemixer_jax.moe.balancing import balance_plan, end_of_update
    from sparsemixer_jax.moe.layer import MoEFeedForward, fold_omega

# Names that need Flax: module that defines each.
_LAZY = {"MoEFeedForward": "sparsemixer_jax.moe.layer", "fold_omega": "sparsemixer_jax.moe.layer",
         "balance_plan": "sparsemixer_jax.moe.balancing",
         "end_of_update": "sparsemixer_jax.moe.balancing"}

__all__ = [
    "ACTIVATIONS",
    "AUTO_DISPATCH",
    "DISPATCHES",
    "GROUPED_IMPLS",
    "MoEConfig",
    "MoEFeedForward",
    "activation_fn",
    "balance_plan",
    "capacity_keep",
    "end_of_update",
    "expert_capacity",
    "expert_ffn",
    "expert_parallel_ffn",
    "fold_omega",
    "resolve_dispatch",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
