"""The typed sections of a language-modelling config: ``config.model`` (a from-scratch
:class:`~sparsemixer_jax.models.lm_config.LMConfig` of a Hugging Face model type), the router
section applied to it or to a checkpoint, and ``config.sample`` (the text generated at the end).

A from-scratch model is described as the ``config.json`` of its type would describe it
(:func:`hf_config_of`) and built by :func:`sparsemixer_jax.hf.from_hf`, so it is initialised,
computed and exported exactly as a checkpoint of that type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsemixer_jax.layers import ATTENTION_IMPLS
from sparsemixer_jax.models.lm_config import MODEL_TYPES, LMConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.routers.registry import ROUTER_OPTIONS
from sparsemixer_jax.section import check_positive, read_fields

# The routing options of the router section that every type's MoE layers take as they are
# (docs/routing.md): scores, bias balancing, the balance loss's scope, groups.
SELECTION_OPTIONS = ("score", "routed_scaling_factor", "bias_update_rate", "balance_scope",
                     "num_groups", "top_groups")

# The checkpoint's routing is kept on fine-tuning unless config.init_router says "config".
INIT_ROUTERS = ("checkpoint", "config")


@dataclasses.dataclass(frozen=True)
class LMModelConfig:
    """``config.model`` of a language-modelling run (schema: ``configs/lm_quickstart.py``).

    Attributes:
      hf_type: the architecture family, a Hugging Face ``model_type`` of
        :data:`~sparsemixer_jax.models.lm_config.MODEL_TYPES` (``mixtral``: RMSNorm, no biases;
        ``qwen3_moe``: per-head q/k norms; ``olmoe``: q/k norms over the projection;
        ``qwen2_moe``: q/k/v biases and a shared expert; ``phimoe``: LayerNorm, biases).
      hidden_size, num_layers, num_heads, num_kv_heads, head_dim (0 = hidden / heads): sizes.
      mlp_dim: width of each expert (and of the dense layers' MLP).
      num_experts: experts per MoE layer (0: a dense model, every feed-forward sublayer a
        SwiGLU MLP of width ``mlp_dim``; trained from scratch, not exported to Hugging Face,
        whose MoE types have no such model); moe_every: layers ``k - 1, 2k - 1, ...`` are
        routed, the others dense (``qwen3_moe`` / ``qwen2_moe`` only; the others route every
        layer).
      shared_expert_dim: ``qwen2_moe``'s shared expert width (0: ``mlp_dim``).
      tie_embeddings, rope_theta, norm_eps, initializer_range, max_position_embeddings: as the
        type's ``config.json`` keys.
      dispatch, grouped_impl, capacity_factor, compute_dtype: the MoE layer's and the matmuls'.
      attention_impl: ``einsum`` (transformers' computation), ``xla``/``auto``
        (``jax.nn.dot_product_attention``) or ``cudnn`` (flash attention, bf16 on NVIDIA GPUs).
      remat: what the scanned layers' backward pass recomputes
        (:data:`~sparsemixer_jax.models.lm_config.REMAT_POLICIES`).
      dropout, attention_dropout, activation_dropout, activation, init,
        num_shared_experts, shared_expert_gate: the fields every model section has
        (:func:`sparsemixer_jax.config.moe_model_fields`); the language model has no dropout,
        SwiGLU (``silu``) experts, the types' own normal initialisation
        (``init="normal"``) and only Qwen2-MoE's own shared expert, so only the defaults are
        taken.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    hf_type: str = "mixtral"
    num_kv_heads: int = 0
    head_dim: int = 0
    num_experts: int = 8
    moe_every: int = 1
    shared_expert_dim: int = 0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    dispatch: str = "auto"
    grouped_impl: str = "mosaic"
    capacity_factor: float = 0.0
    compute_dtype: str = "float32"
    remat: str = "none"
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "silu"
    attention_impl: str = "einsum"
    init: str = "normal"
    num_shared_experts: int = 0
    shared_expert_gate: bool = False

    @classmethod
    def from_config(cls, section: Any, where: str = "config.model.") -> LMModelConfig:
        m = cls(**read_fields(cls, section, where))
        if m.hf_type not in MODEL_TYPES:
            raise ValueError(f"{where}hf_type={m.hf_type!r} is not supported; supported: "
                             f"{', '.join(MODEL_TYPES)}")
        check_positive(where, hidden_size=m.hidden_size, num_layers=m.num_layers,
                       num_heads=m.num_heads, mlp_dim=m.mlp_dim, moe_every=m.moe_every)
        if isinstance(m.num_experts, bool) or not isinstance(m.num_experts, int) \
                or m.num_experts < 0:
            raise ValueError(f"{where}num_experts must be an int >= 0 (0: a dense model), got "
                             f"{m.num_experts!r}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if getattr(m, name):
                raise ValueError(f"{where}{name}={getattr(m, name)}: the language model has no "
                                 "dropout (Hugging Face's MoE types use none); set it to 0")
        for name, only in (("activation", "silu"), ("init", "normal")):
            if getattr(m, name) != only:
                raise ValueError(f"{where}{name}={getattr(m, name)!r}: the language model "
                                 f"takes only {only!r}")
        if m.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{where}attention_impl={m.attention_impl!r}; choose one of "
                             f"{', '.join(ATTENTION_IMPLS)}")
        if m.attention_impl == "cudnn" and m.compute_dtype != "bfloat16":
            raise ValueError(f"{where}attention_impl='cudnn' needs {where}compute_dtype="
                             f"'bfloat16' (cuDNN's flash attention), got {m.compute_dtype!r}")
        if m.moe_every != 1 and m.hf_type not in ("qwen3_moe", "qwen2_moe"):
            raise ValueError(f"{where}moe_every={m.moe_every}: {m.hf_type} routes every layer; "
                             "dense layers need hf_type qwen3_moe or qwen2_moe")
        if m.num_shared_experts or m.shared_expert_gate:
            raise ValueError(f"{where}num_shared_experts / shared_expert_gate: the language "
                             "model's shared expert is its type's own (gated, Hugging Face's "
                             "layout): use model.hf_type='qwen2_moe' with model.shared_expert_dim")
        if m.shared_expert_dim and m.hf_type != "qwen2_moe":
            raise ValueError(f"{where}shared_expert_dim: only qwen2_moe has a shared expert")
        return m

    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


def hf_config_of(model: LMModelConfig, router: RouterConfig, vocab_size: int
                 ) -> dict[str, Any]:
    """The ``config.json`` of a from-scratch model of type ``model.hf_type``, with the
    router's ``top_k`` (and ``normalize_top_k`` where the type has ``norm_topk_prob``)."""
    m, t = model, model.hf_type
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    cfg: dict[str, Any] = {
        "model_type": t, "vocab_size": vocab_size, "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads(), "intermediate_size": m.mlp_dim,
        "num_experts_per_tok": router.top_k, "rms_norm_eps": m.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.initializer_range,
        "max_position_embeddings": m.max_position_embeddings, "hidden_act": "silu",
        "router_aux_loss_coef": router.balance_weight,
    }
    if t != "olmoe":
        cfg["head_dim"] = head_dim
    if t in ("mixtral", "phimoe"):
        cfg["num_local_experts"] = m.num_experts
    else:
        cfg["num_experts"] = m.num_experts
        cfg["norm_topk_prob"] = router.normalize_top_k
    if t in ("qwen3_moe", "qwen2_moe"):
        routed = [i for i in range(m.num_layers) if (i + 1) % m.moe_every == 0]
        cfg.update(moe_intermediate_size=m.mlp_dim, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.num_layers) if i not in routed])
    if t == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = m.shared_expert_dim or m.mlp_dim
    if t in ("qwen3_moe", "olmoe"):
        cfg["attention_bias"] = False
    if t == "phimoe":
        cfg.update(attention_bias=True, lm_head_bias=True, router_jitter_noise=router.jitter_eps,
                   input_jitter_noise=0.0)
    return cfg


