"""One record per Hugging Face model type: everything that differs between the types, read by
:func:`sparsemixer_jax.hf.from_hf` / :func:`~sparsemixer_jax.hf.to_hf` (``config.json``), by
:mod:`sparsemixer_jax.hf.weights` (tensor names, both directions) and by the language-modelling
task's model section (a from-scratch model's ``config.json``).

A type's own ``config.json`` keys are :class:`Key` rows: each is read into :class:`LMConfig`
fields and written back from the first of them, so one row serves loading and export. Its MoE
tensor names are one table (``moe_names``) that loading parses and saving writes. What every
type shares (attention, norms, dense MLP, embeddings) is in :mod:`sparsemixer_jax.hf.weights`
and :mod:`sparsemixer_jax.hf.config`. Facts per type are from transformers 5.23's
``configuration_<type>.py`` / ``modeling_<type>.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Key:
    """A ``config.json`` key of one type: read as ``cast(value)`` into every field of
    ``fields`` (:class:`~sparsemixer_jax.models.lm_config.LMConfig` fields by their own names,
    whichever section owns them: ``LMConfig.build`` and ``LMConfig.value``), written back from
    the first; its default is the family's ``defaults[name]`` (None if absent)."""

    name: str
    fields: tuple[str, ...]
    cast: Callable[[Any], Any] = _same
    write: Callable[[Any], Any] = _same  # the field's value back to the key's


# Keys implied by a family's other traits (see Family.dense_layers and Family.window).
DENSE_LAYER_KEYS = {"": frozenset(), "moe_only": frozenset({"moe_intermediate_size"}),
                    "sparse_step": frozenset({"decoder_sparse_step", "mlp_only_layers",
                                              "moe_intermediate_size"}),
                    "first_k": frozenset({"first_k_dense_replace", "moe_intermediate_size"}),
                    "mlp_layer_types": frozenset({"mlp_layer_types", "first_k_dense_replace",
                                                  "moe_intermediate_size"}),
                    "moe_step": frozenset({"moe_layers", "interleave_moe_layer_step",
                                           "intermediate_size_mlp"})}
WINDOW_KEYS = {"every_layer": frozenset({"sliding_window"}),
               "switched": frozenset({"use_sliding_window", "sliding_window",
                                      "max_window_layers", "layer_types"}),
               "refused": frozenset({"use_sliding_window", "sliding_window",
                                     "max_window_layers", "layer_types"}),
               "per_layer": frozenset({"sliding_window", "layer_types"}),
               "chunked": frozenset({"attention_chunk_size", "layer_types", "no_rope_layers",
                                     "no_rope_layer_interval", "attn_temperature_tuning",
                                     "floor_scale", "attn_scale"}),
               "none": frozenset()}
#: ``layer_types`` entries (``"per_layer"`` windows): whether the layer's window applies.
LAYER_TYPES = {"sliding_attention": True, "full_attention": False}
#: ``layer_types`` entries of the Gated DeltaNet hybrids (``Family.linear_attention``): whether
#: the layer is Gated DeltaNet. Without ``layer_types`` every ``full_attention_interval``-th
#: layer (4 by default) is attention, the others Gated DeltaNet.
LINEAR_LAYER_TYPES = {"linear_attention": True, "full_attention": False}
LINEAR_KEYS = frozenset({"layer_types", "full_attention_interval"})
#: ``mlp_layer_types`` entries (``dense_layers="mlp_layer_types"``): whether the layer is routed.
MLP_LAYER_TYPES = {"sparse": True, "dense": False}
# The routed MoE sublayer's params, relative to a layer's ``mlp/moe``: what ``moe_names`` maps.
MOE_PARAMS = ("router", "w_gate", "w_up", "w_down")
#: Optional in ``moe_names``: the checkpoint's per-expert selection bias (the layer's bias state).
SELECTION_BIAS = "selection_bias"
#: Optional in ``moe_names``: the router's bias and the experts' biases (gpt-oss).
BIAS_PARAMS = ("router_bias", "b_gate", "b_up", "b_down")


