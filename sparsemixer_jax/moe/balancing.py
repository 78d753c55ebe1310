"""Bias balancing's step between updates (auxiliary-loss-free load balancing, DeepSeek-V3).

Every training forward of a :class:`sparsemixer_jax.moe.MoEFeedForward` that keeps loads adds
its per-expert loads to its ``expert_load`` state, so after an update's micro-batches it holds
the loads of the whole update (all micro-batches, all data-parallel devices: the router runs
on the global batch). After the optimizer step, :func:`end_of_update` moves each layer's
``expert_bias`` by ``rate * sign(mean load - load_i)`` and zeroes ``expert_load``. Both are layer
state (``nnx.BatchStat``): outside the optimizer and the gradients, checkpointed with the
parameters, and kept unchanged when an update is skipped.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.routers.selection import bias_step

#: ``(path of a layer in the layer state, its bias_update_rate)`` for every MoE layer that keeps
#: loads: hashable, a static argument of the compiled update.
BalancePlan = tuple[tuple[tuple[Any, ...], float], ...]


def balance_plan(model: nnx.Module) -> BalancePlan:
    """The MoE layers of ``model`` whose loads the update must read and reset."""
    from sparsemixer_jax.moe.layer import MoEFeedForward

    return tuple((tuple(path), float(module.router_config.bias_update_rate))
                 for path, module in nnx.iter_modules(model)
                 if isinstance(module, MoEFeedForward) and module.expert_load is not None)


def end_of_update(layer_state: dict, plan: BalancePlan) -> dict:
    """``layer_state`` (a pure dict, as the train state holds it) after an update: every
    planned layer's ``expert_bias`` moved by :func:`sparsemixer_jax.routers.bias_step` of its
    ``expert_load`` (rate > 0), and its ``expert_load`` zeroed. Stacked layers (a leading layer
    axis) are stepped each on its own loads."""
    for path, rate in plan:
        layer_state = _replace_at(layer_state, path, lambda node, rate=rate: _step(node, rate))
    return layer_state


def _step(node: dict, rate: float) -> dict:
    load = node["expert_load"]
    node = {**node, "expert_load": jnp.zeros_like(load)}
    if rate > 0:
        node["expert_bias"] = node["expert_bias"] + bias_step(load, rate).astype(
            node["expert_bias"].dtype)
    return node


def _replace_at(tree: dict, path: tuple, fn) -> dict:
    if not path:
        return fn(tree)
    head, rest = path[0], path[1:]
    return {**tree, head: _replace_at(tree[head], rest, fn)}
