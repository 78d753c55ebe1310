"""The typed sections of a language-modelling config: ``config.model`` (the shape of a
from-scratch model of a Hugging Face model type; how every model computes is the section's
:class:`~sparsemixer_jax.models.lm_config.LMExecution`), the rules by which the router section
routes a model from scratch or a checkpoint, and ``config.sample`` (the text generated at the
end). :mod:`sparsemixer_jax.hf.scratch` builds the model's
:class:`~sparsemixer_jax.models.lm_config.LMConfig` from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsemixer_jax.hf.families import family_of, types_with
from sparsemixer_jax.hf.scratch import SELECTION_OPTIONS
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.routers.registry import ROUTER_OPTIONS
from sparsemixer_jax.section import check_positive, read_fields

# The checkpoint's routing is kept on fine-tuning unless config.init_router says "config".
INIT_ROUTERS = ("checkpoint", "config")
# The config.json keys a from-scratch model takes from the config's own fields, not from
# config.model.hf_keys.
SECTION_KEYS = {"model_type": "config.model.hf_type", "vocab_size": "config.data.vocab_size",
                "hidden_size": "config.model.hidden_size",
                "num_hidden_layers": "config.model.num_layers",
                "num_attention_heads": "config.model.num_heads",
                "num_key_value_heads": "config.model.num_kv_heads",
                "num_experts_per_tok": "config.router.top_k",
                "experts_per_token": "config.router.top_k",
                "num_experts": "config.model.num_experts",
                "num_local_experts": "config.model.num_experts",
                "n_routed_experts": "config.model.num_experts"}
# The router section's fields a fine-tuning run honours whatever routes it: the auxiliary losses
# (of RouterConfig) and whether the routers train (read by the optimizer's settings). With
# init_router="checkpoint" the checkpoint's routing replaces every other field.
ROUTER_LOSS_FIELDS = ("balance_weight", "z_loss_weight", "balance_normalization")
ROUTER_TRAINING_FIELDS = (*ROUTER_LOSS_FIELDS, "trainable")


def router_of_run(section: Any, init_from: str, init_router: str) -> RouterConfig:
    """The run's :class:`RouterConfig`, checked as far as the run uses it: the whole section
    where it routes the model (from scratch, or ``init_router="config"``), else its auxiliary
    losses alone (the routing fields keep their defaults, which describe nothing: the model
    routes as the checkpoint does)."""
    if init_from and init_router == "checkpoint":
        return RouterConfig.from_config({name: section[name] for name in ROUTER_LOSS_FIELDS
                                         if name in section})
    return RouterConfig.from_config(section)


def refuse_unused_router_fields(init_from: str, init_router: str, given: Any) -> None:
    """A one-line ValueError naming ``init_router`` when ``given`` (the config fields set on
    the command line, as ``"router.score"``) holds a routing field of the router section that
    a run keeping the checkpoint's routing would ignore."""
    unused = sorted(f"--config.{name}" for name in given if name.startswith("router.")
                    and name.split(".", 1)[1] not in ROUTER_TRAINING_FIELDS)
    if init_from and init_router == "checkpoint" and unused:
        raise ValueError(
            f"{', '.join(unused)}: config.init_router='checkpoint' routes as the checkpoint "
            "does and ignores the router section's routing; add --config.init_router=config "
            f"to route by the router section, or leave {'them' if len(unused) > 1 else 'it'} "
            f"out (the router fields honoured either way: {', '.join(ROUTER_TRAINING_FIELDS)})")


def refuse_overruled_router_fields(lm: LMConfig, router: RouterConfig, given: Any) -> None:
    """A one-line ValueError naming each routing field of the router section given on the
    command line (in ``given``, as ``"router.score"``) that does not route the model ``lm``:
    a model from scratch routes by its type's own options where the section holds their
    defaults (``glm4_moe``'s ``score='sigmoid'`` over ``--config.router.score=softmax``)."""
    if not any(lm.arch.moe_layers):
        return
    routed = lm.moe_sections()[1]
    names = ("name", "top_k", "jitter_eps", *ROUTER_OPTIONS, *SELECTION_OPTIONS)
    lost = [f"--config.router.{name}={getattr(router, name)!r} (the model routes by "
            f"{getattr(routed, name)!r})" for name in names
            if f"router.{name}" in given and getattr(router, name) != getattr(routed, name)]
    if lost:
        raise ValueError(
            f"{', '.join(lost)}: a {lm.arch.model_type} model from scratch routes by its type's "
            "own options where the router section holds their defaults; fine-tune a checkpoint "
            "with --config.init_router=config to route by the section alone, or leave "
            f"{'them' if len(lost) > 1 else 'it'} out")


