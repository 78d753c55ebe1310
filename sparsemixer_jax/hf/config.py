"""Hugging Face ``config.json`` <-> :class:`sparsemixer_jax.models.lm_config.LMConfig`, for the
types of :data:`sparsemixer_jax.hf.families.FAMILIES`, in every spelling checkpoints
carry: written by transformers 4.x (top-level ``rope_theta`` and ``rope_scaling``, Qwen3-MoE's
``num_experts``) and by 5.x (``rope_parameters``, ``num_local_experts``).

Every key is either read, or known not to change the computation (token ids, versions, ...); any
other key, or a known key set to something this model does not compute, is refused in one line.
Facts per type are from transformers 5.23's ``modeling_<type>.py`` / ``configuration_<type>.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from sparsemixer_jax.hf.families import (
    LAYER_TYPES,
    LINEAR_LAYER_TYPES,
    MLP_LAYER_TYPES,
    Family,
    Key,
    family_of,
    text_model_config,
)
from sparsemixer_jax.hf.layer_layout import layer_fields, linear_layers, refuse, window_fields
from sparsemixer_jax.layers.rope import RopeConfig
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.routers import RouterConfig

# Keys that never change the forward pass: identity, token ids, bookkeeping, the training-only
# auxiliary loss switch, attention backends.
METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits", "auto_map",
    "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "tokenizer_class",
    "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_return_dict", "problem_type", "is_decoder", "initializer_range",
    "router_aux_loss_coef", "max_position_embeddings", "_commit_hash", "task_specific_params",
})
COMMON_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "attention_dropout", "num_experts_per_tok",
    "quantization_config",
})
# The spellings of the expert count (a type's own is Family.experts_key) and of the experts per
# token (gpt-oss's config.json on the Hub says experts_per_token).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")
#: The key under which an export records how the model routes (:func:`routing_record`):
#: transformers keeps it as an attribute it never reads and computes the type's own routing;
#: :func:`from_hf` restores the recorded one.
ROUTING_KEY = "sparsemixer_jax_routing"
#: The :class:`LMConfig` fields of the routing, by their name in the record.
ROUTING_FIELDS = {"router": "router", "jitter_eps": "jitter_eps",
                  "norm_topk_prob": "norm_topk_prob", "options": "router_options"}


def _rope(cfg: dict, family: Family) -> RopeConfig:
    """The rope settings from ``rope_parameters`` (5.x) or ``rope_theta`` + ``rope_scaling``
    (4.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    if not (params or "rope_scaling" in cfg or "rope_theta" in cfg):  # the type's own default
        params = dict(family.default("rope_parameters") or {})
    model_type = family.model_type
    theta = params.get("rope_theta", cfg.get("rope_theta", family.default("rope_theta")))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", cfg.get(
        "partial_rotary_factor", family.default("partial_rotary_factor"))) or 1.0)
    if cfg.get("rotary_dim") is not None:  # MiniMax-M2's spelling of the rotated width
        partial = _rotary_dim(cfg, family, params, partial)
    if kind == "default":
        return RopeConfig(theta=float(theta), partial_rotary_factor=partial)
    if kind == "yarn":
        return _yarn(params, cfg, float(theta), partial)
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            refuse(model_type, f"llama3 rope scaling needs {', '.join(missing)}")
        return RopeConfig(theta=float(theta), kind="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(
                              params["original_max_position_embeddings"]),
                          partial_rotary_factor=partial)
    if kind != "longrope":
        refuse(model_type, f"rope scaling {kind!r} is not implemented (implemented: default, "
                            "longrope, yarn, llama3)")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings"))
    if original is None or "short_mscale" not in params or "long_mscale" not in params:
        refuse(model_type, "longrope needs original_max_position_embeddings, short_mscale "
                            "and long_mscale (the form Phi-3.5-MoE's config.json has)")
    # Phi-3.5-MoE's mscales replace the attention factor that ``factor`` would give.
    for key in ("attention_factor", "partial_rotary_factor"):
        if params.get(key) not in (None, 1, 1.0):
            refuse(model_type, f"longrope with {key}={params[key]} is not implemented")
    return RopeConfig(theta=float(theta), kind="longrope",
                      short_factor=tuple(float(f) for f in params["short_factor"]),
                      long_factor=tuple(float(f) for f in params["long_factor"]),
                      short_mscale=float(params["short_mscale"]),
                      long_mscale=float(params["long_mscale"]),
                      original_max_position_embeddings=int(original))


