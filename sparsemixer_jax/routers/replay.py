"""Routing replay: route tokens through given experts, with the gates of the live router.

Reinforcement learning of an MoE model scores its rollouts in the update through the experts
that were chosen when they were sampled (the inference engine returns them). The selection is
replayed; the gates are computed by the router being trained, as the router's type computes
them over the chosen set, so the router still receives its gradient:

* softmax scores: the chosen experts' probabilities (softmax over all ``N`` experts, after
  the router's jitter in training), renormalised over the chosen set where the router
  renormalises (``normalize_top_k``);
* sigmoid scores: the chosen experts' sigmoid scores renormalised over the chosen set, times
  ``routed_scaling_factor``.

Groups and the selection bias only select, so under replay they change nothing. The term
DenseMixer and Default MoE add for the experts a token did not choose reads the replayed set,
so their gradients are their usual ones on it. SparseMixer's estimator is built on the
distribution it samples its experts from, so a selection it did not draw needs an estimator
of its own, not written yet: its routers refuse replay.

A token's given experts are a row of ``top_k`` distinct ids in ``[0, N)``, or a row of ``-1``:
no given experts, the router's own choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.routers.common import RouterOutput
from sparsemixer_jax.routers.registry import ROUTERS, RouterConfig
from sparsemixer_jax.routers.switch import switch_route


def replays(name: str) -> bool:
    """Whether router ``name`` (a key of :data:`~sparsemixer_jax.routers.ROUTERS`) takes
    given experts: those with Switch's forward (``switch``, DenseMixer, Default MoE)."""
    return ROUTERS[name][0] is switch_route


def check_replay_router(config: RouterConfig) -> None:
    """A one-line ValueError unless ``config``'s router takes given experts."""
    if not replays(config.name):
        raise ValueError(
            f"routing replay with router {config.name!r} is not available: SparseMixer's "
            f"gradient estimator for a given selection is derived later; replay with one of "
            f"{sorted(n for n in ROUTERS if replays(n))}")


def check_given_experts(routes, num_experts: int, where: str = "routes") -> None:
    """A one-line ValueError naming what is wrong with the given experts ``routes`` int
    ``[..., k]`` (``k`` checked by the caller): a dtype that is not an integer, and, where the
    values are concrete (not traced), an id outside ``[-1, num_experts)``, a token whose row
    mixes ``-1`` with ids, or an expert given twice to one token (first offender's index)."""
    dtype = jnp.asarray(routes).dtype if not hasattr(routes, "dtype") else routes.dtype
    if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{where} must hold integer expert ids, got dtype {dtype}")
    if isinstance(routes, jax.core.Tracer) or (
            isinstance(routes, jax.Array) and not routes.is_fully_addressable):
        # Values are not known while tracing: an id >= num_experts gives NaN gates, a row
        # with an id below -1 the router's own choice.
        return
    ids = np.asarray(routes)
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{where}{list(at)} = {int(ids[at])} is not an expert id: ids lie in "
                         f"[0, {num_experts}), -1 for the router's own choice")
    unset = ids == -1
    partial = unset.any(axis=-1) & ~unset.all(axis=-1)
    if partial.any():
        at = tuple(int(i) for i in np.argwhere(partial)[0])
        raise ValueError(f"{where}{list(at)} = {ids[at].tolist()} mixes -1 with expert ids; "
                         f"-1 fills a token's whole row (the router's own choice)")
    ordered = np.sort(ids, axis=-1)
    repeated = np.any((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0), axis=-1)
    if repeated.any():
        at = tuple(int(i) for i in np.argwhere(repeated)[0])
        raise ValueError(f"{where}{list(at)} = {ids[at].tolist()} gives an expert twice; a "
                         f"token's experts are distinct")


def replayed_route(config: RouterConfig, routed: RouterOutput, routes: jax.Array
                   ) -> RouterOutput:
    """``routed`` (the router's output for the same tokens) routed through the given experts.

    Args:
      config: the router's section; its router must replay (:func:`check_replay_router`).
      routed: the router's own :class:`RouterOutput` (``expert [...]`` or ``[..., k]``).
      routes: int ``[..., k]``: per token ``k`` distinct expert ids, or ``-1`` in every slot
        for the router's own choice (a row with any ``-1`` takes it).

    Returns:
      ``routed`` with ``expert`` the selection made (int32, the given ids where given) and
      ``gate`` the live router's gates over it (module docstring), in ``routed``'s shapes;
      ``probs`` and ``scores`` unchanged. For a token given its own choice the gates are the
      router's own: the same values from the same scores.
    """
    check_replay_router(config)
    k = config.top_k
    own = routed.expert if k > 1 else routed.expert[..., None]
    given = jnp.all(routes >= 0, axis=-1, keepdims=True)
    expert = jnp.where(given, routes.astype(jnp.int32), own)
    weights = routed.scores if config.score == "sigmoid" else routed.probs
    gate = jnp.take_along_axis(weights, expert, axis=-1)
    if config.renormalises:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    if config.score == "sigmoid":
        gate = gate * config.routed_scaling_factor
    if k == 1:
        expert, gate = expert[..., 0], gate[..., 0]
    return routed._replace(expert=expert, gate=gate)
