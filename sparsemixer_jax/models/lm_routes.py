"""The routes of a language model's forward pass, ``[B, T, L, K]`` over its ``L`` MoE layers:
checked when given (routing replay), split per scanned stack for the layers that replay them,
and gathered from the layers' selections for :attr:`LMOutput.routes`.

Routing replay itself (given experts, the live router's gates) is the MoE layer's
(:meth:`sparsemixer_jax.moe.MoEFeedForward.__call__`) and the router's
(:func:`sparsemixer_jax.routers.replayed_route`); this module maps the model's MoE layers,
in layer order, to the stacks that :func:`jax.lax.scan` runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax import routers
from sparsemixer_jax.models.layer_stacks import layer_pattern_stacks
from sparsemixer_jax.models.lm_config import LMConfig


def num_moe_layers(config: LMConfig) -> int:
    """``L``: how many of the model's layers are routed."""
    return sum(bool(flag) for flag in config.arch.moe_layers)


def check_routes(config: LMConfig, routes, batch: int, length: int) -> jax.Array:
    """``routes`` as int32 ``[B, T, L, K]`` for ``input_ids [batch, length]``, or a one-line
    ValueError naming what is wrong: its shape (against ``[batch, length, MoE layers,
    top_k]``), its dtype, an expert id outside ``[-1, num_experts)``, a row mixing ``-1`` with
    ids, an expert given twice (ids checked where concrete), or a router that does not
    replay."""
    layers, k = num_moe_layers(config), config.top_k
    shape = tuple(np.shape(routes))
    if shape != (batch, length, layers, k):
        raise ValueError(f"routes must be int [B, T, MoE layers, top_k] = "
                         f"{[batch, length, layers, k]} for input_ids {[batch, length]}, got "
                         f"shape {list(shape)}")
    routers.check_replay_router(config.moe_sections()[1])
    routers.check_given_experts(routes, config.num_experts)
    return jnp.asarray(routes).astype(jnp.int32)


def stack_routes(config: LMConfig, routes: jax.Array | None) -> list[jax.Array | None]:
    """Per scanned stack (:func:`~sparsemixer_jax.models.layer_stacks.layer_pattern_stacks`), the
    routes of its MoE layers as the scan takes them, int32 ``[repeats, MoE layers of the unit,
    B, T, K]``; None for every stack when ``routes`` is None, and for a stack without MoE
    layers."""
    stacks = layer_pattern_stacks(config.arch.layer_kinds)
    if routes is None:
        return [None] * len(stacks)
    out, slot = [], 0
    for pattern, repeats in stacks:
        per_unit = sum(kind.moe for kind in pattern)
        if not per_unit:
            out.append(None)
            continue
        # The MoE layers of repeat r are slots slot + r * per_unit .. in layer order.
        index = slot + np.arange(repeats)[:, None] * per_unit + np.arange(per_unit)
        out.append(jnp.moveaxis(routes[:, :, index], (2, 3), (0, 1)))
        slot += repeats * per_unit
    return out


def gathered_routes(moe: dict[str, dict], batch: int, length: int, top_k: int) -> jax.Array:
    """int32 ``[B, T, L, K]``: the selections that the MoE layers' metrics ``{"layer_{i}":
    metrics}`` hold under ``"routes"`` (``[B, T, K]`` each), in layer order, taken out of
    the metrics."""
    layers = sorted(moe, key=lambda name: int(name[6:]))
    picked = [moe[name].pop("routes") for name in layers]
    if not picked:
        return jnp.zeros((batch, length, 0, top_k), jnp.int32)
    return jnp.stack(picked, axis=2)