#: Latent attention's projections (``self_attn.<name>.weight``, a bias where marked True and
#: ``attention_bias`` says so) and norms; ``q_a_*`` / ``q_b_proj`` with ``q_lora_rank > 0``,
#: ``q_proj`` without.
LATENT_ATTENTION_NAMES = {"q_a_proj": True, "q_b_proj": False, "q_proj": False,
                          "kv_a_proj_with_mqa": True, "kv_b_proj": False, "o_proj": True}
LATENT_ATTENTION_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def _moe_names(block: str, gate: str, up: str, down: str) -> dict[str, str]:
    """A per-expert MoE name table: the router ``{block}.gate.weight`` and the experts
    ``{block}.experts.{e}.<name>.weight``."""
    experts = f"{block}.experts.{{e}}"
    return {"router": f"{block}.gate.weight", "w_gate": f"{experts}.{gate}.weight",
            "w_up": f"{experts}.{up}.weight", "w_down": f"{experts}.{down}.weight"}


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything one Hugging Face ``model_type`` changes.

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architecture: the ``architectures`` entry an export names (transformers' class).
      experts_key: the spelling of the expert count its checkpoints carry (``num_experts`` or
        ``num_local_experts``; both are read).
      defaults: ``config.json`` defaults of its transformers config class, by key, for the keys
        a checkpoint may leave out (``num_experts`` stands for either spelling).
      keys: its own keys, read into :class:`LMConfig` fields and written back (:class:`Key`).
      flags: :class:`LMConfig` fields every model of the type has (its norms, router, ...).
      other_keys: further keys it accepts, read elsewhere (rope, dropout checks).
      dense_layers: which layers are dense: ``"sparse_step"`` (Qwen-MoE's
        ``decoder_sparse_step`` / ``mlp_only_layers``) or ``"first_k"`` (the first
        ``first_k_dense_replace``: GLM-4.5, DeepSeek-V3) or ``"mlp_layer_types"`` (one
        ``"dense"`` / ``"sparse"`` per layer, by default the first dense: GLM-4.7-Flash; a
        ``first_k_dense_replace`` beside it, which transformers does not read, must agree);
        either way experts are ``moe_intermediate_size`` wide and the dense MLP
        ``intermediate_size``; or ``"moe_step"`` (Llama 4: the layers ``moe_layers`` names, by
        default every ``interleave_moe_layer_step``-th, are routed, experts
        ``intermediate_size`` wide and the dense MLP ``intermediate_size_mlp``). ``""``: every
        layer is routed and ``intermediate_size`` is the expert width.
      window: how it spells sliding-window attention: ``"every_layer"`` (``sliding_window``,
        None = off), ``"switched"`` (``sliding_window`` on every layer while
        ``use_sliding_window``), ``"refused"`` (as switched, but per-layer windows are not
        computed, so only off is read), ``"per_layer"`` (``sliding_window`` on the layers
        ``layer_types`` names ``"sliding_attention"``; by default every other layer from the
        first: gpt-oss), ``"chunked"`` (Llama 4: ``attention_chunk_size`` on the layers
        ``layer_types`` names ``"chunked_attention"``, by default those with rotary positions,
        which ``no_rope_layers`` names, with the temperature tuning of the others) or
        ``"none"`` (no such keys).
      head_dim_fixed: ``head_dim`` must be ``hidden_size / num_attention_heads`` (OLMoE's key
        norm over the whole projection assumes it) and a from-scratch config omits it.
      fixed_top_k: the only ``num_experts_per_tok`` its router computes (0: any).
      scratch: keys a from-scratch model's ``config.json`` sets (beyond the sizes).
      moe_names: the MoE tensors' names in a layer (``model.layers.L.`` + name; ``{e}`` the
        expert), by :data:`MOE_PARAMS` (and :data:`SELECTION_BIAS`, :data:`BIAS_PARAMS`):
        written on export, read on load.
      shared_expert_names: the shared expert's prefix in a layer (``.gate_proj.weight``, ...);
        its gate, where the config has one, is ``<prefix>_gate.weight``.
      shared_expert_count_key: the key counting shared experts of ``moe_intermediate_size``
        each (GLM-4.5's ``n_shared_experts``; one MLP of their summed width), or ``""``.
      router_keys: keys read into the router's options (:class:`Key` rows whose field is a
        :class:`~sparsemixer_jax.routers.RouterConfig` option), written back from them.
      router_flags: router options every checkpoint of the type routes by.
      required: keys this model computes at one value only (any other is refused).
      fused_router: the router's name in transformers 5's fused in-memory layout, read on load
        beside ``moe_names`` (the experts' fused names are every type's:
        ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
      interleaved_experts: its checkpoints hold each layer's experts as whole tensors (no
        ``{e}`` in ``moe_names``), ``[N, in, out]`` as the model's params are, gate and up
        interleaved along the last axis of one tensor (gpt-oss's ``gate_up_proj``: gate at
        even columns, up at odd).
      quantizations: the ``quantization_config.quant_method`` values its checkpoints may have
        (dequantized on load: :mod:`sparsemixer_jax.hf.mxfp4`, :mod:`sparsemixer_jax.hf.fp8`).
      latent_attention: multi-head latent attention (DeepSeek-V3): ``head_dim`` is
        ``qk_nope_head_dim + qk_rope_head_dim`` (no ``head_dim`` key), one key/value head per
        query head, the attention tensors of :data:`LATENT_ATTENTION_NAMES`.
      linear_attention: a Gated DeltaNet hybrid: ``layer_types`` (:data:`LINEAR_LAYER_TYPES`)
        or ``full_attention_interval`` says which layers are Gated DeltaNet (``linear_attn.*``
        tensors; their projections' layout is the ``linear_layout`` flag).
      skipped: tensor-name prefixes its checkpoints may hold that this model does not compute
        (multi-token prediction, a vision tower), each with what it is: skipped on load with
        one logged line per prefix naming how many tensors.
      renamed: tensor-name prefixes read as another (the image-text-to-text checkpoint's
        ``model.language_model.`` as ``model.``).
      required_entries: list keys each of whose entries this model computes at one value only
        (MiniMax-M2's ``attn_type_list``: 1, softmax attention, on every layer).
      halved_experts: with ``interleaved_experts``, gate and up are the first and second halves
        of the fused tensor's last axis (Llama 4) instead of its even and odd columns.
      shared_expert_always: every MoE layer has one shared expert as wide as the experts
        (Llama 4), without a key.
      dense_mlp: the dense layers' MLP prefix in a layer (``<prefix>.gate_proj.weight``, ...).
    """

    model_type: str
    architecture: str
    experts_key: str
    defaults: Mapping[str, Any]
    moe_names: Mapping[str, str]
    keys: tuple[Key, ...] = ()
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    other_keys: frozenset[str] = frozenset()
    dense_layers: str = ""
    window: str = "none"
    head_dim_fixed: bool = False
    fixed_top_k: int = 0
    scratch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fused_router: str = "mlp.gate.weight"
    shared_expert_names: str = "mlp.shared_expert"
    shared_expert_count_key: str = ""
    router_keys: tuple[Key, ...] = ()
    router_flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    required: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    interleaved_experts: bool = False
    quantizations: frozenset[str] = frozenset()
    latent_attention: bool = False
    linear_attention: bool = False
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    required_entries: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    halved_experts: bool = False
    shared_expert_always: bool = False
    dense_mlp: str = "mlp"

    def __post_init__(self) -> None:
        if self.window not in WINDOW_KEYS:
            raise ValueError(f"Family {self.model_type}: window={self.window!r}; choose one of "
                             f"{sorted(WINDOW_KEYS)}")
        if set(self.moe_names) - {SELECTION_BIAS, *BIAS_PARAMS} != set(MOE_PARAMS):
            raise ValueError(f"Family {self.model_type}: moe_names must name {MOE_PARAMS}")

    @property
    def known_keys(self) -> frozenset[str]:
        """The type's own ``config.json`` keys (beyond every type's)."""
        return frozenset({k.name for k in (*self.keys, *self.router_keys)}
                         | WINDOW_KEYS[self.window] | DENSE_LAYER_KEYS[self.dense_layers]
                         | set(self.required) | set(self.required_entries) | self.other_keys
                         | ({self.shared_expert_count_key} - {""})
                         | (LINEAR_KEYS if self.linear_attention else frozenset()))

    def default(self, key: str) -> Any:
        return self.defaults.get(key)

    def reads(self, field: str) -> bool:
        """Whether one of the type's keys sets :class:`LMConfig` ``field``."""
        return any(field in k.fields for k in self.keys)

    @property
    def has_shared_expert(self) -> bool:
        """Whether its checkpoints may hold a shared expert."""
        return self.reads("shared_expert_size") or bool(self.shared_expert_count_key) \
            or self.shared_expert_always

    @property
    def router(self) -> str:
        """The router its checkpoints route by."""
        return self.flags.get("router", "switch")


_ATTENTION_BIAS = Key("attention_bias", ("qkv_bias", "out_bias"), bool)
_NORM_TOPK_PROB = Key("norm_topk_prob", ("norm_topk_prob",), bool)
_MLP_MOE = _moe_names("mlp", "gate_proj", "up_proj", "down_proj")

MIXTRAL = Family(
    model_type="mixtral", architecture="MixtralForCausalLM", experts_key="num_local_experts",
    defaults={"num_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
              "rms_norm_eps": 1e-5, "router_jitter_noise": 0.0},
    keys=(Key("router_jitter_noise", ("moe_input_jitter",), float),),
    flags={"norm_topk_prob": True}, window="every_layer",
    moe_names=_moe_names("block_sparse_moe", "w1", "w3", "w2"))

QWEN3_MOE = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", experts_key="num_experts",
    defaults={"num_experts": 128, "num_experts_per_tok": 8, "rope_theta": 1e4,
              "rms_norm_eps": 1e-6, "moe_intermediate_size": 768, "attention_bias": False,
              "norm_topk_prob": False},
    keys=(_ATTENTION_BIAS, _NORM_TOPK_PROB), flags={"qk_norm": "head"}, dense_layers="sparse_step",
    window="switched", scratch={"attention_bias": False}, moe_names=_MLP_MOE)

