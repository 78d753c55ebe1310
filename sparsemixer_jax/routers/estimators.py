"""SparseMixer's gradient estimators as data: what each does to a chosen expert's forward weight
and backward (:class:`EstimatorRule`), how each splits its backward into a gate path and a
selection path under a selection bias or sigmoid scores (:class:`TwoPathRule`), and the checks
of the options that tune them.

:func:`sparsemixer_jax.routers.sparsemixer_route` documents each estimator and the expected
router gradient it gives; docs/routing.md derives the two-path split.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Estimator = Literal["mix", "euler", "midpoint", "v2", "v2star"]


class EstimatorRule(NamedTuple):
    """How an estimator of :data:`ESTIMATORS` treats a chosen expert ``D``
    (see :func:`~sparsemixer_jax.routers.sparsemixer_route`).

    With probability ``reduced_prob`` (never on the argmax unless ``on_argmax``) the forward
    weight is ``reduced_weight * pi_D`` instead of ``pi_D``; the backward pass always sends
    ``backward_scale * dL/dgate`` to ``pi_D``. ``takes_coin``: whether ``midpoint_prob`` sets
    ``reduced_prob`` (``"euler"`` never reduces, ``"midpoint"`` always does).

    ``argmax_of`` says which argmax the coin's "is ``D`` the argmax" compares with in training,
    as each estimator's released reference does; the two differ only where float32
    probabilities tie (logits a few ulps apart):

    * ``"logits"``: the argmax of the logits (microsoft/SparseMixer, top-1), so a tie of
      probabilities goes to the larger logit;
    * ``"probs"``: the first index of the largest float32 masked probability (Hugging Face's
      ``phimoe``, GRIN's top-2, which takes ``torch.max`` of the softmax).

    Evaluation routes by the argmax of the logits for every estimator, as both references do.
    """

    reduced_weight: float
    reduced_prob: float
    backward_scale: float
    on_argmax: bool = False
    takes_coin: bool = True
    argmax_of: Literal["logits", "probs"] = "logits"


ESTIMATORS: dict[str, EstimatorRule] = {
    "mix": EstimatorRule(0.5, 0.5, 2.0),
    "euler": EstimatorRule(0.5, 0.0, 2.0, takes_coin=False),
    "midpoint": EstimatorRule(0.5, 1.0, 2.0, on_argmax=True, takes_coin=False),
    "v2": EstimatorRule(1.0 / 3.0, 0.75, 1.0, argmax_of="probs"),
    # No released reference: it follows v2's.
    "v2star": EstimatorRule(1.0 / 3.0, 0.375, 2.0, argmax_of="probs"),
}


def check_estimator_args(
    fn: str, estimator: str, midpoint_prob: float | None, backward_scale: float | None
) -> None:
    """ValueError naming the argument for an estimator option SparseMixer cannot use."""
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"{fn}: unknown estimator {estimator!r}; expected one of {list(ESTIMATORS)}"
        )
    if midpoint_prob is not None:
        if not ESTIMATORS[estimator].takes_coin:
            users = [name for name, rule in ESTIMATORS.items() if rule.takes_coin]
            raise ValueError(
                f"{fn}: midpoint_prob={midpoint_prob!r} has no effect with "
                f"estimator={estimator!r} (it never flips a coin); only {users} take it"
            )
        if isinstance(midpoint_prob, bool) or not 0.0 <= midpoint_prob <= 1.0:
            raise ValueError(f"{fn}: midpoint_prob must lie in [0, 1], got {midpoint_prob}")
    if backward_scale is not None and not math.isfinite(backward_scale):
        raise ValueError(f"{fn}: backward_scale must be a finite number, got {backward_scale}")


class TwoPathRule(NamedTuple):
    """How an estimator splits its backward under a selection bias (docs/routing.md).

    Per sample the logits receive ``a c grad pi_D + b c pi_D grad log q_D``, ``c`` the gate's
    cotangent. ``sure``: ``(a, b)`` where no coin is flipped (the argmax, and every token when
    the coin's probability ``r`` is 0 or 1). Elsewhere, with ``r`` in ``(0, 1)``: the
    full-weight branch sends ``(gate / (1 - r), quadrature[0] / (1 - r))``, the reduced branch
    ``(0, quadrature[1] / r)``, so that the expectation is ``gate`` times the exact ``nabla_1``
    plus the quadrature ``quadrature[0] u(1) + quadrature[1] u(w)`` of ``nabla_0``.
    """

    sure: tuple[float, float]
    gate: float
    quadrature: tuple[float, float]


#: The estimators that take a selection bias, and their two-path split (``"euler"`` and
#: ``"midpoint"`` flip no coin). With ``b = 0`` each is the released backward sample by sample
#: at the estimator's default coin: mix (2, 0) / (0, 2); v2 (0, 1) / (0, 1); v2star
#: (8/5, 2/5) / (0, 2).
TWO_PATH_RULES: dict[str, TwoPathRule] = {
    "mix": TwoPathRule((1.0, 1.0), 1.0, (0.0, 1.0)),  # nabla_1 + mid-point
    "euler": TwoPathRule((1.0, 1.0), 1.0, (1.0, 0.0)),
    "midpoint": TwoPathRule((1.0, 1.0), 1.0, (0.0, 1.0)),
    "v2": TwoPathRule((0.0, 1.0), 0.0, (0.25, 0.75)),  # Heun's rule alone, as published
    "v2star": TwoPathRule((1.0, 1.0), 1.0, (0.25, 0.75)),  # nabla_1 + Heun's rule
}


def two_path_scales(rule: TwoPathRule, reduced: jax.Array, coin_flipped: jax.Array,
                    reduced_prob: float) -> tuple[jax.Array, jax.Array]:
    """``(gate_scale, selection_scale)`` per token for :func:`two_path_gate`: ``reduced`` (bool)
    the reduced-weight branch was taken, ``coin_flipped`` (bool) a coin of probability
    ``reduced_prob`` was flipped for this token (off the argmax)."""
    sure_gate, sure_selection = rule.sure
    if not 0.0 < reduced_prob < 1.0:
        return (jnp.full(reduced.shape, sure_gate, jnp.float32),
                jnp.full(reduced.shape, sure_selection, jnp.float32))
    full, part = 1.0 - reduced_prob, reduced_prob
    gate = jnp.where(reduced, 0.0, rule.gate / full)
    selection = jnp.where(reduced, rule.quadrature[1] / part, rule.quadrature[0] / full)
    return (jnp.where(coin_flipped, gate, sure_gate).astype(jnp.float32),
            jnp.where(coin_flipped, selection, sure_selection).astype(jnp.float32))
