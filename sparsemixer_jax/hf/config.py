"""Hugging Face ``config.json`` <-> :class:`sparsemixer_jax.models.lm_config.LMConfig`, for the
types of :data:`sparsemixer_jax.models.lm_config.MODEL_TYPES`, in every spelling checkpoints
carry: written by transformers 4.x (top-level ``rope_theta`` and ``rope_scaling``, Qwen3-MoE's
``num_experts``) and by 5.x (``rope_parameters``, ``num_local_experts``).

Every key is either read, or known not to change the computation (token ids, versions, ...); any
other key, or a known key set to something this model does not compute, is refused in one line.
Facts per type are from transformers 5.23's ``modeling_<type>.py`` / ``configuration_<type>.py``.
"""

from __future__ import annotations

import json
from typing import Any

from sparsemixer_jax.models.lm_config import MODEL_TYPES, LMConfig, RopeConfig

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
    "num_experts", "num_local_experts",
})
TYPE_KEYS = {
    "mixtral": {"sliding_window", "router_jitter_noise"},
    "phimoe": {"sliding_window", "router_jitter_noise", "input_jitter_noise", "attention_bias",
               "lm_head_bias", "hidden_dropout", "original_max_position_embeddings"},
    "olmoe": {"attention_bias", "clip_qkv", "norm_topk_prob"},
    "qwen3_moe": {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
                  "decoder_sparse_step", "moe_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers", "layer_types"},
    "qwen2_moe": {"use_sliding_window", "sliding_window", "max_window_layers",
                  "decoder_sparse_step", "moe_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias",
                  "layer_types"},
}
# Each type's default rope theta (transformers' config classes) when config.json has none.
DEFAULT_THETA = {"mixtral": 1e6, "phimoe": 1e6, "olmoe": 1e4, "qwen3_moe": 1e4,
                 "qwen2_moe": 1e4}
# The spelling of the expert count each type's checkpoints carry.
EXPERTS_KEY = {"mixtral": "num_local_experts", "phimoe": "num_local_experts",
               "olmoe": "num_experts", "qwen3_moe": "num_experts", "qwen2_moe": "num_experts"}


def _refuse(model_type: str, message: str) -> None:
    raise ValueError(f"config.json ({model_type}): {message}")