OLMOE = Family(
    model_type="olmoe", architecture="OlmoeForCausalLM", experts_key="num_experts",
    defaults={"num_experts": 64, "num_experts_per_tok": 8, "rope_theta": 1e4,
              "rms_norm_eps": 1e-5, "attention_bias": False, "norm_topk_prob": False},
    keys=(_ATTENTION_BIAS, Key("clip_qkv", ("clip_qkv",)), _NORM_TOPK_PROB),
    flags={"qk_norm": "full"}, head_dim_fixed=True, scratch={"attention_bias": False},
    moe_names=_MLP_MOE)

QWEN2_MOE = Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", experts_key="num_experts",
    defaults={"num_experts": 60, "num_experts_per_tok": 4, "rope_theta": 1e4,
              "rms_norm_eps": 1e-6, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "qkv_bias": True,
              "norm_topk_prob": False},
    keys=(Key("shared_expert_intermediate_size", ("shared_expert_size",), int),
          Key("qkv_bias", ("qkv_bias",), bool), _NORM_TOPK_PROB),
    dense_layers="sparse_step", window="refused", moe_names=_MLP_MOE)

PHIMOE = Family(
    model_type="phimoe", architecture="PhimoeForCausalLM", experts_key="num_local_experts",
    defaults={"num_experts": 16, "num_experts_per_tok": 2, "rope_theta": 1e6,
              "rms_norm_eps": 1e-5, "attention_bias": False, "lm_head_bias": False,
              "router_jitter_noise": 0.01, "input_jitter_noise": 0.0},
    keys=(_ATTENTION_BIAS, Key("lm_head_bias", ("lm_head_bias",), bool),
          Key("router_jitter_noise", ("jitter_eps",), float),
          Key("input_jitter_noise", ("moe_input_jitter",), float)),
    flags={"norm": "layer", "router": "sparsemixer_v2"},
    other_keys=frozenset({"hidden_dropout", "original_max_position_embeddings"}),
    window="every_layer", fixed_top_k=2,
    scratch={"attention_bias": True, "lm_head_bias": True, "input_jitter_noise": 0.0},
    moe_names=_moe_names("block_sparse_moe", "w1", "w3", "w2"), fused_router="mlp.router.weight")

