"""What every router shares: its output, the routing dtype, and the checks of its arguments.

:func:`check_route_args` is the one place that states the rules for the router arguments
every router takes (``top_k``, ``jitter_eps``, ``training``); the routing functions, the
routers by name (:func:`sparsemixer_jax.routers.registry.check_router`) and the config
validator all call it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RouterOutput(NamedTuple):
    """What a router returns for each token.

    Attributes:
      expert: int32 ``[...]`` (top-1) or ``[..., k]`` (top-k, distinct experts), the chosen ``D``.
      gate: float32, same shape as ``expert``: the multiplier the caller applies to ``f_D(x)``
        (before ``omega``). Its backward pass carries the router gradient estimator.
      probs: float32 ``[..., N]``, the router probabilities the (first) expert was drawn from
        (masked softmax for SparseMixer, softmax of the jittered logits for Switch); zero where
        masked. Under sigmoid scores: the scores normalised to sum to 1 over all experts (what
        the balance loss and the statistics read).
      scores: float32 ``[..., N]``, the sigmoid scores the gates are made of (before their
        renormalisation over the chosen experts), or None under softmax scores.
    """

    expert: jax.Array
    gate: jax.Array
    probs: jax.Array
    scores: jax.Array | None = None


def routing_dtype(logits: jax.Array) -> jnp.dtype:
    """float32 for bfloat16/float16/float32 logits; float64 only when the caller asks for it."""
    return jnp.promote_types(logits.dtype, jnp.float32)


def take_expert(values: jax.Array, index: jax.Array) -> jax.Array:
    """``values[..., index]`` per token: ``values [..., N]``, int ``index [...]`` -> ``[...]``."""
    return jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0]


def check_top_k(where: str, top_k, num_experts: int | None = None) -> None:
    """ValueError unless ``top_k`` is a Python int in ``[1, num_experts]``.

    ``where`` prefixes the argument's name in the message: ``"sparsemixer_route: "`` names a
    function's argument, ``"config.router."`` a config field.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        bound = "" if num_experts is None else f", num_experts={num_experts}"
        raise ValueError(f"{where}top_k must be an int in [1{bound}], got {top_k!r}")
    if num_experts is not None and top_k > num_experts:
        raise ValueError(
            f"{where}top_k={top_k} is larger than num_experts={num_experts} (a token picks "
            f"distinct experts); top_k must be an int in [1, num_experts={num_experts}], "
            f"got {top_k}"
        )


def check_jitter_eps(where: str, jitter_eps) -> None:
    """ValueError unless ``jitter_eps`` is a finite Python number ``>= 0`` (``where`` as in
    :func:`check_top_k`)."""
    if (
        isinstance(jitter_eps, bool)
        or not isinstance(jitter_eps, (int, float, np.floating, np.integer))
        or not math.isfinite(jitter_eps)
        or jitter_eps < 0
    ):
        raise ValueError(f"{where}jitter_eps must be a finite number >= 0, got {jitter_eps!r}")


def check_route_args(fn: str, logits, top_k, jitter_eps, training) -> None:
    """ValueError naming the argument and its value for anything a router cannot use: logits
    without an expert axis or of a dtype that is not a float, and the static arguments.

    These are static (Python) arguments: they pick code paths and shapes at trace time, so a
    traced value is refused too.
    """
    if jnp.ndim(logits) < 1:
        raise ValueError(
            f"{fn}: logits must have at least one axis (experts last, shape [..., N]), "
            f"got shape {jnp.shape(logits)}"
        )
    # Integer or boolean logits would route without error (an integer softmax is not one), so
    # a cast the caller forgot would pass unseen.
    dtype = logits.dtype if hasattr(logits, "dtype") else jnp.asarray(logits).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{fn}: logits must have a float dtype (float32, bfloat16, float16 or float64), got "
            f"{dtype}; cast them first, e.g. logits.astype(jnp.float32)"
        )
    num_experts = jnp.shape(logits)[-1]
    if num_experts < 1:
        raise ValueError(f"{fn}: logits need at least one expert, got shape {jnp.shape(logits)}")
    check_top_k(f"{fn}: ", top_k, num_experts)
    check_jitter_eps(f"{fn}: ", jitter_eps)
    if not isinstance(training, (bool, np.bool_)):
        raise ValueError(
            f"{fn}: training must be a Python bool (it selects sampling or argmax when the "
            f"function is traced), got {training!r}"
        )


def check_finite_logits(fn: str, logits: jax.Array, top_k: int) -> jax.Array:
    """bool ``[...]``: True for tokens whose logits hold NaN or +inf (they route to NaN gates).

    ``-inf`` is allowed: it removes that expert for that token. Outside ``jit`` (concrete
    logits on this process's devices) a token with NaN, +inf or fewer than ``top_k`` experts
    above ``-inf`` raises a ValueError; under ``jit`` (or for an array spread over several
    processes) values cannot raise, and such tokens get NaN ``probs`` and ``gate``
    so that the loss turns NaN (the training loop then skips the update and reports it).
    """
    invalid = jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1)
    # Concrete logits on this process's devices are checked here; traced ones cannot be, nor
    # can a global array spread over several processes (no host may fetch all of it).
    if not isinstance(logits, jax.core.Tracer) and invalid.is_fully_addressable:
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