def router_overrides(router: RouterConfig, hf_type: str) -> dict[str, Any]:
    """The :class:`LMConfig` fields that route by the config's router section. ``norm_topk_prob``
    is the type's own for ``mixtral`` (always on; :func:`check_router_for_lm` refuses a
    normalising router without it) and ``phimoe`` (its router never renormalises)."""
    defaults = RouterConfig()
    options = tuple(sorted((name, getattr(router, name))
                           for name in (*ROUTER_OPTIONS, *SELECTION_OPTIONS)
                           if getattr(router, name) != getattr(defaults, name)))
    fields = {"router": router.name, "jitter_eps": router.jitter_eps, "top_k": router.top_k,
              "router_options": options}
    if hf_type not in ("mixtral", "phimoe"):
        fields["norm_topk_prob"] = router.normalize_top_k
    return fields


def check_router_for_lm(router: RouterConfig, hf_type: str, where: str = "config.router."
                        ) -> None:
    """The router options the language model cannot honour, each as a one-line ValueError."""
    if router.init_scale != 1.0:
        raise ValueError(f"{where}init_scale={router.init_scale}: the language model's router "
                         "is initialised as its type's (normal with initializer_range); "
                         "leave it at 1.0")
    if hf_type == "mixtral" and router.name in _routers_normalizing() and \
            not router.renormalises:
        raise ValueError(f"{where}normalize_top_k=False: mixtral renormalises its top-k gates; "
                         "set it True, or choose model.hf_type qwen3_moe or olmoe "
                         "(norm_topk_prob)")