GLM4_MOE = Family(
    model_type="glm4_moe", architecture="Glm4MoeForCausalLM", experts_key="n_routed_experts",
    defaults={"num_experts": 128, "num_experts_per_tok": 8, "rope_theta": 1e4,
              "rms_norm_eps": 1e-5, "moe_intermediate_size": 1408, "attention_bias": False,
              "use_qk_norm": False, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
              "partial_rotary_factor": 0.5},
    keys=(Key("attention_bias", ("qkv_bias",), bool),
          Key("use_qk_norm", ("qk_norm",), lambda on: "head" if on else "none",
              lambda norm: norm == "head")),
    router_keys=(Key("routed_scaling_factor", ("routed_scaling_factor",), float),
                 Key("n_group", ("num_groups",), int), Key("topk_group", ("top_groups",), int)),
    router_flags={"score": "sigmoid", "group_score": "top2_sum"},
    required={"norm_topk_prob": True},
    flags={"shared_expert_gate": False, "selection_bias": True},
    other_keys=frozenset({"partial_rotary_factor", "num_nextn_predict_layers"}),
    dense_layers="first_k", shared_expert_count_key="n_shared_experts",
    shared_expert_names="mlp.shared_experts",
    moe_names={**_MLP_MOE, SELECTION_BIAS: "mlp.gate.e_score_correction_bias"})

