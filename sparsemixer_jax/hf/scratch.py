"""A language model trained from scratch as a model of a Hugging Face type: the ``config.json``
its type would carry (:func:`hf_config_of`), read back by :func:`~sparsemixer_jax.hf.from_hf`
(:func:`from_scratch_config`), so that it is initialised, computed and exported exactly as a
checkpoint of that type; and the router section's routing laid over a type's own
(:func:`router_overrides`, for a checkpoint fine-tuned by the router section too).

The model's shape comes from the task's model section (:class:`ScratchShape`: the
language-modelling task's ``LMModelConfig``), its routing from
:class:`~sparsemixer_jax.routers.RouterConfig`, how it computes from
:class:`~sparsemixer_jax.models.lm_config.LMExecution`.
"""

from __future__ import annotations

from typing import Any, Protocol

from sparsemixer_jax.hf.config import from_hf
from sparsemixer_jax.hf.families import family_of, types_with
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution
from sparsemixer_jax.routers import RouterConfig, registry
from sparsemixer_jax.routers.registry import ROUTER_OPTIONS

#: The routing options of the router section that every type's MoE layers take as they are
#: (docs/routing.md): scores, bias balancing, the balance loss's scope, groups.
SELECTION_OPTIONS = ("score", "routed_scaling_factor", "bias_update_rate", "balance_scope",
                     "num_groups", "top_groups", "group_score")


class ScratchShape(Protocol):
    """What :func:`hf_config_of` reads of a from-scratch model's section (the language-modelling
    task's model section has these fields; ``head_dim`` and ``num_kv_heads`` 0: the type's
    defaults, ``shared_expert_dim`` 0: ``mlp_dim``; ``hf_keys``: further ``config.json`` keys
    laid over the ones written from the other fields)."""

    hf_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    num_experts: int
    moe_every: int
    shared_expert_dim: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float
    initializer_range: float
    max_position_embeddings: int
    hf_keys: dict[str, Any]


def _section_values(model: ScratchShape, router: RouterConfig) -> dict[str, Any]:
    """The :class:`LMConfig` fields that a type reads from its own keys and that the model and
    router sections give a from-scratch model (the type's other keys keep their defaults)."""
    return {"norm_topk_prob": router.normalize_top_k, "jitter_eps": router.jitter_eps,
            "shared_expert_size": model.shared_expert_dim or model.mlp_dim}


