"""How a language model's layers are grouped for scanning: each layer's kind
(:class:`LayerKind`) and the stacks of repeated units :func:`layer_pattern_stacks` makes of
them (each stack one ``jax.lax.scan`` over a unit compiled once)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple


class LayerKind(NamedTuple):
    """What a layer is: routed (``moe``) or dense, Gated DeltaNet (``linear``) or attention."""

    moe: bool
    linear: bool


def layer_pattern_stacks(moe_layers: tuple[Hashable, ...]
                         ) -> tuple[tuple[tuple[Hashable, ...], int], ...]:
    """How the layers are scanned: ``((unit, repeats), ...)`` whose units, each repeated, give
    ``moe_layers`` in order (one entry per layer: whether it is routed, or its
    :class:`LayerKind`).

    Each stack compiles its unit once, so compile time does not grow with depth. Runs of
    identical layers are one stack each; when a pattern repeats with a short period (Qwen-MoE's
    ``decoder_sparse_step=2``: dense, MoE, dense, MoE, ...), the period is the unit instead, so
    the number of stacks stays small whatever the depth.
    """
    layers = tuple(moe_layers)
    runs: list[tuple[tuple[bool, ...], int]] = []
    for is_moe in layers:
        if runs and runs[-1][0] == (is_moe,):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append(((is_moe,), 1))
    if len(runs) <= 4:
        return tuple(runs)
    for period in range(2, len(layers) // 2 + 1):
        repeats = len(layers) // period
        if layers[: period * repeats] == layers[:period] * repeats:
            rest = layers[period * repeats:]
            tail = layer_pattern_stacks(rest) if rest else ()
            if len(tail) <= 2:
                return ((layers[:period], repeats), *tail)
    return tuple(runs)