def _routers_normalizing() -> list[str]:
    from sparsemixer_jax.routers import registry

    return registry._routers_taking("normalize_top_k")


def from_scratch_config(model: LMModelConfig, router: RouterConfig, vocab_size: int
                        ) -> LMConfig:
    """The :class:`LMConfig` of a model trained from scratch."""
    from sparsemixer_jax.hf.config import from_hf

    check_router_for_lm(router, model.hf_type)
    if model.num_experts == 0:
        # A dense model: the type's layers with every feed-forward sublayer a SwiGLU MLP of
        # width mlp_dim. The expert count the type's config needs routes nothing (top_k: the
        # router's checks pass; no layer builds a router).
        lm = from_hf(hf_config_of(dataclasses.replace(model, num_experts=router.top_k), router,
                                  vocab_size),
                     **router_overrides(router, model.hf_type), **model_overrides(model))
        return lm.replace(moe_layers=(False,) * lm.num_layers, intermediate_size=model.mlp_dim)
    return from_hf(hf_config_of(model, router, vocab_size),
                   **router_overrides(router, model.hf_type),
                   **model_overrides(model))


def model_overrides(model: LMModelConfig) -> dict[str, Any]:
    """The :class:`LMConfig` fields the model section sets on a checkpoint too."""
    return {"dispatch": model.dispatch, "grouped_impl": model.grouped_impl,
            "capacity_factor": model.capacity_factor, "compute_dtype": model.compute_dtype,
            "attention_impl": model.attention_impl, "remat": model.remat}


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """``config.sample``: the text generated at the end of a run (``sample.txt``).

    Attributes:
      prompt: the text continued (each ``|``-separated prompt gives one sample).
      tokens: tokens generated per sample (0 = none).
      temperature: 0 for greedy decoding, else sampling (with ``top_k``; 0 = all tokens).
    """

    prompt: str = "The"
    tokens: int = 48
    temperature: float = 0.8
    top_k: int = 40

    @classmethod
    def from_config(cls, section: Any, where: str = "config.sample.") -> SampleConfig:
        s = cls(**read_fields(cls, section, where))
        if s.tokens < 0 or s.top_k < 0 or s.temperature < 0:
            raise ValueError(f"{where}tokens, top_k and temperature must be >= 0, got "
                             f"{s.tokens}, {s.top_k}, {s.temperature}")
        return s

    def prompts(self) -> list[str]:
        return [p.strip() for p in self.prompt.split("|") if p.strip()] or [""]