def hf_config_of(model: ScratchShape, router: RouterConfig, vocab_size: int,
                 num_experts: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a from-scratch model of type ``model.hf_type``, with the
    router's ``top_k`` (and ``normalize_top_k`` where the type has ``norm_topk_prob``);
    ``num_experts`` replaces the section's (None: the section's)."""
    m, family = model, family_of(model.hf_type, "config.model.hf_type=")
    experts = m.num_experts if num_experts is None else num_experts
    cfg: dict[str, Any] = {
        "model_type": family.model_type, "vocab_size": vocab_size,
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "intermediate_size": m.mlp_dim, "num_experts_per_tok": router.top_k,
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.initializer_range,
        "max_position_embeddings": m.max_position_embeddings, "hidden_act": "silu",
        "router_aux_loss_coef": router.balance_weight, family.experts_key: experts,
        **family.scratch,
    }
    if not family.head_dim_fixed:
        cfg["head_dim"] = m.head_dim or m.hidden_size // m.num_heads
    sections = _section_values(m, router)
    cfg.update({key.name: sections[key.fields[0]] for key in family.keys
                if key.fields[0] in sections})
    if family.dense_layers and family.dense_layers != "moe_step":
        cfg["moe_intermediate_size"] = m.mlp_dim
    if family.dense_layers == "sparse_step":
        routed = [i for i in range(m.num_layers) if (i + 1) % m.moe_every == 0]
        cfg.update(decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.num_layers) if i not in routed])
    elif family.dense_layers == "first_k":
        cfg["first_k_dense_replace"] = 0  # every layer routed, as the model section's others
    elif family.dense_layers == "moe_step":  # Llama 4: experts and dense MLP mlp_dim wide
        cfg.update(intermediate_size_mlp=m.mlp_dim,
                   moe_layers=[i for i in range(m.num_layers) if (i + 1) % m.moe_every == 0])
    elif family.dense_layers == "mlp_layer_types":  # every moe_every-th layer routed
        cfg["mlp_layer_types"] = ["sparse" if (i + 1) % m.moe_every == 0 else "dense"
                                  for i in range(m.num_layers)]
    cfg.update(m.hf_keys)
    return cfg


def router_overrides(router: RouterConfig, hf_type: str, *, over_type: bool = True
                     ) -> dict[str, Any]:
    """The :class:`LMConfig` fields that route by the config's router section. ``norm_topk_prob``
    is the type's own for the types without the key (``mixtral`` always renormalises;
    :func:`check_router_for_lm` refuses a normalising router without it; ``phimoe``'s router
    never renormalises).

    ``over_type`` (a model from scratch): the type's own routing (GLM-4.5's sigmoid scores,
    ...) with the section's options that differ from their defaults over it. Otherwise
    (``init_router="config"``) the section is the whole routing: each option the type's own
    routing sets takes the section's value, default or not, so that what the section (and the
    run's ``config.json``) says is what routes the model, and its export records."""
    defaults, flags = RouterConfig(), family_of(hf_type).router_flags
    options = dict(flags) if over_type else {}
    options.update((name, getattr(router, name)) for name in (*ROUTER_OPTIONS, *SELECTION_OPTIONS)
                   if getattr(router, name) != getattr(defaults, name)
                   or (not over_type and name in flags))
    options = tuple(sorted(options.items()))
    fields = {"router": router.name, "jitter_eps": router.jitter_eps, "top_k": router.top_k,
              "router_options": options}
    if family_of(hf_type).reads("norm_topk_prob"):
        fields["norm_topk_prob"] = router.normalize_top_k
    return fields


def check_router_for_lm(router: RouterConfig, hf_type: str, where: str = "config.router."
                        ) -> None:
    """The router options the language model cannot honour, each as a one-line ValueError."""
    if router.init_scale != 1.0:
        raise ValueError(f"{where}init_scale={router.init_scale}: the language model's router "
                         "is initialised as its type's (normal with initializer_range); "
                         "leave it at 1.0")
    if family_of(hf_type).flags.get("norm_topk_prob") and \
            router.name in registry.routers_taking("normalize_top_k") and not router.renormalises:
        choices = " or ".join(types_with(lambda f: f.reads("norm_topk_prob")))
        raise ValueError(f"{where}normalize_top_k=False: {hf_type} renormalises its top-k "
                         f"gates; set it True, or choose model.hf_type {choices} "
                         "(norm_topk_prob)")


def from_scratch_config(model: ScratchShape, router: RouterConfig, vocab_size: int,
                        execution: LMExecution = LMExecution()) -> LMConfig:  # noqa: B008
    """The :class:`LMConfig` of a model trained from scratch: ``model``'s shape, routed by
    ``router`` (:func:`router_overrides` over the type's own), computing as ``execution``."""
    check_router_for_lm(router, model.hf_type)
    if model.num_experts == 0:
        # A dense model: the type's layers with every feed-forward sublayer a SwiGLU MLP of
        # width mlp_dim. The expert count the type's config needs routes nothing (top_k: the
        # router's checks pass; no layer builds a router).
        lm = from_hf(hf_config_of(model, router, vocab_size, num_experts=router.top_k),
                     **router_overrides(router, model.hf_type), execution=execution)
        return lm.replace(moe_layers=(False,) * lm.arch.num_layers, intermediate_size=model.mlp_dim)
    return from_hf(hf_config_of(model, router, vocab_size),
                   **router_overrides(router, model.hf_type), execution=execution)