def _rope(cfg: dict, model_type: str, head_dim: int) -> RopeConfig:
    """The rope settings from ``rope_parameters`` (5.x) or ``rope_theta`` + ``rope_scaling``
    (4.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA[model_type]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind != "longrope":
        _refuse(model_type, f"rope scaling {kind!r} is not implemented (implemented: default, "
                            "longrope)")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings"))
    if original is None or "short_mscale" not in params or "long_mscale" not in params:
        _refuse(model_type, "longrope needs original_max_position_embeddings, short_mscale "
                            "and long_mscale (the form Phi-3.5-MoE's config.json has)")
    # Phi-3.5-MoE's mscales replace the attention factor that ``factor`` would give.
    for key in ("attention_factor", "partial_rotary_factor"):
        if params.get(key) not in (None, 1, 1.0):
            _refuse(model_type, f"longrope with {key}={params[key]} is not implemented")
    del head_dim
    return RopeConfig(theta=float(theta), kind="longrope",
                      short_factor=tuple(float(f) for f in params["short_factor"]),
                      long_factor=tuple(float(f) for f in params["long_factor"]),
                      short_mscale=float(params["short_mscale"]),
                      long_mscale=float(params["long_mscale"]),
                      original_max_position_embeddings=int(original))


def from_hf(cfg: dict[str, Any], **overrides: Any) -> LMConfig:
    """An :class:`LMConfig` from a ``config.json`` dict; ``overrides`` replace fields after
    (``router``, ``jitter_eps``, ``compute_dtype``, ``dispatch``, ...).

    Raises ValueError in one line for an unsupported ``model_type`` (naming the supported ones)
    and for any key that would change the computation in a way not implemented here.
    """
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(MODEL_TYPES)}")
    known = METADATA_KEYS | COMMON_KEYS | TYPE_KEYS[model_type]
    unknown = sorted(set(cfg) - known)
    if unknown:
        _refuse(model_type, f"key {unknown[0]!r} is not known for this type and may change "
                            f"the computation, so it is refused (all unknown: {unknown})")
    if cfg.get("quantization_config"):
        _refuse(model_type, "quantized checkpoints are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(model_type, f"hidden_act={cfg['hidden_act']!r}; only 'silu' is implemented")
    for key in ("attention_dropout", "hidden_dropout"):
        if cfg.get(key, 0.0):
            _refuse(model_type, f"{key}={cfg[key]} is not implemented (only 0)")

    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    if model_type == "olmoe" and head_dim != hidden // heads:
        _refuse(model_type, f"head_dim={head_dim} differs from hidden_size / num_attention_heads "
                            "(OLMoE's key norm assumes they agree)")
    kv_heads = cfg.get("num_key_value_heads") or heads
    num_layers = int(cfg["num_hidden_layers"])
    experts = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(experts.values())) > 1:
        _refuse(model_type, f"num_experts and num_local_experts disagree: {experts}")
    default_experts = {"mixtral": 8, "phimoe": 16, "olmoe": 64, "qwen3_moe": 128,
                       "qwen2_moe": 60}[model_type]
    num_experts = int(next(iter(experts.values()), default_experts))
    top_k = int(cfg.get("num_experts_per_tok", {"mixtral": 2, "phimoe": 2, "olmoe": 8,
                                                "qwen3_moe": 8, "qwen2_moe": 4}[model_type]))

    fields: dict[str, Any] = {}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                           for i in range(num_layers))
        fields["moe_intermediate_size"] = int(cfg.get("moe_intermediate_size",
                                                      768 if model_type == "qwen3_moe" else 1408))
        fields["intermediate_size"] = int(cfg.get("intermediate_size", 0))
        if cfg.get("use_sliding_window"):
            if model_type == "qwen2_moe":
                _refuse(model_type, "use_sliding_window=true (sliding window on some layers "
                                    "only) is not implemented")
            fields["sliding_window"] = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types) and not cfg.get("use_sliding_window"):
            _refuse(model_type, f"layer_types {sorted(set(layer_types))} (per-layer sliding "
                                "attention) is not implemented")
    else:
        moe_layers = (True,) * num_layers
        fields["moe_intermediate_size"] = int(cfg["intermediate_size"])
        fields["intermediate_size"] = int(cfg["intermediate_size"])
        if model_type in ("mixtral", "phimoe"):
            fields["sliding_window"] = cfg.get("sliding_window")
    if model_type == "qwen2_moe":
        fields["shared_expert_size"] = int(cfg.get("shared_expert_intermediate_size", 5632))
        fields["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    if model_type in ("qwen3_moe", "olmoe", "phimoe"):
        fields["qkv_bias"] = fields["out_bias"] = bool(cfg.get("attention_bias", False))
    if model_type == "phimoe":
        if top_k != 2:
            _refuse(model_type, f"num_experts_per_tok={top_k}; phimoe's SparseMixer-v2 router "
                                "always picks 2 experts")
        fields.update(norm="layer", lm_head_bias=bool(cfg.get("lm_head_bias", False)),
                      router="sparsemixer_v2", jitter_eps=float(cfg.get("router_jitter_noise",
                                                                        0.01)),
                      moe_input_jitter=float(cfg.get("input_jitter_noise", 0.0)))
    else:
        fields.update(router="switch", jitter_eps=0.0)
    if model_type == "mixtral":
        fields.update(norm_topk_prob=True,
                      moe_input_jitter=float(cfg.get("router_jitter_noise", 0.0)))
    elif model_type != "phimoe":
        fields["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", False))
    if model_type == "qwen3_moe":
        fields["qk_norm"] = "head"
    if model_type == "olmoe":
        fields["qk_norm"] = "full"
        fields["clip_qkv"] = cfg.get("clip_qkv")
    default_eps = 1e-6 if model_type.startswith("qwen") else 1e-5
    config = LMConfig(
        model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=num_layers, num_heads=heads, num_kv_heads=int(kv_heads),
        head_dim=int(head_dim), num_experts=num_experts, top_k=top_k, moe_layers=moe_layers,
        norm_eps=float(cfg.get("rms_norm_eps", default_eps)),
        rope=_rope(cfg, model_type, int(head_dim)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        hf_config=json.dumps(cfg, sort_keys=True), **fields)
    return config.replace(**overrides) if overrides else config


def to_hf(config: LMConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as transformers 5.x writes it (``rope_parameters``),
    keeping the keys of the file it was read from that do not change the computation."""
    c, t = config, config.model_type
    out = {k: v for k, v in c.hf.items() if k in METADATA_KEYS}
    arch = {"mixtral": "MixtralForCausalLM", "phimoe": "PhimoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM"}[t]
    out.update(architectures=[arch], model_type=t, vocab_size=c.vocab_size,
               hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
               num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
               head_dim=c.head_dim, hidden_act="silu", rms_norm_eps=c.norm_eps,
               tie_word_embeddings=c.tie_word_embeddings, attention_dropout=0.0,
               num_experts_per_tok=c.top_k, max_position_embeddings=c.max_position_embeddings,
               initializer_range=c.initializer_range,
               router_aux_loss_coef=c.router_aux_loss_coef)
    # The expert count under the spelling the source file used (both load in transformers 5).
    spelled = [k for k in ("num_experts", "num_local_experts") if k in c.hf]
    out[spelled[0] if spelled else EXPERTS_KEY[t]] = c.num_experts
    rope: dict[str, Any] = {"rope_theta": c.rope.theta, "rope_type": c.rope.kind}
    if c.rope.kind == "longrope":
        rope.update(short_factor=list(c.rope.short_factor), long_factor=list(c.rope.long_factor),
                    short_mscale=c.rope.short_mscale, long_mscale=c.rope.long_mscale,
                    original_max_position_embeddings=c.rope.original_max_position_embeddings)
    out["rope_parameters"] = rope
    if t in ("qwen2_moe", "qwen3_moe"):
        out.update(intermediate_size=c.intermediate_size,
                   moe_intermediate_size=c.moe_intermediate_size, decoder_sparse_step=1,
                   mlp_only_layers=[i for i, m in enumerate(c.moe_layers) if not m],
                   norm_topk_prob=c.norm_topk_prob,
                   use_sliding_window=c.sliding_window is not None)
        if c.sliding_window is not None:
            out["sliding_window"] = c.sliding_window
    else:
        if not all(c.moe_layers):
            raise ValueError(f"{t} checkpoints have no dense layers; this model has "
                             f"{c.moe_layers.count(False)}")
        out["intermediate_size"] = c.moe_intermediate_size
        if t in ("mixtral", "phimoe"):
            out["sliding_window"] = c.sliding_window
    if t == "qwen2_moe":
        out.update(shared_expert_intermediate_size=c.shared_expert_size, qkv_bias=c.qkv_bias)
    elif c.shared_expert_size:
        raise ValueError(f"{t} checkpoints have no shared expert")
    if t in ("qwen3_moe", "olmoe", "phimoe"):
        out["attention_bias"] = c.qkv_bias
    if t == "olmoe":
        out["clip_qkv"] = c.clip_qkv
    if t == "mixtral":
        out["router_jitter_noise"] = c.moe_input_jitter
    if t == "phimoe":
        out.update(lm_head_bias=c.lm_head_bias, input_jitter_noise=c.moe_input_jitter,
                   router_jitter_noise=c.jitter_eps if c.router == "sparsemixer_v2"
                   else c.hf.get("router_jitter_noise", 0.01))
    return out
