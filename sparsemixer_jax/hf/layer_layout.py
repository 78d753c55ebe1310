"""How a ``config.json`` lays out its layers, read into :class:`~sparsemixer_jax.models.
lm_config.LMConfig` fields: which layers are routed and how wide their MLPs are
(:func:`layer_fields`), which are Gated DeltaNet (:func:`linear_layers`), and which attend
within a window or chunk, rotate, or scale their queries (:func:`window_fields`). Each entry a
type cannot mean is refused in one line naming its key and index (:func:`refuse`)."""

from __future__ import annotations

from typing import Any

from sparsemixer_jax.hf.families import (
    LAYER_TYPES,
    LINEAR_LAYER_TYPES,
    MLP_LAYER_TYPES,
    Family,
)


def refuse(model_type: str, message: str) -> None:
    """A one-line ValueError naming the ``config.json``'s type."""
    raise ValueError(f"config.json ({model_type}): {message}")


def layer_fields(cfg: dict[str, Any], family: Family, num_layers: int, num_experts: int
                 ) -> dict[str, Any]:
    """``moe_layers`` and the expert / dense MLP widths (see ``Family.dense_layers``)."""
    if family.dense_layers == "first_k":
        first = int(cfg.get("first_k_dense_replace", family.default("first_k_dense_replace")))
        return {"moe_layers": tuple(i >= first for i in range(num_layers)),
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size",
                                                     family.default("moe_intermediate_size"))),
                "intermediate_size": int(cfg["intermediate_size"])}
    if family.dense_layers == "moe_only":
        width = int(cfg.get("moe_intermediate_size", family.default("moe_intermediate_size")))
        return {"moe_layers": (True,) * num_layers, "moe_intermediate_size": width,
                "intermediate_size": 0}
    if family.dense_layers == "moe_step":  # Llama 4
        step = cfg.get("interleave_moe_layer_step") or 1
        routed = cfg.get("moe_layers")
        routed = range(step - 1, num_layers, step) if routed is None else routed
        if any(not isinstance(i, int) or not 0 <= i < num_layers for i in routed):
            refuse(family.model_type, f"moe_layers={list(routed)} must be layer indices below "
                                       f"num_hidden_layers={num_layers}")
        return {"moe_layers": tuple(i in set(routed) for i in range(num_layers)),
                "moe_intermediate_size": int(cfg["intermediate_size"]),
                "intermediate_size": int(cfg.get("intermediate_size_mlp", 16384))}
    if family.dense_layers == "mlp_layer_types":
        return {"moe_layers": _mlp_layer_types(cfg, family, num_layers),
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size",
                                                     family.default("moe_intermediate_size"))),
                "intermediate_size": int(cfg["intermediate_size"])}
    if not family.dense_layers:
        width = int(cfg["intermediate_size"])
        return {"moe_layers": (True,) * num_layers, "moe_intermediate_size": width,
                "intermediate_size": width}
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return {"moe_layers": tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                                for i in range(num_layers)),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size",
                                                 family.default("moe_intermediate_size"))),
            "intermediate_size": int(cfg.get("intermediate_size", 0))}


def _per_layer(family: Family, key: str, entries: list, meanings: dict[str, bool],
               num_layers: int, *, unknown: str = "") -> tuple[bool, ...]:
    """``entries`` (the ``config.json`` list ``key``, one per layer) read through ``meanings``:
    an entry it lacks (``unknown`` says how; by default the implemented ones are named), then a
    length other than ``num_layers``, refused in one line."""
    unknown = unknown or f"is not implemented (implemented: {', '.join(meanings)})"
    for i, kind in enumerate(entries):
        if kind not in meanings:
            refuse(family.model_type, f"{key}[{i}]={kind!r} {unknown}")
    if len(entries) != num_layers:
        refuse(family.model_type, f"{key} has {len(entries)} entries for "
                                   f"num_hidden_layers={num_layers}")
    return tuple(meanings[kind] for kind in entries)


