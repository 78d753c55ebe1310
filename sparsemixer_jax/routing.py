"""Expert routing (top-1 and top-k): SparseMixer, GRIN's SparseMixer-v2, the Switch baseline, and
the dense-backward routers DenseMixer and Default MoE.

Every router here is a pure function of the router logits ``[..., N]`` (any number of leading
token axes) and a PRNG key, and returns a :class:`RouterOutput`. The caller computes the layer
output as ``gate * f_expert(x)``, summed over the ``k`` experts of a token for top-k (times
``omega`` for SparseMixer, see the paper's Section 3.5).
Routing math runs in float32 whatever the dtype of the logits.

Notation follows Liu, Gao & Chen, "Sparse Backpropagation for MoE Training" (ICLR 2024):
``pi`` are the (masked) router probabilities, ``D`` the chosen expert, ``g`` the rest of the
network. The exact router gradient is ``nabla_0 + nabla_1``: ``nabla_1`` flows through the gate
``pi_D`` by ordinary backpropagation, ``nabla_0`` comes from the sampling of ``D`` and is what
ordinary MoE training drops. SparseMixer estimates it with a forward-Euler or mid-point rule
applied along the path from ``0`` to ``pi_D f_D`` (see ``sparsemixer_jax.exact_gradient`` for
an exact oracle and the measured orders of accuracy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MaskRule = Literal["reference", "paper", "none"]
Estimator = Literal["mix", "euler", "midpoint", "v2", "v2star"]


class RouterOutput(NamedTuple):
    """What a router returns for each token.

    Attributes:
      expert: int32 ``[...]`` (top-1) or ``[..., k]`` (top-k, distinct experts), the chosen ``D``.
      gate: float32, same shape as ``expert``: the multiplier the caller applies to ``f_D(x)``
        (before ``omega``). Its backward pass carries the router gradient estimator.
      probs: float32 ``[..., N]``, the router probabilities the (first) expert was drawn from
        (masked softmax for SparseMixer, softmax of the jittered logits for Switch); zero where
        masked.
    """

    expert: jax.Array
    gate: jax.Array
    probs: jax.Array


def _routing_dtype(logits: jax.Array) -> jnp.dtype:
    """float32 for bfloat16/float16/float32 logits; float64 only when the caller asks for it."""
    return jnp.promote_types(logits.dtype, jnp.float32)


def routing_mask(logits: jax.Array, jitter_eps: float, rule: MaskRule = "reference") -> jax.Array:
    """Which experts stay eligible: bool ``[..., N]``, True where expert i may be sampled.

    ``rule="reference"`` (default) is the test of microsoft/SparseMixer:
    ``(max(z) - z_i) / max(|z_i|, max(z)) > 2 * jitter_eps`` masks expert i. It is written here as
    ``max(z) - z_i > 2 * jitter_eps * max(|z_i|, max(z))``, which is the same test (the scale is
    never negative) and also defined when the scale is zero, where the reference divides 0/0 and
    keeps the expert because NaN compares false.

    ``rule="paper"`` is the paper's Section 3.5 statement of the Switch support:
    expert i is masked when ``max(z) - z_i > jitter_eps * (|max(z)| + |z_i|)``. The two differ:
    the reference uses a factor 2 on the larger magnitude instead of the sum of both.

    ``rule="none"`` keeps every expert (plain softmax sampling, the paper's ablation).

    The argmax is never masked, so at least one expert stays eligible. No gradient flows through
    the mask. Both tests are relative to the logits' magnitude, so near-zero logits (a freshly
    initialised router) often leave only the argmax eligible; such a token has ``pi_D = 1`` and
    gives the router no gradient, as in the reference.
    """
    logits = logits.astype(_routing_dtype(logits))
    if rule == "none":
        return jnp.ones(logits.shape, dtype=bool)
    top = jnp.max(logits, axis=-1, keepdims=True)
    gap = top - logits
    if rule == "reference":
        masked = gap > 2.0 * jitter_eps * jnp.maximum(jnp.abs(logits), top)
    elif rule == "paper":
        masked = gap > jitter_eps * (jnp.abs(top) + jnp.abs(logits))
    else:
        raise ValueError(f"unknown mask rule {rule!r}; expected 'reference', 'paper' or 'none'")
    return ~masked


def router_probs(
    logits: jax.Array, jitter_eps: float = 0.1, mask: MaskRule = "reference"
) -> jax.Array:
    """Masked softmax ``pi``: float32 ``[..., N]``, zero on masked experts.

    Differentiable in ``logits`` (the mask is held fixed), which the exact-gradient oracle uses.
    """
    logits = logits.astype(_routing_dtype(logits))
    keep = jax.lax.stop_gradient(routing_mask(logits, jitter_eps, mask))
    return jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scaled_gate(prob: jax.Array, forward_scale: jax.Array, backward_scale: float) -> jax.Array:
    """``prob * forward_scale`` whose cotangent to ``prob`` is ``backward_scale * cotangent``.

    The backward ignores ``forward_scale`` on purpose: this is the reference's balancing core.
    """
    return prob * forward_scale


def _scaled_gate_fwd(prob, forward_scale, backward_scale):
    return prob * forward_scale, forward_scale


def _scaled_gate_bwd(backward_scale, forward_scale, cotangent):
    return cotangent * backward_scale, jnp.zeros_like(forward_scale)


_scaled_gate.defvjp(_scaled_gate_fwd, _scaled_gate_bwd)


def _take(values: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0]


class EstimatorRule(NamedTuple):
    """How an estimator of :data:`ESTIMATORS` treats a chosen expert ``D``
    (see :func:`sparsemixer_route`).

    With probability ``reduced_prob`` (never on the argmax unless ``on_argmax``) the forward
    weight is ``reduced_weight * pi_D`` instead of ``pi_D``; the backward pass always sends
    ``backward_scale * dL/dgate`` to ``pi_D``.
    """

    reduced_weight: float
    reduced_prob: float
    backward_scale: float
    on_argmax: bool = False


ESTIMATORS: dict[str, EstimatorRule] = {
    "mix": EstimatorRule(0.5, 0.5, 2.0),
    "euler": EstimatorRule(0.5, 0.0, 2.0),
    "midpoint": EstimatorRule(0.5, 1.0, 2.0, on_argmax=True),
    "v2": EstimatorRule(1.0 / 3.0, 0.75, 1.0),
    "v2star": EstimatorRule(1.0 / 3.0, 0.375, 2.0),
}


def _check_route_args(fn: str, logits, top_k, jitter_eps, training) -> None:
    """ValueError naming the argument and its value for anything a router cannot use.

    These are static (Python) arguments: they pick code paths and shapes at trace time, so a
    traced value is refused too.
    """
    if jnp.ndim(logits) < 1:
        raise ValueError(
            f"{fn}: logits must have at least one axis (experts last, shape [..., N]), "
            f"got shape {jnp.shape(logits)}"
        )
    num_experts = jnp.shape(logits)[-1]
    if num_experts < 1:
        raise ValueError(f"{fn}: logits need at least one expert, got shape {jnp.shape(logits)}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise ValueError(f"{fn}: top_k must be a Python int, got {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{fn}: top_k must lie in [1, N] with N = logits.shape[-1] = {num_experts}, "
            f"got top_k={top_k}"
        )
    if (
        isinstance(jitter_eps, bool)
        or not isinstance(jitter_eps, (int, float, np.floating, np.integer))
        or not math.isfinite(jitter_eps)
        or jitter_eps < 0
    ):
        raise ValueError(
            f"{fn}: jitter_eps must be a finite Python number >= 0, got {jitter_eps!r}"
        )
    if not isinstance(training, (bool, np.bool_)):
        raise ValueError(
            f"{fn}: training must be a Python bool (it selects sampling or argmax when the "
            f"function is traced), got {training!r}"
        )


def _check_finite_logits(fn: str, logits: jax.Array, top_k: int) -> jax.Array:
    """bool ``[...]``: True for tokens whose logits hold NaN or +inf (they route to NaN gates).

    ``-inf`` is allowed: it removes that expert for that token. Outside ``jit`` (concrete
    logits) a token with NaN, +inf or fewer than ``top_k`` experts above ``-inf`` raises a
    ValueError; under ``jit`` values cannot raise, and such tokens get NaN ``probs`` and ``gate``
    so that the loss turns NaN (the training loop then skips the update and reports it).
    """
    invalid = jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1)
    if not isinstance(logits, jax.core.Tracer):
        bad = np.asarray(invalid)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{fn}: logits hold NaN or +inf for {int(bad.sum())} token(s), first at index "
                f"{where} of the token axes; -inf (an excluded expert) is the only non-finite "
                f"value allowed"
            )
        live = np.asarray(jnp.sum(logits > -jnp.inf, axis=-1))
        if (live < top_k).any():
            where = tuple(int(i) for i in np.argwhere(live < top_k)[0])
            raise ValueError(
                f"{fn}: top_k={top_k} but token {where} has only {int(live[where])} expert(s) "
                f"with logit > -inf"
            )
    return invalid


def sparsemixer_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
    mask: MaskRule = "reference",
    estimator: Estimator = "mix",
    midpoint_prob: float | None = None,
    backward_scale: float | None = None,
) -> RouterOutput:
    """SparseMixer routing (top-1, or top-k by sequential sampling) with its sparse gradient.

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32).
        ``-inf`` excludes an expert for that token; NaN or +inf is an error (see below).
      key: PRNG key for sampling; required when ``training``.
      top_k: experts per token, ``1 <= top_k <= N``. Expert ``t`` is drawn like the first from
        the tokens' logits with the experts already chosen removed (mask and softmax recomputed
        from the best remaining logit), so the ``k`` experts of a token are distinct.
        ``top_k = N`` is allowed: every expert, in sampled order; the last has gate 1 and gives
        no router gradient.
      jitter_eps: the Switch jitter ``r``; sets the mask threshold. Python float ``>= 0``.
      training: Python bool. Sample and apply the estimator; otherwise ``D`` = argmax (top-k in
        order of the logits) with ``gate = pi_D`` and no randomness.
      mask: which experts are eligible, see :func:`routing_mask`.
      estimator: how the gradient of the sampling is estimated (defaults below:
        reduced-branch weight / its probability off the argmax / backward scale):

        * ``"mix"`` (SparseMixer, 1/2 / 0.5 / 2): Euler on the argmax, a coin between Euler and
          mid-point elsewhere.
        * ``"euler"`` (SparseMixer-1st, - / 0 / 2): Euler everywhere.
        * ``"midpoint"`` (SparseMixer-2nd, 1/2 / 1 / 2): mid-point everywhere, the argmax
          included, so training and inference outputs differ by a factor 2.
        * ``"v2"`` (GRIN's SparseMixer-v2 as released, 1/3 / 0.75 / 1): Heun's third-order rule
          for ``nabla_0`` and nothing for ``nabla_1``.
        * ``"v2star"`` (1/3 / 0.375 / 2): the correction of v2 derived in this project (below).
      midpoint_prob: the probability that a non-argmax choice takes the reduced-weight branch;
        None takes the estimator's default. Only for ``"mix"``, ``"v2"``, ``"v2star"``.
      backward_scale: factor on the gate's cotangent; None takes the estimator's default.

    Returns:
      :class:`RouterOutput`: ``expert`` int32 and ``gate`` float32 of shape ``[...]`` when
      ``top_k == 1`` and ``[..., top_k]`` otherwise (``gate[..., t]`` is the probability of
      expert ``t`` among those left after the first ``t``, not renormalised, as in GRIN);
      ``probs`` float32 ``[..., N]``, the distribution of the first expert.

    The forward-Euler branch outputs ``pi_D f_D``; the reduced branch outputs ``w pi_D f_D``
    (``w = 1/2`` mid-point, ``1/3`` Heun). Both send ``backward_scale * dL/dgate`` to ``pi_D``,
    whatever ``w``. With the defaults the expected router gradient is, per token and in the
    paper's notation (``u(w) = g'(w pi f) . pi f``, so ``nabla_1 = u(1)`` and
    ``nabla_0 = integral of u over [0, 1]``, both times ``dpi / pi``):

    * ``"mix"``, on the argmax: ``2 u(1)``; elsewhere ``u(1) + u(1/2)``: ``nabla_1`` plus the
      mid-point estimate of ``nabla_0``.
    * ``"v2"``: ``u(1)`` on the argmax, ``u(1)/4 + 3 u(1/3)/4`` elsewhere: Heun's third-order
      estimate of ``nabla_0`` alone, with ``nabla_1`` missing. As outputs shrink
      ``nabla_0 -> nabla_1``, so v2 gives about half the exact gradient (GRIN, Appendix A).
    * ``"v2star"``: ``2 u(1)`` on the argmax, ``2 (5 u(1)/8 + 3 u(1/3)/8)`` elsewhere, i.e.
      ``u(1) + (u(1)/4 + 3 u(1/3)/4)``: exact ``nabla_1`` plus Heun's estimate of ``nabla_0``.
      GRIN's Appendix A.2 describes its corrected v2 as a factor 2, a different coin and a
      softmax temperature of 2; the factor and the coin here are derived from the quadrature
      above. The temperature is not applied: its text was not available to check against.

    For ``top_k > 1`` each step's estimator acts on that step's conditional probabilities; the
    term from "the first choice changes the distribution of the second" has no sparse estimate
    here or in GRIN (``sparsemixer_jax.exact_gradient.exact_topk_gradient`` measures what it
    costs).

    Where the reference codes depart from their papers, this function follows the code:

    1. Mask threshold: ``(max z - z_i) / max(|z_i|, max z) > 2 r`` instead of the paper's
       ``max z - z_i > r (|max z| + |z_i|)`` (``mask="paper"`` gives the paper's rule).
    2. The paper's SparseMixer uses the mid-point rule on every non-argmax token; the reference
       flips a fair coin between mid-point and Euler there (``midpoint_prob=1.0`` gives the paper).
    3. The paper's estimators approximate ``nabla_0`` alone; the reference doubles the gate's
       gradient so that one backward pass also carries ``nabla_1`` (``backward_scale=1.0``
       drops the doubling). GRIN's released v2 does not double it (scale 1).
    4. ``D`` is drawn with the Gumbel-max trick, as in both reference codes; the papers write
       ``D ~ pi`` without saying how. The two are the same distribution.
    5. GRIN's code writes the Heun weight as ``0.3333`` (and 1 as ``0.3333 + 0.6667``); here it
       is ``1/3`` in float32. Its second expert's coin is compared with the argmax of the
       second step's distribution, as here.

    Non-finite logits: ``-inf`` removes an expert (never sampled, probability 0). A token with
    NaN or +inf logits, or fewer than ``top_k`` experts above ``-inf``, gets NaN ``probs`` and
    ``gate`` (a valid ``expert`` index); called outside ``jit`` it raises ValueError instead.
    """
    fn = "sparsemixer_route"
    _check_route_args(fn, logits, top_k, jitter_eps, training)
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"{fn}: unknown estimator {estimator!r}; expected one of {list(ESTIMATORS)}"
        )
    if midpoint_prob is not None and not 0.0 <= midpoint_prob <= 1.0:
        raise ValueError(f"{fn}: midpoint_prob must lie in [0, 1], got {midpoint_prob}")
    if backward_scale is not None and not math.isfinite(backward_scale):
        raise ValueError(f"{fn}: backward_scale must be a finite number, got {backward_scale}")
    if training and key is None:
        raise ValueError(f"{fn} needs a PRNG key when training=True")
    rule = ESTIMATORS[estimator]
    reduced_prob = rule.reduced_prob if midpoint_prob is None else float(midpoint_prob)
    scale = rule.backward_scale if backward_scale is None else float(backward_scale)
    invalid = _check_finite_logits(fn, logits, top_k)

    remaining = logits.astype(_routing_dtype(logits))
    experts, gates, first_probs = [], [], None
    for step in range(top_k):
        probs = router_probs(remaining, jitter_eps, mask)
        probs = jnp.where(invalid[..., None], jnp.nan, probs)
        first_probs = probs if first_probs is None else first_probs
        top = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        if training:
            step_key = key if step == 0 else jax.random.fold_in(key, step)
            expert, gate = _sample_step(probs, top, step_key, estimator, rule, reduced_prob, scale)
        else:
            expert, gate = top, _take(probs, top)
        experts.append(expert)
        gates.append(gate)
        if step + 1 < top_k:  # later steps choose among the experts not yet chosen
            chosen = jax.nn.one_hot(expert, remaining.shape[-1], dtype=bool)
            remaining = jnp.where(chosen, -jnp.inf, remaining)
    if top_k == 1:
        return RouterOutput(expert=experts[0], gate=gates[0], probs=first_probs)
    return RouterOutput(
        expert=jnp.stack(experts, axis=-1), gate=jnp.stack(gates, axis=-1), probs=first_probs
    )


def _sample_step(probs, top, key, estimator, rule: EstimatorRule, reduced_prob, scale):
    """One draw ``D ~ probs`` and its gate ``w pi_D`` with the estimator's backward."""
    sample_key, coin_key = jax.random.split(key)
    # Gumbel-max over the masked logits; log(probs) differs from them by a constant per token.
    masked_logits = jnp.log(jax.lax.stop_gradient(probs))
    expert = jax.random.categorical(sample_key, masked_logits, axis=-1).astype(jnp.int32)
    if estimator == "euler":
        reduced = jnp.zeros(expert.shape, dtype=bool)
    elif estimator == "midpoint":
        reduced = jnp.ones(expert.shape, dtype=bool)
    else:
        coin = jax.random.bernoulli(coin_key, reduced_prob, expert.shape)
        reduced = coin if rule.on_argmax else coin & (expert != top)
    forward_scale = jnp.where(reduced, rule.reduced_weight, 1.0).astype(probs.dtype)
    return expert, _scaled_gate(_take(probs, expert), forward_scale, scale)


def switch_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    top_k: int = 1,
    jitter_eps: float = 0.1,
    training: bool = True,
) -> RouterOutput:
    """Switch Transformer routing, as the reference baseline (``switchgate.py``), top-1 or top-k.

    In training the logits are multiplied by ``u ~ U(1 - jitter_eps, 1 + jitter_eps)`` per
    element; ``probs`` is the softmax of the (jittered) logits, ``expert`` its argmax (its
    ``top_k`` largest, in decreasing order) and ``gate`` its value there (not renormalised over
    the ``k``, like GRIN's top-2). The gradient is plain backpropagation through the gate: the
    routing term ``nabla_0`` is dropped, as in ordinary MoE training.

    Args:
      logits: ``[..., N]``, any float dtype; ``-inf`` excludes an expert, NaN/+inf as in
        :func:`sparsemixer_route`.
      key: PRNG key for the jitter; required when ``training`` and ``jitter_eps > 0``.
      top_k: experts per token, ``1 <= top_k <= N``.
      jitter_eps: Python float ``>= 0``; training: Python bool.

    Returns:
      :class:`RouterOutput` with int32 ``expert`` and float32 ``gate`` of shape ``[...]``
      (``top_k == 1``) or ``[..., top_k]``, and ``probs`` ``[..., N]``.
    """
    fn = "switch_route"
    _check_route_args(fn, logits, top_k, jitter_eps, training)
    invalid = _check_finite_logits(fn, logits, top_k)
    logits = logits.astype(_routing_dtype(logits))
    if training and jitter_eps > 0:
        if key is None:
            raise ValueError("switch_route needs a PRNG key when training with jitter_eps > 0")
        noise = jax.random.uniform(
            key, logits.shape, logits.dtype, minval=1.0 - jitter_eps, maxval=1.0 + jitter_eps
        )
        logits = logits * noise
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(invalid[..., None], jnp.nan, probs)
    if top_k == 1:
        expert = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        return RouterOutput(expert=expert, gate=_take(probs, expert), probs=probs)
    gate, expert = jax.lax.top_k(probs, top_k)
    return RouterOutput(expert=expert.astype(jnp.int32), gate=gate, probs=probs)


