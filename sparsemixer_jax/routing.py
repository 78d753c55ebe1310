"""Top-1 expert routing: SparseMixer and the Switch Transformer baseline.

Every router here is a pure function of the router logits ``[..., N]`` (any number of leading
token axes) and a PRNG key, and returns a :class:`RouterOutput`. The caller computes the layer
output as ``gate * f_expert(x)`` (times ``omega`` for SparseMixer, see the paper's Section 3.5).
Routing math runs in float32 whatever the dtype of the logits.

Notation follows Liu, Gao & Chen, "Sparse Backpropagation for MoE Training" (ICLR 2024):
``pi`` are the (masked) router probabilities, ``D`` the chosen expert, ``g`` the rest of the
network. The exact router gradient is ``nabla_0 + nabla_1``: ``nabla_1`` flows through the gate
``pi_D`` by ordinary backpropagation, ``nabla_0`` comes from the sampling of ``D`` and is what
ordinary MoE training drops. SparseMixer estimates it with a forward-Euler or mid-point rule
applied along the path from ``0`` to ``pi_D f_D`` (see ``sparsemixer_jax.analysis`` for an exact
oracle and ``experiments/gradient_accuracy.py`` for the measured orders of accuracy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

MaskRule = Literal["reference", "paper", "none"]
Estimator = Literal["mix", "euler", "midpoint"]


class RouterOutput(NamedTuple):
    """What a top-1 router returns for each token.

    Attributes:
      expert: int32 ``[...]``, the chosen expert ``D``.
      gate: float32 ``[...]``, the multiplier the caller applies to ``f_D(x)`` (before ``omega``).
        Its backward pass carries the router gradient estimator.
      probs: float32 ``[..., N]``, the router probabilities the expert was drawn from (masked
        softmax for SparseMixer, softmax of the jittered logits for Switch); zero where masked.
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


def sparsemixer_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    jitter_eps: float = 0.1,
    training: bool = True,
    mask: MaskRule = "reference",
    estimator: Estimator = "mix",
    midpoint_prob: float = 0.5,
    backward_scale: float = 2.0,
) -> RouterOutput:
    """SparseMixer top-1 routing with its sparse router-gradient estimator.

    Args:
      logits: router logits ``z``, ``[..., N]``, any float dtype (routing runs in float32).
      key: PRNG key for sampling; required when ``training``.
      jitter_eps: the Switch jitter ``r``; sets the mask threshold.
      training: sample ``D ~ pi`` and apply the estimator; otherwise ``D = argmax`` with
        ``gate = pi_D`` and no randomness.
      mask: which experts are eligible, see :func:`routing_mask`.
      estimator: ``"mix"`` (SparseMixer: Euler on the argmax, a coin between Euler and mid-point
        elsewhere), ``"euler"`` (SparseMixer-1st, Euler everywhere), ``"midpoint"``
        (SparseMixer-2nd, mid-point everywhere, the argmax included, so training and inference
        outputs differ by a factor 2).
      midpoint_prob: for ``"mix"``, the probability that a non-argmax token takes the mid-point
        branch. 0.5 is the reference's fair coin; 1.0 is the paper's text.
      backward_scale: factor on the gate's cotangent. 2.0 as in the reference.

    Returns:
      :class:`RouterOutput`; ``expert`` int32 ``[...]``, ``gate`` float32 ``[...]``,
      ``probs`` float32 ``[..., N]``.

    The forward-Euler branch outputs ``pi_D f_D``; the mid-point branch outputs ``pi_D f_D / 2``.
    Both send ``backward_scale * dL/dgate`` to ``pi_D``. With the default scale 2 the expected
    router gradient is, per token and in the paper's notation,

    * on the argmax: Euler for both terms, ``2 g'(pi f) f dpi`` (``nabla_1`` exactly, plus the
      Euler estimate of ``nabla_0``, which has the same value);
    * elsewhere, averaged over the coin: ``g'(pi f) f dpi + g'(pi f / 2) f dpi``, i.e. ``nabla_1``
      plus the mid-point estimate of ``nabla_0``.

    Where the reference code (microsoft/SparseMixer, which produced the paper's numbers) departs
    from the paper, this function follows the reference by default:

    1. Mask threshold: ``(max z - z_i) / max(|z_i|, max z) > 2 r`` instead of the paper's
       ``max z - z_i > r (|max z| + |z_i|)`` (``mask="paper"`` gives the paper's rule).
    2. The paper's SparseMixer uses the mid-point rule on every non-argmax token; the reference
       flips a fair coin between mid-point and Euler there (``midpoint_prob=1.0`` gives the paper).
    3. The paper's estimators approximate ``nabla_0`` alone; the reference doubles the gate's
       gradient so that one backward pass also carries ``nabla_1`` (``backward_scale=1.0``
       drops the doubling).
    4. The reference samples ``D`` with the Gumbel-max trick, as here; the paper writes
       ``D ~ pi`` without saying how. The two are the same distribution.
    """
    if estimator not in ("mix", "euler", "midpoint"):
        raise ValueError(
            f"unknown estimator {estimator!r}; expected 'mix', 'euler' or 'midpoint'"
        )
    if not 0.0 <= midpoint_prob <= 1.0:
        raise ValueError(f"midpoint_prob must lie in [0, 1], got {midpoint_prob}")
    probs = router_probs(logits, jitter_eps, mask)
    top = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    if not training:
        return RouterOutput(expert=top, gate=_take(probs, top), probs=probs)
    if key is None:
        raise ValueError("sparsemixer_route needs a PRNG key when training=True")

    sample_key, coin_key = jax.random.split(key)
    # Gumbel-max over the masked logits; log(probs) differs from them by a constant per token.
    masked_logits = jnp.log(jax.lax.stop_gradient(probs))
    expert = jax.random.categorical(sample_key, masked_logits, axis=-1).astype(jnp.int32)

    if estimator == "euler":
        use_midpoint = jnp.zeros(expert.shape, dtype=bool)
    elif estimator == "midpoint":
        use_midpoint = jnp.ones(expert.shape, dtype=bool)
    else:
        coin = jax.random.bernoulli(coin_key, midpoint_prob, expert.shape)
        use_midpoint = coin & (expert != top)
    forward_scale = jnp.where(use_midpoint, 0.5, 1.0).astype(probs.dtype)
    gate = _scaled_gate(_take(probs, expert), forward_scale, float(backward_scale))
    return RouterOutput(expert=expert, gate=gate, probs=probs)