def _rotary_dim(cfg: dict[str, Any], family: Family, params: dict[str, Any], partial: float
                ) -> float:
    """The partial rotary factor of a ``rotary_dim`` key (rotated dimensions of a head), as
    transformers reads it (``rotary_dim / head_dim`` where no factor is given); a factor given
    beside it must rotate as many dimensions."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rotary = cfg["rotary_dim"]
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not 0 < rotary <= head_dim:
        refuse(family.model_type, f"rotary_dim={rotary!r} must be an int in [1, "
                                   f"head_dim={head_dim}]")
    given = "partial_rotary_factor" in params or "partial_rotary_factor" in cfg
    if given and int(head_dim * partial) != rotary:
        refuse(family.model_type, f"rotary_dim={rotary} disagrees with partial_rotary_factor="
                                   f"{partial} of head_dim={head_dim}")
    return partial if given else rotary / head_dim


def _yarn(params: dict[str, Any], cfg: dict[str, Any], theta: float, partial: float
          ) -> RopeConfig:
    """YaRN's settings as transformers 5.23 reads them (``_compute_yarn_parameters``): the
    attention factor, where not given, from ``factor`` (and ``mscale`` / ``mscale_all_dim``);
    ``truncate`` true unless said; the pretraining length from ``rope_parameters``, else
    ``max_position_embeddings``; the frequencies over the rotated width (``partial``)."""
    original = int(params.get("original_max_position_embeddings",
                              cfg.get("max_position_embeddings", 4096)))
    factor = params.get("factor")
    factor = float(cfg.get("max_position_embeddings", 4096) / original if factor is None
                   else factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(theta=theta, kind="yarn", factor=factor,
                      beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)),
                      attention_factor=float(attention), partial_rotary_factor=partial,
                      original_max_position_embeddings=original,
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def _check_keys(cfg: dict[str, Any], family: Family) -> None:
    """Refuses keys this model does not know or does not compute, each in one line."""
    model_type = family.model_type
    unknown = sorted(set(cfg) - (METADATA_KEYS | COMMON_KEYS | set(EXPERT_KEYS)
                                 | family.known_keys | {ROUTING_KEY}))
    if unknown:
        refuse(model_type, f"key {unknown[0]!r} is not known for this type and may change "
                            f"the computation, so it is refused (all unknown: {unknown})")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method not in family.quantizations:
            supported = ", ".join(sorted(family.quantizations)) or "none"
            refuse(model_type, f"quantization_config.quant_method={method!r} is not supported "
                                f"for this type (supported: {supported})")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse(model_type, f"hidden_act={cfg['hidden_act']!r}; only 'silu' is implemented")
    for key in ("attention_dropout", "hidden_dropout"):
        if cfg.get(key, 0.0):
            refuse(model_type, f"{key}={cfg[key]} is not implemented (only 0)")
    for key, only in family.required.items():
        if cfg.get(key, only) != only:
            refuse(model_type, f"{key}={cfg[key]!r} is not implemented (only {only!r})")
    for key, only in family.required_entries.items():
        entries = cfg.get(key, [])
        if not isinstance(entries, list):
            refuse(model_type, f"{key}={entries!r} is not a list")
        for i, entry in enumerate(entries):
            if entry != only:
                refuse(model_type, f"{key}[{i}]={entry!r} is not implemented (only {only!r})")


def _type_extras(cfg: dict[str, Any], family: Family, fields: dict[str, Any]
                 ) -> dict[str, Any]:
    """The router options the type routes by (``router_flags`` and ``router_keys``) and its
    shared experts counted in expert widths (``shared_expert_count_key``)."""
    extras: dict[str, Any] = {}
    options = dict(family.router_flags)
    for key in family.router_keys:
        options[key.fields[0]] = key.cast(cfg.get(key.name, family.default(key.name)))
    if options:
        extras["router_options"] = tuple(sorted(options.items()))
    if family.shared_expert_count_key:
        count = int(cfg.get(family.shared_expert_count_key,
                            family.default(family.shared_expert_count_key)))
        extras["shared_expert_size"] = count * fields["moe_intermediate_size"]
    if family.shared_expert_always:
        extras["shared_expert_size"] = fields["moe_intermediate_size"]
    return extras


def _check_sizes(cfg: dict[str, Any], family: Family) -> None:
    """The sizes every checkpoint states (transformers would default them to its own model's,
    which never fit the tensors): each present and an integer, else a one-line refusal."""
    needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    if family.dense_layers in ("", "first_k"):  # the expert width, or the dense MLP's
        needed.append("intermediate_size")
    for key in needed:
        if cfg.get(key) is None:
            refuse(family.model_type, f"required key {key!r} is missing")
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int):
            refuse(family.model_type, f"{key}={cfg[key]!r} is not an integer")


def routing_record(config: LMConfig) -> dict[str, Any]:
    """How ``config`` routes, as ``config.json``'s :data:`ROUTING_KEY` records it."""
    record = {name: getattr(config, field) for name, field in ROUTING_FIELDS.items()}
    record["options"] = dict(config.router_options)
    return record