_GPT_OSS_EXPERTS = "mlp.experts"
GPT_OSS = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", experts_key="num_local_experts",
    defaults={"num_experts": 128, "num_experts_per_tok": 4, "rope_theta": 150000.0,
              "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0,
              "swiglu_alpha": 1.702, "sliding_window": 128,
              "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 4096}},
    keys=(_ATTENTION_BIAS, Key("swiglu_limit", ("swiglu_limit",), float),
          Key("swiglu_alpha", ("swiglu_alpha",), float)),
    flags={"norm_topk_prob": True, "attention_sinks": True, "router_bias": True,
           "expert_biases": True},
    # The Hub's config.json: experts_per_token (read as num_experts_per_tok) and
    # initial_context_length (transformers reads it nowhere; YaRN's length is in rope_scaling).
    other_keys=frozenset({"experts_per_token", "initial_context_length"}),
    window="per_layer", scratch={"attention_bias": True}, interleaved_experts=True,
    quantizations=frozenset({"mxfp4"}),
    moe_names={"router": "mlp.router.weight", "router_bias": "mlp.router.bias",
               "w_gate": f"{_GPT_OSS_EXPERTS}.gate_up_proj",
               "w_up": f"{_GPT_OSS_EXPERTS}.gate_up_proj",
               "w_down": f"{_GPT_OSS_EXPERTS}.down_proj",
               "b_gate": f"{_GPT_OSS_EXPERTS}.gate_up_proj_bias",
               "b_up": f"{_GPT_OSS_EXPERTS}.gate_up_proj_bias",
               "b_down": f"{_GPT_OSS_EXPERTS}.down_proj_bias"})

