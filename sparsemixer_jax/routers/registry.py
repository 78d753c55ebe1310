"""Routers by name and their config section :class:`RouterConfig`, which checks itself.

:meth:`RouterConfig.check` owns the rules for what a router accepts: ``config.router`` is read
and checked once by :meth:`RouterConfig.from_config`; :func:`get_router` and the MoE layer's
keyword arguments build a :class:`RouterConfig` through :func:`check_router`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax

from sparsemixer_jax.routers.common import RouterOutput, check_jitter_eps, check_top_k
from sparsemixer_jax.routers.selection import (
    BALANCE_SCOPES,
    GROUP_SCORES,
    SCORES,
)
from sparsemixer_jax.routers.sparsemixer import sparsemixer_route
from sparsemixer_jax.routers.switch import switch_route
from sparsemixer_jax.routers.unchosen import UnchosenExperts
from sparsemixer_jax.section import read_fields

RouterFn = Callable[..., RouterOutput]

#: Routers selectable by name from a config: the routing function and its keyword arguments.
ROUTERS: dict[str, tuple[Callable[..., RouterOutput], dict]] = {
    "switch": (switch_route, {}),
    "sparsemixer": (sparsemixer_route, {}),
    "sparsemixer_1st": (sparsemixer_route, {"estimator": "euler"}),
    "sparsemixer_2nd": (sparsemixer_route, {"estimator": "midpoint"}),
    "sparsemixer_paper": (sparsemixer_route, {"mask": "paper", "midpoint_prob": 1.0}),
    "sparsemixer_nomask": (sparsemixer_route, {"mask": "none"}),
    "sparsemixer_v2": (sparsemixer_route, {"estimator": "v2"}),
    "sparsemixer_v2star": (sparsemixer_route, {"estimator": "v2star"}),
    # Switch's forward without its jitter, as the released code of both methods routes; the
    # layer adds unchosen_expert_term (UNCHOSEN_EXPERT_RULES) for the experts not chosen.
    "densemixer": (switch_route, {"jitter": False}),
    "densemixer_blog": (switch_route, {"jitter": False}),
    "default_moe": (switch_route, {"jitter": False}),
    "default_moe_st": (switch_route, {"jitter": False}),
    "default_moe_forward": (switch_route, {"jitter": False}),
}

#: Routers whose backward also reaches the experts a token did not choose.
#:
#: * ``densemixer`` (Yao et al., 2025, github yaof20/DenseMixer): a straight-through estimate
#:   of the top-k mask as its released code computes it (``sparse.detach() + dense -
#:   dense.detach()`` with ``dense = sum_j pi_j E_j(x)``): ``E_j(x) . dL/dy`` to every expert.
#:   ``densemixer_blog`` is its blog's formula, ``(pi_j + TopK(pi)_j) E_j(x) . dL/dy``.
#: * ``default_moe`` (Panda et al., 2025, arXiv 2504.12463): each expert keeps a default vector,
#:   an exponential moving average of its outputs, and the router receives
#:   ``default_j . dL/dy`` for every unchosen expert ``j``; the forward is Switch's (defaults in
#:   the backward only). ``default_moe_st`` is the same router under its earlier name.
#:   ``default_moe_forward`` also adds ``sum_{j unchosen} pi_j default_j`` to the output.
#:   Which of the two the paper trains with could not be checked against its method section
#:   or code; see docs/routing.md.
UNCHOSEN_EXPERT_RULES: dict[str, UnchosenExperts] = {
    "densemixer": UnchosenExperts("outputs"),
    "densemixer_blog": UnchosenExperts("outputs", weight="prob"),
    "default_moe": UnchosenExperts("defaults"),
    "default_moe_st": UnchosenExperts("defaults"),
    "default_moe_forward": UnchosenExperts("defaults", in_forward=True),
}

DEFAULT_MEANS = ("ungated", "gated")
DEFAULT_UPDATES = ("after", "before")
BALANCE_NORMALIZATIONS = ("per_token", "per_batch")
#: The fields of :class:`RouterConfig` that only some routers take (setting one away from its
#: default for a router that ignores it is an error).
ROUTER_OPTIONS = ("default_at_eval", "default_decay", "default_mean", "default_update",
                  "normalize_top_k", "successor_jitter")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """A router and its auxiliary losses: the section ``config.router`` as a typed value.

    Built once per run by :meth:`from_config` (which checks every field) and handed to the MoE
    layers; hashable, so the layers keep it as static metadata.

    Attributes:
      name: a key of :data:`ROUTERS`.
      jitter_eps: Switch's jitter ``r``; SparseMixer's mask threshold.
      top_k: experts per token, ``1 <= top_k <= num_experts``.
      balance_weight, z_loss_weight: weights of the load-balancing loss and the router z-loss.
      balance_normalization: ``"per_token"`` (the balance loss weighted by a micro-batch's tokens)
        or ``"per_batch"`` (once per micro-batch: the reference's fairseq objective).
      init_scale: multiplies the variance of the router's initial weight and bias as the
        initialisation scheme draws them (0.1: the Switch Transformer's smaller router).
      normalize_top_k: renormalise the ``k`` gates to sum to 1 (Mixtral; Qwen and DeepSeek
        models with ``norm_topk_prob``). ``switch``, ``densemixer``, ``default_moe*``.
      successor_jitter: DenseMixer and Default MoE route with Switch's multiplicative jitter
        ``U(1 - jitter_eps, 1 + jitter_eps)`` in training; their released code has none.
      default_decay: Default MoE's EMA decay ``beta`` of the default vectors, in ``(0, 1)``.
      default_at_eval: ``default_moe_forward`` also adds the defaults at inference.
      default_mean: what the EMA averages: ``"ungated"`` each routed row's expert output
        ``f_D(x)``, ``"gated"`` its contribution ``gate * f_D(x)``.
      default_update: ``"after"``: the step's term uses the defaults as they were before this
        batch, then the EMA takes the batch in; ``"before"``: the EMA takes the batch in first.
      score: ``"softmax"`` (router probabilities) or ``"sigmoid"`` (DeepSeek-V3: experts
        selected on per-expert sigmoid scores, the chosen ones' gates renormalised to sum to
        ``routed_scaling_factor``). Routers with Switch's forward at ``top_k >= 2``, and every
        SparseMixer router at any ``top_k`` (sampling from the normalised scores, with its
        two-path estimator; docs/routing.md); not ``densemixer_blog``.
      routed_scaling_factor: multiplies the renormalised sigmoid gates (DeepSeek-V3: 2.5).
      bias_update_rate: auxiliary-loss-free balancing: a per-expert bias added to the selection
        scores only (the logits under softmax), moved by ``rate * sign(mean load - load_i)``
        after every optimizer update from that update's loads; 0 turns it off. Every router
        (SparseMixer with its two-path estimator, docs/routing.md).
      balance_scope: over which tokens the balance loss's expert fractions are counted:
        ``"micro_batch"`` (all tokens of a micro-batch, on every data-parallel device),
        ``"sequence"`` (each sequence's own loss, averaged), ``"global_batch"`` (the counts of
        the update's micro-batches so far).
      num_groups, top_groups: group-limited routing: the experts form ``num_groups`` groups of
        consecutive experts, a token keeps the ``top_groups`` groups with the largest best
        selection score and picks its experts among theirs; ``num_groups=1`` turns it off.
      group_score: a group's score: ``"max"``, its best expert's, or ``"top2_sum"``, the sum of
        its two best (DeepSeek-V3, GLM-4.5; groups of at least 2 experts).
    """

    name: str = "sparsemixer"
    jitter_eps: float = 0.1
    top_k: int = 1
    balance_weight: float = 0.01
    balance_normalization: Literal["per_token", "per_batch"] = "per_token"
    z_loss_weight: float = 0.0
    init_scale: float = 1.0
    normalize_top_k: bool = False
    successor_jitter: bool = False
    default_decay: float = 0.9
    default_at_eval: bool = True
    default_mean: Literal["ungated", "gated"] = "ungated"
    default_update: Literal["after", "before"] = "after"
    score: Literal["softmax", "sigmoid"] = "softmax"
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 0.0
    balance_scope: Literal["micro_batch", "sequence", "global_batch"] = "micro_batch"
    num_groups: int = 1
    top_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"

    @classmethod
    def from_config(cls, section: Any, where: str = "config.router.",
                    num_experts: int | None = None) -> RouterConfig:
        """The router of ``section`` (a mapping or any attribute object), checked
        (:meth:`check`); a field the section lacks takes its default (configs saved before it
        existed). ``num_experts`` (when given) bounds ``top_k``."""
        return cls(**read_fields(cls, section, where)).check(where, num_experts)

    def check(self, where: str = "router ", num_experts: int | None = None) -> RouterConfig:
        """``self`` if every field is usable, else a one-line ValueError naming the first one
        that is not with the prefix ``where`` (``"config.router."`` names config fields)."""
        if self.name not in ROUTERS:
            named = f"{where}name: " if where.endswith(".") else ""
            raise ValueError(f"{named}unknown router {self.name!r}; choose one of "
                             f"{sorted(ROUTERS)}")
        check_top_k(where, self.top_k, num_experts)
        check_jitter_eps(where, self.jitter_eps)
        for option in ("normalize_top_k", "successor_jitter", "default_at_eval"):
            value = getattr(self, option)
            if not isinstance(value, bool):
                raise ValueError(f"{where}{option} must be a bool, got {value!r}")
        decay = self.default_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"{where}default_decay must lie in (0, 1) (the EMA decay of Default "
                             f"MoE's default vectors), got {decay!r}")
        if self.default_mean not in DEFAULT_MEANS:
            raise ValueError(f"{where}default_mean={self.default_mean!r}; choose one of "
                             f"{DEFAULT_MEANS}")
        if self.default_update not in DEFAULT_UPDATES:
            raise ValueError(f"{where}default_update={self.default_update!r}; choose one of "
                             f"{DEFAULT_UPDATES}")
        for option in ROUTER_OPTIONS:
            value = getattr(self, option)
            takers = routers_taking(option)
            if value != getattr(_DEFAULTS, option) and self.name not in takers:
                raise ValueError(f"{where}{option}={value!r} has no effect on router "
                                 f"{self.name!r}; only {takers} take it")
        if self.balance_normalization not in BALANCE_NORMALIZATIONS:
            raise ValueError(f"{where}balance_normalization={self.balance_normalization!r}; "
                             f"choose one of {BALANCE_NORMALIZATIONS}")
        if not self.init_scale > 0:
            name = f"{where}init_scale" if where.endswith(".") else "router_init_scale"
            raise ValueError(f"{name} must be > 0, got {self.init_scale}")
        check_routing_options(self, where, num_experts)
        return self

    @property
    def renormalises(self) -> bool:
        """Whether the chosen experts' gates are renormalised over them (``normalize_top_k``,
        or sigmoid scores, which always are)."""
        return self.normalize_top_k or self.score == "sigmoid"

    @property
    def counts_load(self) -> bool:
        """Whether the layer keeps the per-expert load of the update in its state (bias
        balancing and the global-batch balance loss read it)."""
        return self.bias_update_rate > 0 or self.balance_scope == "global_batch"

    @property
    def unchosen(self) -> UnchosenExperts | None:
        """What the router computes for the experts a token did not choose, if anything
        (:data:`UNCHOSEN_EXPERT_RULES`)."""
        return UNCHOSEN_EXPERT_RULES.get(self.name)


_DEFAULTS = RouterConfig()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_routing_options(config: RouterConfig, where: str, num_experts: int | None) -> None:
    """The score, bias balancing, balance scope and group options of ``config``, and the
    estimators they do not compose with (docs/routing.md gives each reason): a one-line
    ValueError for the first that fails."""
    name, sampled = config.name, ROUTERS[config.name][0] is sparsemixer_route
    if config.score not in SCORES:
        raise ValueError(f"{where}score={config.score!r}; choose one of {SCORES}")
    scale = config.routed_scaling_factor
    if not _is_number(scale) or not scale > 0:
        raise ValueError(f"{where}routed_scaling_factor must be a finite number > 0, got "
                         f"{scale!r}")
    if config.score == "sigmoid":
        if name == "densemixer_blog":
            raise ValueError(f"{where}score='sigmoid' does not compose with router {name!r}: "
                             f"its formula is not defined for renormalised gates")
        # SparseMixer's router gradient at top-1 is its selection term (docs/routing.md).
        if config.top_k < 2 and not sampled:
            raise ValueError(f"{where}score='sigmoid' needs top_k >= 2 with router {name!r}: "
                             f"its gates are renormalised over the chosen experts, so one "
                             f"expert's gate is always 1 and the router gets no gradient "
                             f"(SparseMixer routers take top_k=1)")
        if config.normalize_top_k:
            raise ValueError(f"{where}normalize_top_k=True is implied by score='sigmoid' "
                             f"(its gates are always renormalised); leave it False")
    elif scale != 1.0:
        raise ValueError(f"{where}routed_scaling_factor={scale!r} has no effect with "
                         f"score={config.score!r}; only score='sigmoid' takes it")
    rate = config.bias_update_rate
    if not _is_number(rate) or rate < 0:
        raise ValueError(f"{where}bias_update_rate must be a finite number >= 0 (0 = off), got "
                         f"{rate!r}")
    if config.balance_scope not in BALANCE_SCOPES:
        raise ValueError(f"{where}balance_scope={config.balance_scope!r}; choose one of "
                         f"{BALANCE_SCOPES}")
    groups, top_groups = config.num_groups, config.top_groups
    if not _is_int(groups) or groups < 1:
        raise ValueError(f"{where}num_groups must be an int >= 1 (1 = no groups), got "
                         f"{groups!r}")
    if not _is_int(top_groups) or not 1 <= top_groups <= groups:
        raise ValueError(f"{where}top_groups must be an int in [1, num_groups={groups}], got "
                         f"{top_groups!r}")
    if config.group_score not in GROUP_SCORES:
        raise ValueError(f"{where}group_score={config.group_score!r}; choose one of "
                         f"{GROUP_SCORES}")
    if num_experts is not None and groups > 1:
        if config.group_score == "top2_sum" and num_experts // groups < 2:
            raise ValueError(f"{where}group_score='top2_sum' needs groups of at least 2 "
                             f"experts; num_groups={groups} of num_experts={num_experts} "
                             "gives 1")
        if num_experts % groups:
            raise ValueError(f"{where}num_groups={groups} does not divide num_experts="
                             f"{num_experts}")
        if top_groups * (num_experts // groups) < config.top_k:
            raise ValueError(f"{where}top_groups={top_groups} groups of "
                             f"{num_experts // groups} experts hold fewer than top_k="
                             f"{config.top_k} experts")


def routers_taking(option: str) -> list[str]:
    """The sorted names of the routers that take ``option`` (one of ``ROUTER_OPTIONS``); any
    other router refuses a non-default value of it."""
    if option == "normalize_top_k":
        return sorted(n for n, (route, _) in ROUTERS.items()
                      if route is switch_route and n != "densemixer_blog")
    if option == "successor_jitter":
        return sorted(UNCHOSEN_EXPERT_RULES)
    if option == "default_at_eval":
        return sorted(n for n, r in UNCHOSEN_EXPERT_RULES.items() if r.in_forward)
    return sorted(n for n, r in UNCHOSEN_EXPERT_RULES.items() if r.values == "defaults")


def check_router(
    name: str,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    num_experts: int | None = None,
    where: str = "router ",
    **options: Any,
) -> RouterConfig:
    """The router's :class:`RouterConfig` from loose arguments, checked: a ValueError naming the
    argument for anything it cannot use.

    Args:
      name: a key of :data:`ROUTERS`.
      top_k, jitter_eps: as in the routing functions (``num_experts`` bounds ``top_k`` when
        given).
      where: prefixes argument names in messages.
      **options: further fields of :class:`RouterConfig` (:data:`ROUTER_OPTIONS` and the loss
        weights). An option set away from its default for a router that ignores it is an
        error, as is an unknown option.
    """
    known = {f.name for f in dataclasses.fields(RouterConfig)} - {"name", "top_k", "jitter_eps"}
    unknown = sorted(set(options) - known)
    if unknown:
        if name not in ROUTERS:  # the name is the first thing wrong
            RouterConfig(name).check(where)
        raise ValueError(f"unknown router option(s) {unknown} ({where.strip()}); known: "
                         f"{sorted(known)}")
    return RouterConfig(name=name, top_k=top_k, jitter_eps=jitter_eps, **options).check(
        where, num_experts)


def get_router(
    name: str, jitter_eps: float = 0.1, top_k: int = 1, **options: Any
) -> RouterFn:
    """The router called ``name`` (a key of :data:`ROUTERS`) as ``fn(logits, key, training)``.

    ``options`` are further fields of :class:`RouterConfig`, checked by :func:`check_router`.
    """
    return router_fn(check_router(name, top_k=top_k, jitter_eps=jitter_eps, **options))


def router_fn(config: RouterConfig) -> RouterFn:
    """The routing function of a checked :class:`RouterConfig` as ``fn(logits, key, training,
    selection_bias=None)``; ``selection_bias [N]`` is bias balancing's (routers with Switch's
    forward, and SparseMixer with its two-path estimator)."""
    top_k, jitter_eps = config.top_k, config.jitter_eps
    route, fixed = ROUTERS[config.name]
    kwargs = dict(fixed)
    groups = {"num_groups": config.num_groups, "top_groups": config.top_groups,
              "group_score": config.group_score}
    kwargs.update(groups, score=config.score,
                  routed_scaling_factor=config.routed_scaling_factor)
    if route is switch_route:
        kwargs["normalize_top_k"] = config.normalize_top_k
        if config.successor_jitter:
            kwargs["jitter"] = True

    def router(logits: jax.Array, key: jax.Array | None, training: bool,
               selection_bias: jax.Array | None = None) -> RouterOutput:
        return route(logits, key, training=training, top_k=top_k, jitter_eps=jitter_eps,
                     selection_bias=selection_bias, **kwargs)

    return router


def uses_omega(name: str) -> bool:
    """SparseMixer scales the MoE output by a trainable ``omega``; Switch does not."""
    return name.startswith("sparsemixer")