def _recorded_routing(record: Any, model_type: str) -> dict[str, Any]:
    """The :class:`LMConfig` routing fields of a :data:`ROUTING_KEY` record (its values are
    checked by :class:`LMConfig`)."""
    if not isinstance(record, dict) or set(record) != set(ROUTING_FIELDS) or \
            not isinstance(record["options"], dict):
        refuse(model_type, f"{ROUTING_KEY} must be an object with the fields "
                            f"{sorted(ROUTING_FIELDS)} (options an object), got {record!r}")
    fields = {ROUTING_FIELDS[name]: value for name, value in record.items()}
    fields["router_options"] = tuple(sorted(record["options"].items()))
    return fields


def without_routing_record(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as transformers computes it: without the :data:`ROUTING_KEY` record."""
    return {k: v for k, v in cfg.items() if k != ROUTING_KEY}


def from_hf(cfg: dict[str, Any], **overrides: Any) -> LMConfig:
    """An :class:`LMConfig` from a ``config.json`` dict; ``overrides`` replace fields after
    (``router``, ``jitter_eps``, ``compute_dtype``, ``dispatch``, ...).

    The routing is the type's own, or the one an export recorded under :data:`ROUTING_KEY`
    (the routing the model was trained with; transformers ignores the record).

    Raises ValueError in one line for an unsupported ``model_type`` (naming the supported ones),
    a missing size, and any key that would change the computation in a way not implemented
    here.
    """
    cfg = text_model_config(cfg)
    family = family_of(cfg.get("model_type"))
    model_type = family.model_type
    _check_keys(cfg, family)
    _check_sizes(cfg, family)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or family.default("head_dim") or hidden // heads
    if family.latent_attention:  # its head_dim key (transformers writes one) is the rotary width
        head_dim = int(cfg.get("qk_nope_head_dim", family.default("qk_nope_head_dim"))) + \
            int(cfg.get("qk_rope_head_dim", family.default("qk_rope_head_dim")))
    if family.head_dim_fixed and head_dim != hidden // heads:
        refuse(model_type, f"head_dim={head_dim} differs from hidden_size / num_attention_heads "
                            "(this type's key norm assumes they agree)")
    kv_heads = cfg.get("num_key_value_heads") or heads
    num_layers = int(cfg["num_hidden_layers"])
    experts = {k: cfg[k] for k in EXPERT_KEYS if cfg.get(k) is not None}
    if len(set(experts.values())) > 1:
        refuse(model_type, f"the expert counts disagree: {experts}")
    num_experts = int(next(iter(experts.values()), family.default("num_experts")))
    top_ks = {k: cfg[k] for k in TOP_K_KEYS if cfg.get(k) is not None}
    if len(set(top_ks.values())) > 1:
        refuse(model_type, f"the experts per token disagree: {top_ks}")
    top_k = int(next(iter(top_ks.values()), family.default("num_experts_per_tok")))
    if family.fixed_top_k and top_k != family.fixed_top_k:
        refuse(model_type, f"num_experts_per_tok={top_k}; {model_type}'s {family.router} "
                            f"router always picks {family.fixed_top_k} experts")
    fields: dict[str, Any] = {"router": "switch", "jitter_eps": 0.0,
                              **layer_fields(cfg, family, num_layers, num_experts),
                              **window_fields(cfg, family, num_layers), **family.flags}
    if family.linear_attention:
        fields.update(linear_layers(cfg, family, num_layers))
    for key in family.keys:
        value = key.cast(cfg.get(key.name, family.default(key.name)))
        fields.update(dict.fromkeys(key.fields, value))
    fields.update(_type_extras(cfg, family, fields))
    if ROUTING_KEY in cfg:
        fields.update(_recorded_routing(cfg[ROUTING_KEY], model_type))
    config = LMConfig.build(
        model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=num_layers, num_heads=heads, num_kv_heads=int(kv_heads),
        head_dim=int(head_dim), num_experts=num_experts, top_k=top_k,
        norm_eps=float(cfg.get("rms_norm_eps", family.default("rms_norm_eps"))),
        rope=_rope(cfg, family),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        hf_config=json.dumps(cfg, sort_keys=True), **fields)
    return config.replace(**overrides) if overrides else config


def _written(config: LMConfig, family: Family, key: Key) -> Any:
    """The value of a type's own key in an export of ``config``. A router's jitter / mask
    threshold is the type's key only while the model routes by the type's own router; under
    another router the source file's value (or the default) is kept."""
    field = key.fields[0]
    if field == "jitter_eps" and config.router != family.router:
        return config.hf.get(key.name, family.default(key.name))
    return key.write(config.value(field))


def _rope_parameters(rope: RopeConfig, family: Family) -> dict[str, Any]:
    """``rope_parameters`` of ``config.json`` for ``rope`` (what :func:`_rope` reads)."""
    out: dict[str, Any] = {"rope_theta": rope.theta, "rope_type": rope.kind}
    if rope.partial_rotary_factor != 1.0 or family.default("partial_rotary_factor"):
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.kind == "yarn":
        out.update(factor=rope.factor, beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                   truncate=rope.truncate, attention_factor=rope.attention_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.kind == "llama3":
        out.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                   high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.kind == "longrope":
        out.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor),
                   short_mscale=rope.short_mscale, long_mscale=rope.long_mscale,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.mscale_all_dim:
        out["mscale_all_dim"] = rope.mscale_all_dim
    return out


def _layer_keys(c: LMConfig, family: Family) -> dict[str, Any]:
    """The feed-forward sizes and which layers are dense, in the family's keys (what
    :func:`_layers` reads); a ValueError if the family cannot write this model's layout."""
    t = family.model_type
    if family.dense_layers == "sparse_step":
        return dict(intermediate_size=c.arch.intermediate_size,
                    moe_intermediate_size=c.arch.moe_intermediate_size, decoder_sparse_step=1,
                    mlp_only_layers=[i for i, m in enumerate(c.arch.moe_layers) if not m])
    if family.dense_layers == "first_k":
        first = c.arch.moe_layers.index(True) if any(c.arch.moe_layers) else c.arch.num_layers
        if not all(c.arch.moe_layers[first:]):
            raise ValueError(f"{t} checkpoints have dense layers first only; this model has "
                             f"{c.arch.moe_layers}")
        return dict(intermediate_size=c.arch.intermediate_size,
                    moe_intermediate_size=c.arch.moe_intermediate_size, first_k_dense_replace=first)
    if family.dense_layers == "moe_step":
        return dict(intermediate_size=c.arch.moe_intermediate_size,
                    intermediate_size_mlp=c.arch.intermediate_size,
                    moe_layers=[i for i, routed in enumerate(c.arch.moe_layers) if routed])
    if family.dense_layers == "mlp_layer_types":
        named = {routed: kind for kind, routed in MLP_LAYER_TYPES.items()}
        return dict(intermediate_size=c.arch.intermediate_size,
                    moe_intermediate_size=c.arch.moe_intermediate_size,
                    mlp_layer_types=[named[routed] for routed in c.arch.moe_layers])
    if not all(c.arch.moe_layers):
        raise ValueError(f"{t} checkpoints have no dense layers; this model has "
                         f"{c.arch.moe_layers.count(False)}")
    if family.dense_layers == "moe_only":
        return {"moe_intermediate_size": c.arch.moe_intermediate_size}
    return {"intermediate_size": c.arch.moe_intermediate_size}


def _window_keys(c: LMConfig, family: Family) -> dict[str, Any]:
    """The sliding window in the family's keys (what :func:`_window` reads); a hybrid's
    ``layer_types`` (what :func:`_linear_layers` reads)."""
    if family.window == "every_layer":
        return {"sliding_window": c.arch.sliding_window}
    if family.window == "per_layer":
        sliding = c.arch.sliding_layers or (True,) * c.arch.num_layers
        named = {on: kind for kind, on in LAYER_TYPES.items()}
        return {"sliding_window": c.arch.sliding_window,
                "layer_types": [named[on] for on in sliding]}
    if family.window == "none":
        if family.linear_attention:
            named = {on: kind for kind, on in LINEAR_LAYER_TYPES.items()}
            return {"layer_types": [named[on] for on in c.arch.linear_layers
                                   or (False,) * c.arch.num_layers]}
        return {}
    if family.window == "chunked":
        a, n = c.arch, c.arch.num_layers
        chunked = a.sliding_layers if a.attention_chunk_size is not None else (False,) * n
        return {"no_rope_layers": [int(on) for on in a.rope_layers or (True,) * n],
                "layer_types": ["chunked_attention" if on else "full_attention"
                                for on in chunked or (True,) * n],
                "attention_chunk_size": a.attention_chunk_size,
                "attn_temperature_tuning": a.attn_temperature_floor > 0,
                "floor_scale": a.attn_temperature_floor or 8192,
                "attn_scale": a.attn_temperature_scale}
    out: dict[str, Any] = {"use_sliding_window": c.arch.sliding_window is not None}
    if c.arch.sliding_window is not None:
        out["sliding_window"] = c.arch.sliding_window
    return out


def _router_keys(c: LMConfig, family: Family) -> dict[str, Any]:
    """The family's routing keys and shared-expert count; a ValueError if transformers would
    not compute this model's shared experts. A routing the type's keys cannot say (another
    router, or other options than the type's own, e.g. softmax scores on ``glm4_moe``) is
    recorded under :data:`ROUTING_KEY` (transformers computes the type's own)."""
    t = family.model_type
    if c.shared_expert_size and not family.has_shared_expert:
        raise ValueError(f"{t} checkpoints have no shared expert")
    if family.shared_expert_always and c.shared_expert_size != c.arch.moe_intermediate_size:
        raise ValueError(f"{t} checkpoints have one shared expert of the experts' width "
                         f"{c.arch.moe_intermediate_size}; this model's is "
                         f"{c.shared_expert_size}")
    options = {**RouterConfig().__dict__, **c.router_option_dict()}
    out = {key.name: key.write(options[key.fields[0]]) for key in family.router_keys}
    if family.shared_expert_count_key:
        count, rest = divmod(c.shared_expert_size, c.arch.moe_intermediate_size)
        if rest:
            raise ValueError(f"{t} checkpoints hold shared experts of moe_intermediate_size="
                             f"{c.arch.moe_intermediate_size} each; shared_expert_size="
                             f"{c.shared_expert_size} is not a multiple")
        out[family.shared_expert_count_key] = count
    return out


def to_hf(config: LMConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as transformers 5.x writes it (``rope_parameters``),
    keeping the keys of the file it was read from that do not change the computation, with the
    model's routing recorded under :data:`ROUTING_KEY` (:func:`from_hf` restores it)."""
    c, family = config, family_of(config.arch.model_type, "LMConfig: model_type ")
    out = {k: v for k, v in c.hf.items() if k in METADATA_KEYS}
    out.update(architectures=[family.architecture], model_type=family.model_type,
               vocab_size=c.arch.vocab_size, hidden_size=c.arch.hidden_size,
               num_hidden_layers=c.arch.num_layers, num_attention_heads=c.arch.num_heads,
               num_key_value_heads=c.arch.num_kv_heads, head_dim=c.arch.head_dim, hidden_act="silu",
               rms_norm_eps=c.arch.norm_eps, tie_word_embeddings=c.arch.tie_word_embeddings,
               attention_dropout=0.0, num_experts_per_tok=c.top_k,
               max_position_embeddings=c.arch.max_position_embeddings,
               initializer_range=c.arch.initializer_range,
               router_aux_loss_coef=c.router_aux_loss_coef)
    # The expert count under the spelling the source file used (both load in transformers 5).
    spelled = [k for k in EXPERT_KEYS if k in c.hf]
    out[spelled[0] if spelled else family.experts_key] = c.num_experts
    out["rope_parameters"] = _rope_parameters(c.arch.rope, family)
    if family.latent_attention:
        del out["head_dim"]
        out["qk_nope_head_dim"] = c.arch.head_dim - c.arch.qk_rope_head_dim
    out.update(_layer_keys(c, family))
    out.update(_window_keys(c, family))
    out.update({key.name: _written(c, family, key) for key in family.keys})
    out.update(family.required)
    out.update({key: [only] * c.arch.num_layers for key, only in family.required_entries.items()})
    if "rotary_dim" in family.other_keys:  # the Hub's spelling, beside rope_parameters' factor
        out["rotary_dim"] = c.arch.rotary_dim
    out.update(_router_keys(c, family))
    out[ROUTING_KEY] = routing_record(c)
    return out