DEEPSEEK_V3 = Family(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
    experts_key="n_routed_experts",
    defaults={"num_experts": 256, "num_experts_per_tok": 8, "rope_theta": 1e4,
              "rms_norm_eps": 1e-6, "moe_intermediate_size": 2048, "attention_bias": False,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
              "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "rope_interleave": True},
    keys=(_ATTENTION_BIAS,
          Key("q_lora_rank", ("q_lora_rank",), lambda rank: int(rank or 0),
              lambda rank: rank or None),
          Key("kv_lora_rank", ("kv_lora_rank",), int),
          Key("qk_rope_head_dim", ("qk_rope_head_dim",), int),
          Key("v_head_dim", ("v_head_dim",), int),
          Key("rope_interleave", ("rope_interleave",), bool)),
    router_keys=GLM4_MOE.router_keys, router_flags=GLM4_MOE.router_flags,
    # The Hub's config.json: its router spelled out (noaux_tc: the selection bias and groups),
    # every layer after the first k routed, and the MoE parallelism / training-loss settings
    # (ep_size, aux_loss_alpha, seq_aux) that transformers does not read.
    required={"norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
              "moe_layer_freq": 1, "pretraining_tp": 1},
    flags={"shared_expert_gate": False, "selection_bias": True},
    other_keys=frozenset({"qk_nope_head_dim", "qk_head_dim", "num_nextn_predict_layers",
                          "num_mtp_layers", "ep_size", "aux_loss_alpha", "seq_aux"}),
    dense_layers="first_k", shared_expert_count_key="n_shared_experts",
    shared_expert_names="mlp.shared_experts", quantizations=frozenset({"fp8"}),
    latent_attention=True, moe_names=GLM4_MOE.moe_names)

# The Gated DeltaNet hybrids' own keys: the linear layers' sizes (transformers' defaults are
# Qwen3-Next-80B's), read into the LMArchitecture fields of the same names.
_LINEAR_SIZES = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                 "linear_conv_kernel_dim": 4}
_HYBRID_DEFAULTS = {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "head_dim": 256,
                    "partial_rotary_factor": 0.25, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "attention_bias": False,
                    **_LINEAR_SIZES}
_HYBRID_KEYS = (_ATTENTION_BIAS,
                Key("shared_expert_intermediate_size", ("shared_expert_size",), int),
                *(Key(name, (name,), int) for name in _LINEAR_SIZES))
_HYBRID_FLAGS = {"norm": "zero_centred_rms", "qk_norm": "head", "attention_output_gate": True}
_MTP = {"mtp.": "multi-token prediction"}

QWEN3_NEXT = Family(
    model_type="qwen3_next", architecture="Qwen3NextForCausalLM", experts_key="num_experts",
    defaults={**_HYBRID_DEFAULTS, "num_experts": 512, "num_experts_per_tok": 10,
              "norm_topk_prob": True},
    keys=(*_HYBRID_KEYS, _NORM_TOPK_PROB),
    flags={**_HYBRID_FLAGS, "linear_layout": "fused"},
    # The Hub's config.json: top-level partial_rotary_factor, sliding window off.
    other_keys=frozenset({"partial_rotary_factor"}), required={"use_sliding_window": False},
    dense_layers="sparse_step", linear_attention=True, skipped=_MTP, moe_names=_MLP_MOE)

QWEN3_5_MOE_TEXT = Family(
    model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM",
    experts_key="num_experts",
    defaults={**_HYBRID_DEFAULTS, "num_experts": 256, "num_experts_per_tok": 8},
    keys=_HYBRID_KEYS,
    # Its router always renormalises the k gates (no norm_topk_prob key).
    flags={**_HYBRID_FLAGS, "linear_layout": "separate", "norm_topk_prob": True},
    # The Hub's text_config: its gated attention spelled out, the multi-token-prediction
    # layer's settings (transformers builds none), top-level partial_rotary_factor.
    other_keys=frozenset({"partial_rotary_factor", "mtp_num_hidden_layers",
                          "mtp_use_dedicated_embeddings"}),
    required={"attn_output_gate": True}, dense_layers="moe_only", linear_attention=True,
    skipped={**_MTP, "model.visual.": "vision tower"},
    renamed={"model.language_model.": "model."},
    moe_names=_MLP_MOE)