def switch_route(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    jitter_eps: float = 0.1,
    training: bool = True,
) -> RouterOutput:
    """Switch Transformer top-1 routing, as the reference baseline (``switchgate.py``).

    In training the logits are multiplied by ``u ~ U(1 - jitter_eps, 1 + jitter_eps)`` per
    element; ``probs`` is the softmax of the (jittered) logits, ``expert`` its argmax and ``gate``
    its value there. The gradient is plain backpropagation through the gate: the routing term
    ``nabla_0`` is dropped, as in ordinary MoE training.

    Args:
      logits: ``[..., N]``, any float dtype.
      key: PRNG key for the jitter; required when ``training`` and ``jitter_eps > 0``.

    Returns:
      :class:`RouterOutput` with float32 ``gate`` ``[...]`` and ``probs`` ``[..., N]``.
    """
    logits = logits.astype(_routing_dtype(logits))
    if training and jitter_eps > 0:
        if key is None:
            raise ValueError("switch_route needs a PRNG key when training with jitter_eps > 0")
        noise = jax.random.uniform(
            key, logits.shape, logits.dtype, minval=1.0 - jitter_eps, maxval=1.0 + jitter_eps
        )
        logits = logits * noise
    probs = jax.nn.softmax(logits, axis=-1)
    expert = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    return RouterOutput(expert=expert, gate=_take(probs, expert), probs=probs)


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


def load_balancing_loss(
    probs: jax.Array, expert: jax.Array, token_mask: jax.Array | None = None
) -> jax.Array:
    """Switch load-balancing loss ``N * sum_i f_i * P_i`` (Fedus et al., 2021, eq. 4).

    Args:
      probs: ``[..., N]`` router probabilities (gradient flows through ``P_i``).
      expert: int ``[...]`` chosen experts (``f_i``, the token fraction, carries no gradient).
      token_mask: optional bool ``[...]``; False marks padding, left out of both means.

    Returns: scalar float32; 1.0 for perfectly uniform routing.
    """
    num_experts = probs.shape[-1]
    fraction = _token_mean(jax.nn.one_hot(expert, num_experts, dtype=jnp.float32), token_mask)
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
    ``expert_fraction`` ``[N]`` (share of tokens per expert), ``num_unmasked`` (mean number of
    experts with nonzero probability per token) and ``entropy`` (mean router entropy, nats).
    """
    probs = routed.probs
    num_experts = probs.shape[-1]
    safe_log = jnp.log(jnp.where(probs > 0, probs, 1.0))
    return {
        "balance_loss": load_balancing_loss(probs, routed.expert, token_mask),
        "z_loss": router_z_loss(logits, token_mask),
        "expert_fraction": _token_mean(
            jax.nn.one_hot(routed.expert, num_experts, dtype=jnp.float32), token_mask
        ),
        "num_unmasked": _token_mean(jnp.sum(probs > 0, axis=-1).astype(jnp.float32), token_mask),
        "entropy": _token_mean(-jnp.sum(probs * safe_log, axis=-1), token_mask),
    }


RouterFn = Callable[[jax.Array, "jax.Array | None", bool], RouterOutput]

#: Routers selectable by name from a config. Each entry maps ``jitter_eps`` to a router.
ROUTERS: dict[str, Callable[[float], RouterFn]] = {
    "switch": lambda eps: lambda z, key, training: switch_route(
        z, key, jitter_eps=eps, training=training
    ),
    "sparsemixer": lambda eps: lambda z, key, training: sparsemixer_route(
        z, key, jitter_eps=eps, training=training
    ),
    "sparsemixer_1st": lambda eps: lambda z, key, training: sparsemixer_route(
        z, key, jitter_eps=eps, training=training, estimator="euler"
    ),
    "sparsemixer_2nd": lambda eps: lambda z, key, training: sparsemixer_route(
        z, key, jitter_eps=eps, training=training, estimator="midpoint"
    ),
    "sparsemixer_paper": lambda eps: lambda z, key, training: sparsemixer_route(
        z, key, jitter_eps=eps, training=training, mask="paper", midpoint_prob=1.0
    ),
    "sparsemixer_nomask": lambda eps: lambda z, key, training: sparsemixer_route(
        z, key, jitter_eps=eps, training=training, mask="none"
    ),
}


def get_router(name: str, jitter_eps: float = 0.1) -> RouterFn:
    """The router called ``name`` (a key of :data:`ROUTERS`) as ``fn(logits, key, training)``."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    if jitter_eps < 0:
        raise ValueError(f"router jitter_eps must be >= 0, got {jitter_eps}")
    return ROUTERS[name](jitter_eps)


def uses_omega(name: str) -> bool:
    """SparseMixer scales the MoE output by a trainable ``omega``; Switch does not."""
    return name.startswith("sparsemixer")