def _mlp_layer_types(cfg: dict[str, Any], family: Family, num_layers: int) -> tuple[bool, ...]:
    """Which layers are routed, from ``mlp_layer_types`` (by default the first layer dense, as
    transformers' GLM-4.7-Flash); a ``first_k_dense_replace`` beside it (the Hub's files carry
    one for other readers; transformers does not read it) must name the same dense layers."""
    types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    routed = _per_layer(family, "mlp_layer_types", types, MLP_LAYER_TYPES, num_layers,
                        unknown=f"is not one of {', '.join(MLP_LAYER_TYPES)}")
    first = cfg.get("first_k_dense_replace")
    if first is not None and routed != tuple(i >= first for i in range(num_layers)):
        refuse(family.model_type, f"first_k_dense_replace={first} disagrees with the dense "
                                   f"layers {[i for i, r in enumerate(routed) if not r]} of "
                                   "mlp_layer_types (what transformers builds)")
    return routed


def _layer_types(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """``sliding_window`` on the layers ``layer_types`` names ``sliding_attention`` (by default
    every other layer from the first, as transformers' gpt-oss)."""
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return {"sliding_window": cfg.get("sliding_window", family.default("sliding_window")),
            "sliding_layers": _per_layer(family, "layer_types", types, LAYER_TYPES,
                                         num_layers)}


def linear_layers(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """``linear_layers`` of a Gated DeltaNet hybrid: ``layer_types``, or without it every
    ``full_attention_interval``-th layer attention (transformers' default, 4)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            refuse(family.model_type, f"full_attention_interval={interval!r} must be an "
                                       "integer >= 1")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list):
        refuse(family.model_type, f"layer_types={types!r} must be a list")
    return {"linear_layers": _per_layer(family, "layer_types", types, LINEAR_LAYER_TYPES,
                                        num_layers)}


def _chunked(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """Llama 4's attention: rotary positions on the layers ``no_rope_layers`` marks 1 (by
    default all but every ``no_rope_layer_interval``-th), ``attention_chunk_size`` on those
    ``layer_types`` names ``chunked_attention`` (by default the rotary ones), the temperature
    tuning (``floor_scale``, ``attn_scale``) where ``attn_temperature_tuning``."""
    t = family.model_type
    interval = cfg.get("no_rope_layer_interval") or 4
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    kinds = {"chunked_attention": True, "full_attention": False}
    types = cfg.get("layer_types") or [
        "chunked_attention" if on else "full_attention" for on in rope]
    for key, values, allowed in (("no_rope_layers", rope, (0, 1)), ("layer_types", types, kinds)):
        if len(values) != num_layers:
            refuse(t, f"{key} has {len(values)} entries for num_hidden_layers={num_layers}")
        for i, value in enumerate(values):
            if isinstance(value, bool) or value not in allowed:
                refuse(t, f"{key}[{i}]={value!r} is not one of {', '.join(map(str, allowed))}")
    fields: dict[str, Any] = {"rope_layers": tuple(bool(on) for on in rope)}
    chunk = cfg.get("attention_chunk_size", 8192)
    if chunk is not None and "chunked_attention" in types:
        fields.update(attention_chunk_size=int(chunk),
                      sliding_layers=tuple(kinds[kind] for kind in types))
    if cfg.get("attn_temperature_tuning", True):
        fields.update(attn_temperature_floor=int(cfg.get("floor_scale", 8192)),
                      attn_temperature_scale=float(cfg.get("attn_scale", 0.1)))
    return fields


def window_fields(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """``sliding_window`` as the type spells it (see ``Family.window``)."""
    if family.window == "chunked":
        return _chunked(cfg, family, num_layers)
    if family.window == "every_layer":
        return {"sliding_window": cfg.get("sliding_window")}
    if family.window == "none":
        return {}
    if family.window == "per_layer":
        return _layer_types(cfg, family, num_layers)
    fields = {}
    if cfg.get("use_sliding_window"):
        if family.window == "refused":
            refuse(family.model_type, "use_sliding_window=true (sliding window on some layers "
                                       "only) is not implemented")
        fields["sliding_window"] = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) and not cfg.get("use_sliding_window"):
        refuse(family.model_type, f"layer_types {sorted(set(layer_types))} (per-layer sliding "
                                   "attention) is not implemented")
    return fields