# GLM-4.7-Flash: DeepSeek-V3's latent attention on GLM-4.5's routing (sigmoid scores, the selection
# bias, groups scored by their two best, scaling, shared experts), its dense layers named per layer.
GLM4_MOE_LITE = Family(
    model_type="glm4_moe_lite", architecture="Glm4MoeLiteForCausalLM",
    experts_key="n_routed_experts",
    defaults={"num_experts": 64, "num_experts_per_tok": 4, "rope_theta": 1e4,
              "rms_norm_eps": 1e-5, "moe_intermediate_size": 1536, "attention_bias": False,
              "n_shared_experts": 1, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
              "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
              "qk_rope_head_dim": 64, "v_head_dim": 256, "rope_interleave": True},
    keys=DEEPSEEK_V3.keys, router_keys=GLM4_MOE.router_keys, router_flags=GLM4_MOE.router_flags,
    # The Hub's config.json: the router spelled out as DeepSeek-V3's (which transformers does
    # not read: it computes these values only).
    required={"norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
              "moe_layer_freq": 1, "pretraining_tp": 1},
    flags={"shared_expert_gate": False, "selection_bias": True},
    other_keys=frozenset({"qk_nope_head_dim", "qk_head_dim", "num_nextn_predict_layers",
                          "partial_rotary_factor"}),
    dense_layers="mlp_layer_types", shared_expert_count_key="n_shared_experts",
    shared_expert_names="mlp.shared_experts", latent_attention=True,
    moe_names=GLM4_MOE.moe_names)

# MiniMax-M2 in its Hub checkpoints' keys: transformers 5.23 reads rotary_dim (as the partial
# rotary factor) and computes the other keys' one value (q/k norms over the whole projections,
# sigmoid scores with the selection bias, no shared expert, softmax attention on every layer);
# its multi-token-prediction modules are built by neither.
MINIMAX_M2 = Family(
    model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM",
    experts_key="num_local_experts",
    defaults={"num_experts": 256, "num_experts_per_tok": 8, "rope_theta": 5e6,
              "rms_norm_eps": 1e-6, "router_jitter_noise": 0.0},
    keys=(Key("router_jitter_noise", ("moe_input_jitter",), float),),
    router_flags={"score": "sigmoid"},
    required={"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
              "use_routing_bias": True, "shared_intermediate_size": 0},
    required_entries={"attn_type_list": 1},
    flags={"qk_norm": "full", "selection_bias": True},
    other_keys=frozenset({"rotary_dim", "partial_rotary_factor", "use_mtp", "num_mtp_modules",
                          "mtp_transformer_layers"}),
    quantizations=frozenset({"fp8"}),
    moe_names={**_moe_names("block_sparse_moe", "w1", "w3", "w2"),
               SELECTION_BIAS: "block_sparse_moe.e_score_correction_bias"})