@dataclasses.dataclass(frozen=True)
class LMModelConfig:
    """``config.model`` of a language-modelling run from scratch (schema:
    ``configs/lm_quickstart.py``): the model's shape. How it computes is the same section's
    :class:`~sparsemixer_jax.models.lm_config.LMExecution` fields, read by that class.

    Attributes:
      hf_type: the architecture family, a Hugging Face ``model_type`` of
        :data:`~sparsemixer_jax.hf.families.FAMILIES` (``mixtral``: RMSNorm, no biases;
        ``qwen3_moe``: per-head q/k norms; ``olmoe``: q/k norms over the projection;
        ``qwen2_moe``: q/k/v biases and a shared expert; ``phimoe``: LayerNorm, biases;
        ``glm4_moe``: sigmoid routing within groups, shared experts, partial rotary;
        ``gpt_oss``: attention sinks, sliding window on every other layer, biased router and
        experts, clamped SwiGLU; ``deepseek_v3``, ``glm4_moe_lite``: latent attention, its
        widths in ``hf_keys``; ``minimax_m2``: q/k norms over the projections, sigmoid routing
        with a selection bias; ``llama4_text``: input-gated experts with a shared one, chunked
        attention, layers without rotary positions; the ``switch`` router only).
      hidden_size, num_layers, num_heads, num_kv_heads, head_dim (0 = hidden / heads): sizes.
      mlp_dim: width of each expert (and of the dense layers' MLP).
      num_experts: experts per MoE layer (0: a dense model, every feed-forward sublayer a
        SwiGLU MLP of width ``mlp_dim``; trained from scratch, not exported to Hugging Face,
        whose MoE types have no such model); moe_every: layers ``k - 1, 2k - 1, ...`` are
        routed, the others dense (``qwen3_moe`` / ``qwen2_moe`` / ``glm4_moe_lite`` /
        ``llama4_text`` only; the others route every layer).
      shared_expert_dim: ``qwen2_moe``'s shared expert width (0: ``mlp_dim``).
      tie_embeddings, rope_theta, norm_eps, initializer_range, max_position_embeddings: as the
        type's ``config.json`` keys.
      dropout, attention_dropout, activation_dropout, activation, init,
        num_shared_experts, shared_expert_gate: the fields every model section has
        (:func:`sparsemixer_jax.training.config.moe_model_fields`); the language model has no
        dropout, SwiGLU (``silu``) experts, the types' own normal initialisation
        (``init="normal"``) and only Qwen2-MoE's own shared expert, so only the defaults are
        taken.
      hf_keys: further ``config.json`` keys of ``hf_type``, laid over the ones the section
        writes (:func:`~sparsemixer_jax.hf.scratch.hf_config_of`): a from-scratch model of a
        published checkpoint's whole shape (``first_k_dense_replace`` with a dense
        ``intermediate_size``, latent attention's widths, ``layer_types``,
        ``rope_parameters``, ...). The sizes the section has fields for are set there, not here.
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
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "silu"
    init: str = "normal"
    num_shared_experts: int = 0
    shared_expert_gate: bool = False
    hf_keys: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_config(cls, section: Any, where: str = "config.model.") -> LMModelConfig:
        fields = read_fields(cls, section, where)
        keys = fields.get("hf_keys") or {}
        keys = keys.to_dict() if hasattr(keys, "to_dict") else keys
        if not isinstance(keys, dict):
            raise ValueError(f"{where}hf_keys must map config.json keys to values, got {keys!r}")
        fields["hf_keys"] = dict(keys)
        m = cls(**fields)
        family = family_of(m.hf_type, f"{where}hf_type=")
        if family.latent_attention and "kv_lora_rank" not in m.hf_keys:
            raise ValueError(f"{where}hf_type={m.hf_type!r}: its latent attention's widths are "
                             f"not model section fields; give them in {where}hf_keys "
                             "(kv_lora_rank, ...), fine-tune one of its checkpoints "
                             "(config.init_from) or choose another hf_type")
        given = sorted(set(m.hf_keys) & set(SECTION_KEYS))
        if given:
            raise ValueError(f"{where}hf_keys: {', '.join(given)} "
                             f"{'are' if len(given) > 1 else 'is'} set by "
                             f"{', '.join(SECTION_KEYS[k] for k in given)}")
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
        any_layer = ("sparse_step", "mlp_layer_types", "moe_step")  # dense layers anywhere
        if m.moe_every != 1 and family.dense_layers not in any_layer:
            alternating = types_with(lambda f: f.dense_layers in any_layer)
            layout = "routes every layer" if not family.dense_layers else \
                "has its dense layers first (first_k_dense_replace)"
            raise ValueError(f"{where}moe_every={m.moe_every}: {m.hf_type} {layout}; dense "
                             f"layers need hf_type {' or '.join(alternating)}")
        if m.num_shared_experts or m.shared_expert_gate:
            raise ValueError(f"{where}num_shared_experts / shared_expert_gate: the language "
                             "model's shared expert is its type's own (gated, Hugging Face's "
                             "layout): use model.hf_type='qwen2_moe' with model.shared_expert_dim")
        if m.shared_expert_dim and not family.reads("shared_expert_size"):
            with_one = types_with(lambda f: f.reads("shared_expert_size"))
            raise ValueError(f"{where}shared_expert_dim: {m.hf_type} has no shared expert "
                             f"(types with one: {', '.join(with_one)})")
        return m


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
