"""Routers by name and their config section :class:`RouterConfig`, which checks itself.

:meth:`RouterConfig.check` owns the rules for what a router accepts: ``config.router`` is read
and checked once by :meth:`RouterConfig.from_config`; :func:`get_router` and the MoE layer's
keyword arguments build a :class:`RouterConfig` through :func:`check_router`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax

from sparsemixer_jax.routers.common import RouterOutput, check_jitter_eps, check_top_k
from sparsemixer_jax.routers.sparsemixer import sparsemixer_route
from sparsemixer_jax.routers.switch import switch_route
from sparsemixer_jax.routers.unchosen import UnchosenExperts
from sparsemixer_jax.section import read_fields

RouterFn = Callable[[jax.Array, "jax.Array | None", bool], RouterOutput]

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

    @classmethod
    def from_config(cls, section: Any, where: str = "config.router.",
                    num_experts: int | None = None) -> RouterConfig:
        """The router of ``section`` (a ConfigDict, dict or any attribute object), checked
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
            takers = _routers_taking(option)
            if value != getattr(_DEFAULTS, option) and self.name not in takers:
                raise ValueError(f"{where}{option}={value!r} has no effect on router "
                                 f"{self.name!r}; only {takers} take it")
        if self.balance_normalization not in BALANCE_NORMALIZATIONS:
            raise ValueError(f"{where}balance_normalization={self.balance_normalization!r}; "
                             f"choose one of {BALANCE_NORMALIZATIONS}")
        if not self.init_scale > 0:
            name = f"{where}init_scale" if where.endswith(".") else "router_init_scale"
            raise ValueError(f"{name} must be > 0, got {self.init_scale}")
        return self

    @property
    def unchosen(self) -> UnchosenExperts | None:
        """What the router computes for the experts a token did not choose, if anything
        (:data:`UNCHOSEN_EXPERT_RULES`)."""
        return UNCHOSEN_EXPERT_RULES.get(self.name)


_DEFAULTS = RouterConfig()


def _routers_taking(option: str) -> list[str]:
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
                         f"{sorted(ROUTER_OPTIONS)}")
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
    """The routing function of a checked :class:`RouterConfig` as ``fn(logits, key,
    training)``."""
    top_k, jitter_eps = config.top_k, config.jitter_eps
    route, fixed = ROUTERS[config.name]
    kwargs = dict(fixed)
    if route is switch_route:
        kwargs["normalize_top_k"] = config.normalize_top_k
        if config.successor_jitter:
            kwargs["jitter"] = True

    def router(logits: jax.Array, key: jax.Array | None, training: bool) -> RouterOutput:
        return route(logits, key, training=training, top_k=top_k, jitter_eps=jitter_eps,
                     **kwargs)

    return router


def uses_omega(name: str) -> bool:
    """SparseMixer scales the MoE output by a trainable ``omega``; Switch does not."""
    return name.startswith("sparsemixer")