# Llama 4's text model (Scout, Maverick; the text_config of their multimodal checkpoints): the
# experts gated on their inputs by the chosen logits' sigmoids, a shared expert, rotary positions
# in interleaved pairs, chunked attention with L2 q/k norms on the rotary layers and temperature
# tuning on the others.
_LLAMA4_EXPERTS = "feed_forward.experts"
LLAMA4_TEXT = Family(
    model_type="llama4_text", architecture="Llama4ForCausalLM",
    experts_key="num_local_experts",
    defaults={"num_experts": 16, "num_experts_per_tok": 1, "rope_theta": 500000.0,
              "rms_norm_eps": 1e-5, "attention_bias": False, "use_qk_norm": True},
    keys=(_ATTENTION_BIAS,
          Key("use_qk_norm", ("qk_norm",), lambda on: "l2" if on else "none",
              lambda norm: norm == "l2")),
    flags={"input_gates": True, "shared_expert_gate": False, "rope_interleave": True},
    # transformers' Llama 4 applies no router jitter; for_llm_compressor (the Hub's) is read by
    # neither.
    other_keys=frozenset({"router_jitter_noise", "for_llm_compressor"}),
    dense_layers="moe_step", window="chunked", interleaved_experts=True, halved_experts=True,
    shared_expert_always=True, shared_expert_names="feed_forward.shared_expert",
    dense_mlp="feed_forward", fused_router="feed_forward.router.weight",
    moe_names={"router": "feed_forward.router.weight",
               "w_gate": f"{_LLAMA4_EXPERTS}.gate_up_proj",
               "w_up": f"{_LLAMA4_EXPERTS}.gate_up_proj",
               "w_down": f"{_LLAMA4_EXPERTS}.down_proj"})

#: Types read as another where their keys are the other's: Kimi-K2's config.json says
#: ``kimi_k2`` (with remote code) for DeepSeek-V3's architecture.
ALIASES = {"kimi_k2": "deepseek_v3"}
#: Types whose config.json holds the text model of another under ``text_config`` (Qwen3.5's
#: image-text-to-text checkpoints): read as that text model (:func:`text_model_config`).
TEXT_MODELS = {"qwen3_5_moe": "qwen3_5_moe_text"}

#: The families, in :data:`sparsemixer_jax.models.lm_config.MODEL_TYPES`' order.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (MIXTRAL, QWEN3_MOE, OLMOE, QWEN2_MOE,
                                                           PHIMOE, GLM4_MOE, GPT_OSS,
                                                           DEEPSEEK_V3, QWEN3_NEXT,
                                                           QWEN3_5_MOE_TEXT, GLM4_MOE_LITE,
                                                           MINIMAX_M2, LLAMA4_TEXT)}


def family_of(model_type: Any, where: str = "config.json: model_type ") -> Family:
    """The record of ``model_type``, or a one-line ValueError naming the supported types
    (``where`` prefixes the value); an alias (:data:`ALIASES`) gives the type it stands for, a
    type of :data:`TEXT_MODELS` its text model's."""
    if isinstance(model_type, str):
        model_type = ALIASES.get(model_type, TEXT_MODELS.get(model_type, model_type))
    if model_type not in FAMILIES:
        aliases = ", ".join(f"{alias} as {target}"
                            for alias, target in {**ALIASES, **TEXT_MODELS}.items())
        raise ValueError(f"{where}{model_type!r} is not supported; supported: "
                         f"{', '.join(FAMILIES)} (read: {aliases})")
    return FAMILIES[model_type]


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` itself, or for a type of :data:`TEXT_MODELS` its ``text_config`` (with the
    top-level ``tie_word_embeddings`` and token ids where the text model has none): a one-line
    ValueError if that holds no text model of the expected type."""
    wrapper = cfg.get("model_type")
    if not isinstance(wrapper, str) or wrapper not in TEXT_MODELS:
        return cfg
    text, target = cfg.get("text_config"), TEXT_MODELS[wrapper]
    if not isinstance(text, dict) or text.get("model_type", target) != target:
        got = text.get("model_type") if isinstance(text, dict) else text
        raise ValueError(f"config.json ({wrapper}): text_config must hold the text model "
                         f"(model_type {target!r}), got {got!r}")
    inherited = {k: cfg[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id",
                                     "pad_token_id", "transformers_version") if k in cfg}
    return {**inherited, **text, "model_type": target}


def types_with(trait: Callable[[Family], bool]) -> list[str]:
    """The model types whose record has ``trait`` (for messages naming the alternatives)."""
    return [t for t, family in FAMILIES.items() if trait(family)]
