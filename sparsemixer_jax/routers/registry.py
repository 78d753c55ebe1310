"""Routers by name, their options, and the one check of a router's arguments.

:func:`check_router` owns the rules for what a router accepts; :func:`get_router`, the MoE
layer and the config validator (``sparsemixer_jax.config``) all call it.
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


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    """Options of the routers with Switch's forward (config fields ``router.<name>``).

    Attributes:
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

    normalize_top_k: bool = False
    successor_jitter: bool = False
    default_decay: float = 0.9
    default_at_eval: bool = True
    default_mean: Literal["ungated", "gated"] = "ungated"
    default_update: Literal["after", "before"] = "after"


OPTION_DEFAULTS = RouterOptions()


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
) -> RouterOptions:
    """The router's options, checked: a ValueError naming the argument for anything it cannot use.

    Args:
      name: a key of :data:`ROUTERS`.
      top_k, jitter_eps: as in the routing functions (``num_experts`` bounds ``top_k`` when
        given).
      where: prefixes argument names in messages (``"config.router."`` names config fields).
      **options: fields of :class:`RouterOptions`. An option set away from its default for a
        router that ignores it is an error, as is an unknown option.
    """
    if name not in ROUTERS:
        named = f"{where}name: " if where.endswith(".") else ""
        raise ValueError(f"{named}unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    check_top_k(where, top_k, num_experts)
    check_jitter_eps(where, jitter_eps)
    known = {f.name for f in dataclasses.fields(RouterOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown router option(s) {unknown} ({where.strip()}); known: "
                         f"{sorted(known)}")
    result = dataclasses.replace(OPTION_DEFAULTS, **options)
    for option in ("normalize_top_k", "successor_jitter", "default_at_eval"):
        value = getattr(result, option)
        if not isinstance(value, bool):
            raise ValueError(f"{where}{option} must be a bool, got {value!r}")
    decay = result.default_decay
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
        raise ValueError(f"{where}default_decay must lie in (0, 1) (the EMA decay of Default "
                         f"MoE's default vectors), got {decay!r}")
    if result.default_mean not in DEFAULT_MEANS:
        raise ValueError(f"{where}default_mean={result.default_mean!r}; choose one of "
                         f"{DEFAULT_MEANS}")
    if result.default_update not in DEFAULT_UPDATES:
        raise ValueError(f"{where}default_update={result.default_update!r}; choose one of "
                         f"{DEFAULT_UPDATES}")
    for option in sorted(known):
        value = getattr(result, option)
        takers = _routers_taking(option)
        if value != getattr(OPTION_DEFAULTS, option) and name not in takers:
            raise ValueError(f"{where}{option}={value!r} has no effect on router {name!r}; "
                             f"only {takers} take it")
    return result


def options_from_config(router_cfg: Any) -> dict[str, Any]:
    """The :class:`RouterOptions` fields of a ``config.router`` section (defaults where a
    config saved before an option existed lacks it)."""
    return {f.name: router_cfg.get(f.name, f.default) for f in dataclasses.fields(RouterOptions)}


def get_router(
    name: str, jitter_eps: float = 0.1, top_k: int = 1, **options: Any
) -> RouterFn:
    """The router called ``name`` (a key of :data:`ROUTERS`) as ``fn(logits, key, training)``.

    ``options`` are fields of :class:`RouterOptions`, checked by :func:`check_router`.
    """
    checked = check_router(name, top_k=top_k, jitter_eps=jitter_eps, **options)
    route, fixed = ROUTERS[name]
    kwargs = dict(fixed)
    if route is switch_route:
        kwargs["normalize_top_k"] = checked.normalize_top_k
        if checked.successor_jitter:
            kwargs["jitter"] = True

    def router(logits: jax.Array, key: jax.Array | None, training: bool) -> RouterOutput:
        return route(logits, key, training=training, top_k=top_k, jitter_eps=jitter_eps,
                     **kwargs)

    return router


def uses_omega(name: str) -> bool:
    """SparseMixer scales the MoE output by a trainable ``omega``; Switch does not."""
    return name.startswith("sparsemixer")