def _token_mean(values: jax.Array, token_mask: jax.Array | None) -> jax.Array:
    """Mean of ``values`` over its token axes (those of ``token_mask``, or all but the last).

    ``values`` is ``[..., K]`` or ``[...]``; padding (``token_mask`` False) is left out.
    """
    if token_mask is None:
        return jnp.mean(values, axis=tuple(range(values.ndim - 1)) if values.ndim > 1 else None)
    token_axes = tuple(range(token_mask.ndim))
    weights = token_mask.astype(jnp.float32).reshape(
        token_mask.shape + (1,) * (values.ndim - token_mask.ndim)
    )
    return jnp.sum(values * weights, axis=token_axes) / jnp.maximum(jnp.sum(weights), 1.0)


def _expert_share(expert: jax.Array, num_experts: int, probs_ndim: int) -> jax.Array:
    """float32 ``[..., N]``: each token's share of its routed rows per expert (1 for top-1).

    ``expert`` is ``[...]`` (top-1) or ``[..., k]`` (top-k, then it has as many axes as the
    probabilities): each of the ``k`` rows counts ``1/k``.
    """
    share = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32)
    return jnp.mean(share, axis=-2) if expert.ndim == probs_ndim else share


def load_balancing_loss(
    probs: jax.Array, expert: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """Switch load-balancing loss ``N * sum_i f_i * P_i`` (Fedus et al., 2021, eq. 4).

    Args:
      probs: ``[..., N]`` router probabilities (gradient flows through ``P_i``).
      expert: int ``[...]`` chosen experts, or ``[..., k]`` for top-k (``f_i``, the fraction of
        routed rows, carries no gradient).
      token_mask: optional bool ``[...]``; False marks padding, left out of both means.

    Returns: scalar float32; 1.0 for perfectly uniform routing.
    """
    num_experts = probs.shape[-1]
    fraction = _token_mean(_expert_share(expert, num_experts, probs.ndim), token_mask)
    mean_prob = _token_mean(probs.astype(jnp.float32), token_mask)
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(logits: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    """Router z-loss ``mean(logsumexp(z)^2)`` (Zoph et al., 2022, ST-MoE eq. 5). Scalar float32."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return _token_mean(jnp.square(log_z), token_mask)


def routing_metrics(
    logits: jax.Array, routed: RouterOutput, token_mask: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Per-layer router statistics for logging.

    Returns a dict of float32 arrays: ``balance_loss`` and ``z_loss`` (scalars),
    ``expert_fraction`` ``[N]`` (share of routed rows per expert), ``num_unmasked`` (mean number of
    experts with nonzero probability per token) and ``entropy`` (mean router entropy, nats).
    """
    probs = routed.probs
    num_experts = probs.shape[-1]
    safe_log = jnp.log(jnp.where(probs > 0, probs, 1.0))
    return {
        "balance_loss": load_balancing_loss(probs, routed.expert, token_mask),
        "z_loss": router_z_loss(logits, token_mask),
        "expert_fraction": _token_mean(
            _expert_share(routed.expert, num_experts, probs.ndim), token_mask
        ),
        "num_unmasked": _token_mean(jnp.sum(probs > 0, axis=-1).astype(jnp.float32), token_mask),
        "entropy": _token_mean(-jnp.sum(probs * safe_log, axis=-1), token_mask),
    }


class UnchosenExperts(NamedTuple):
    """What a router's backward pass gives the experts a token did not choose
    (see :func:`unchosen_expert_term`).

    Attributes:
      values: ``"outputs"``: every expert's output for this token, computed densely in training
        (DenseMixer); ``"defaults"``: one default vector per expert, an exponential moving
        average of its past outputs kept as layer state (Default MoE).
      weight: ``"one"``: ``pi_j`` of an unchosen expert receives ``v_j . dL/dy``;
        ``"prob"``: every expert (chosen ones too) receives ``pi_j v_j . dL/dy`` on top of the
        gate's ordinary gradient (DenseMixer's blog formula, see :func:`unchosen_expert_term`).
      in_forward: whether ``sum_j pi_j v_j`` over unchosen experts is part of the layer's output
        (Default MoE as its paper writes it) or only of its backward pass (straight-through).
    """

    values: Literal["outputs", "defaults"]
    weight: Literal["one", "prob"] = "one"
    in_forward: bool = False


def unchosen_expert_term(
    probs: jax.Array,
    expert: jax.Array,
    values: jax.Array,
    rule: UnchosenExperts,
) -> jax.Array:
    """The term DenseMixer and Default MoE add to the MoE output for the router's gradient.

    Switch-style routing gives ``pi_j`` a gradient only for the experts a token chose.
    DenseMixer and Default MoE also give it one for the others, from a vector ``v_j`` standing
    for expert ``j``'s output: ``T = sum_j c_j pi_j v_j`` with ``v`` held constant (no gradient
    flows into it) and ``c_j`` the rule's weight.

    Args:
      probs: float32 ``[..., N]``, the router probabilities the chosen experts' gates come from
        (differentiable; ``RouterOutput.probs``).
      expert: int ``[...]`` (top-1) or ``[..., k]``: the chosen experts.
      values: ``[..., N, d]`` (every expert's output per token, DenseMixer) or ``[N, d]`` (one
        default vector per expert, Default MoE).
      rule: :class:`UnchosenExperts`.

    Returns:
      float32 ``[..., d]``, to be added to the layer's output. With ``rule.in_forward`` its value
      is ``sum_{j unchosen} pi_j v_j`` (Default MoE as written in its paper). Otherwise its
      value is exactly zero and only its gradient acts (straight-through): with
      ``weight="one"``, ``dL/dpi_j = v_j . dL/dy`` for every unchosen ``j`` (DenseMixer's released
      code); with ``weight="prob"``, ``dL/dpi_j = pi_j v_j . dL/dy`` for every ``j``, which
      added to the gate's own gradient gives DenseMixer's blog formula
      ``(pi_j + TopK(pi)_j) v_j . dL/dy``.
    """
    probs = probs.astype(jnp.float32)
    num_experts = probs.shape[-1]
    chosen = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32)
    if expert.ndim == probs.ndim:  # top-k: [..., k, N] -> [..., N]
        chosen = jnp.sum(chosen, axis=-2)
    if rule.weight == "one":
        coeff = probs * (1.0 - chosen)
    elif rule.weight == "prob":
        coeff = probs * jax.lax.stop_gradient(probs)
    else:
        raise ValueError(f"unknown weight rule {rule.weight!r}; expected 'one' or 'prob'")
    values = jax.lax.stop_gradient(values).astype(jnp.float32)
    # values [N, d] are shared by every token; [..., N, d] are per token.
    term = coeff @ values if values.ndim == 2 else jnp.einsum("...n,...nd->...d", coeff, values)
    if rule.in_forward:
        return term
    # Zero in value (x - x is exactly 0 for finite x), the term's gradient in the backward.
    return term - jax.lax.stop_gradient(term)


RouterFn = Callable[[jax.Array, "jax.Array | None", bool], RouterOutput]

#: Routers selectable by name from a config: keyword arguments of the routing function.
ROUTERS: dict[str, tuple[Callable[..., RouterOutput], dict]] = {
    "switch": (switch_route, {}),
    "sparsemixer": (sparsemixer_route, {}),
    "sparsemixer_1st": (sparsemixer_route, {"estimator": "euler"}),
    "sparsemixer_2nd": (sparsemixer_route, {"estimator": "midpoint"}),
    "sparsemixer_paper": (sparsemixer_route, {"mask": "paper", "midpoint_prob": 1.0}),
    "sparsemixer_nomask": (sparsemixer_route, {"mask": "none"}),
    "sparsemixer_v2": (sparsemixer_route, {"estimator": "v2"}),
    "sparsemixer_v2star": (sparsemixer_route, {"estimator": "v2star"}),
    # Switch's forward; the layer adds unchosen_expert_term (UNCHOSEN_EXPERT_RULES) for the rest.
    "densemixer": (switch_route, {}),
    "densemixer_blog": (switch_route, {}),
    "default_moe": (switch_route, {}),
    "default_moe_st": (switch_route, {}),
}

#: Routers whose backward also reaches the experts a token did not choose.
#:
#: * ``densemixer`` (Yao et al., 2025, "DenseMixer: Improving MoE Post-Training with Precise
#:   Router Gradient", github yaof20/DenseMixer): a straight-through estimate of the top-k
#:   mask. Its blog derives ``dL/dpi_j = (pi_j + TopK(pi)_j) E_j(x) . dL/dy``; its released code
#:   (``sparse.detach() + dense - dense.detach()`` with ``dense = sum_j pi_j E_j(x)``) gives
#:   ``E_j(x) . dL/dy`` to every expert. The default follows the code: it is what every result
#:   the authors report was trained with. ``densemixer_blog`` is the blog's formula.
#:   In training every expert's output is computed for every token (a dense pass used only for
#:   this gradient); the forward output and inference are Switch's.
#: * ``default_moe`` (Panda et al., 2025, "Dense Backpropagation Improves Training for Sparse
#:   Mixture-of-Experts", arXiv 2504.12463): each expert keeps a default vector, an exponential
#:   moving average of its outputs over the tokens routed to it, and an unchosen expert
#:   contributes ``pi_j * default_j`` to the output (so the router gets ``default_j . dL/dy``).
#:   The paper adds the defaults to the forward, which is the default here; its code was not
#:   available to check. ``default_moe_st`` keeps Switch's forward and uses the defaults in the
#:   backward only.
UNCHOSEN_EXPERT_RULES: dict[str, UnchosenExperts] = {
    "densemixer": UnchosenExperts("outputs"),
    "densemixer_blog": UnchosenExperts("outputs", weight="prob"),
    "default_moe": UnchosenExperts("defaults", in_forward=True),
    "default_moe_st": UnchosenExperts("defaults"),
}


def get_router(name: str, jitter_eps: float = 0.1, top_k: int = 1) -> RouterFn:
    """The router called ``name`` (a key of :data:`ROUTERS`) as ``fn(logits, key, training)``."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    if isinstance(jitter_eps, bool) or not (
        isinstance(jitter_eps, (int, float)) and math.isfinite(jitter_eps) and jitter_eps >= 0
    ):
        raise ValueError(f"router jitter_eps must be a finite number >= 0, got {jitter_eps!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"router top_k must be an int >= 1, got {top_k!r}")
    route, options = ROUTERS[name]

    def router(logits: jax.Array, key: jax.Array | None, training: bool) -> RouterOutput:
        return route(logits, key, training=training, top_k=top_k, jitter_eps=jitter_eps,
                     **options)

    return router


def uses_omega(name: str) -> bool:
    """SparseMixer scales the MoE output by a trainable ``omega``; Switch does not."""
    return name.startswith("sparsemixer")
