"""A token's expert outputs combined: :func:`gated_sum`, ``sum_t f_t * (gate_t * omega)`` over
its chosen experts, with a backward pass that keeps the inputs rather than their float32
products (the MoE layer's last step, :class:`sparsemixer_jax.moe.MoEFeedForward`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def gated_sum(f: jax.Array, gate: jax.Array, omega: jax.Array | None) -> jax.Array:
    """float32 ``sum_t f_t * (gate_t * omega)`` over a token's ``k`` choices: expert
    outputs ``f [B, T, k, emb]`` (or ``[B, T, emb]`` for top-1), gates ``[B, T, k]``
    (``[B, T]``), ``omega [emb]`` or None.

    Its backward keeps the inputs, ``f`` in its compute dtype and the gates, not the float32
    ``[B, T, k, emb]`` products (an update of a deep model would otherwise keep a float32 copy
    of every layer's expert outputs, and under ``omega`` the broadcast scales too); it reduces
    ``omega``'s gradient over the tokens on its own, apart from the gates' (over ``emb``), so
    that neither needs its operands transposed.
    """
    if omega is None:
        return _gated_sum(f, gate)
    return _omega_gated_sum(f, gate, omega)


def _weighted(f, scale):
    y = f.astype(jnp.float32) * scale
    return jnp.sum(y, axis=2) if y.ndim == 4 else y


# Rematerialised: no optimisation barrier (prevent_cse=False), so that XLA may fuse the
# recomputation into the grouped dispatch's backward; in the layer scan the forward's values
# are out of reach of CSE anyway.
@functools.partial(jax.checkpoint, prevent_cse=False)
def _gated_sum(f, gate):
    return _weighted(f, gate[..., None])


@jax.custom_vjp
def _omega_gated_sum(f, gate, omega):
    return _weighted(f, gate[..., None] * omega)


def _omega_gated_sum_fwd(f, gate, omega):
    return _weighted(f, gate[..., None] * omega), (f, gate, omega)


def _omega_gated_sum_bwd(residuals, cotangent):
    f, gate, omega = residuals
    dy = cotangent[..., None, :] if f.ndim == 4 else cotangent
    d_scale = dy * f.astype(jnp.float32)  # the cotangent of gate * omega, [B, T, (k,) emb]
    d_f = (dy * (gate[..., None] * omega)).astype(f.dtype)
    d_gate = jnp.sum(d_scale * omega, axis=-1)
    d_omega = jnp.sum(d_scale * gate[..., None], axis=tuple(range(f.ndim - 1)))
    return d_f, d_gate, d_omega


_omega_gated_sum.defvjp(_omega_gated_sum_fwd, _omega_gated_sum_bwd)
