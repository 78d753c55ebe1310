"""Shared experts: always-on experts beside the routed ones (DeepSeek-MoE, Qwen2-MoE).

``num_shared_experts`` experts of width ``mlp_dim`` that every token goes through are one dense
feed-forward of width ``num_shared_experts * mlp_dim`` (the sum of their outputs), as DeepSeek
fuses them; Qwen2-MoE multiplies its shared expert's output by a learned sigmoid gate per token.
The router never sees them, so every router and routing option composes with them unchanged.

The MoE layer draws them by the project's initialisation schemes
(:meth:`SharedExperts.from_scheme`); the language model by its Hugging Face type's own
(:class:`sparsemixer_jax.models.causal_lm.MoEBlock`), through the ``linear`` it passes.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import feed_forward_init
from sparsemixer_jax.moe.dispatch import activation_fn


class MakeLinear(Protocol):
    """Builds one projection ``[in_features] -> [out_features]``, drawing its params: what it
    computes in (its ``dtype``) and how its params are initialised are the maker's."""

    def __call__(self, in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
        ...


class SharedExperts(nnx.Module):
    """``y = [sigmoid(x w_g)] * ffn(x)``, ``x [..., emb] -> float32 [..., emb]``.

    ``ffn`` is the routed experts' kind at width ``width``: ``act(x wi + bi) wo + bo``, or gated
    without biases, ``(act(x w_gate) * (x w_up)) w_down``. The gate's logit is taken in its
    ``Linear``'s dtype, its sigmoid and the product in float32.

    Args:
      linear: makes the feed-forward's projections, drawn in order ``wi``, ``wo`` (gated:
        ``w_gate``, ``w_up``, ``w_down``).
      gate_linear: makes the gate ``Linear(emb -> 1)`` (without bias), drawn last; None: no
        gate.

    Params: ``wi``, ``wo`` (or ``w_gate``, ``w_up``, ``w_down``) and ``gate`` (with a
    ``gate_linear``), each an ``nnx.Linear``.
    """

    def __init__(self, emb_dim: int, width: int, *, gated: bool, activation: str,
                 linear: MakeLinear, gate_linear: MakeLinear | None = None):
        self.activation, self.gated = activation, gated
        if gated:
            self.w_gate = linear(emb_dim, width, use_bias=False)
            self.w_up = linear(emb_dim, width, use_bias=False)
            self.w_down = linear(width, emb_dim, use_bias=False)
        else:
            self.wi = linear(emb_dim, width, use_bias=True)
            self.wo = linear(width, emb_dim, use_bias=True)
        self.gate = None if gate_linear is None else gate_linear(emb_dim, 1, use_bias=False)

    @classmethod
    def from_scheme(cls, emb_dim: int, width: int, *, gated: bool, activation: str,
                    use_gate: bool, init: str, dtype, rngs: nnx.Rngs,
                    std: float = 0.02) -> SharedExperts:
        """The MoE layer's: projections in ``dtype`` drawn by the dense feed-forward's
        initialisation scheme ``init`` (:func:`sparsemixer_jax.initializers.feed_forward_init`;
        ``"normal"``: ``normal(std)`` weights, zero biases), the gate (when ``use_gate``) in
        float32, LeCun-normal."""
        def linear(in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
            if init == "normal":
                return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                                  param_dtype=jnp.float32,
                                  kernel_init=nnx.initializers.normal(std), rngs=rngs)
            return feed_forward_init(init, in_features).linear(
                in_features, out_features, dtype=dtype, rngs=rngs, use_bias=use_bias)

        def gate_linear(in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
            return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=jnp.float32,
                              rngs=rngs)

        return cls(emb_dim, width, gated=gated, activation=activation, linear=linear,
                   gate_linear=gate_linear if use_gate else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        act = activation_fn(self.activation)
        if self.gated:
            y = self.w_down(act(self.w_gate(x)) * self.w_up(x))
        else:
            y = self.wo(act(self.wi(x)))
        y = y.astype(jnp.float32)
        if self.gate is not None:
            y = y * jax.nn.sigmoid(self.gate(x).astype(jnp.float32))
        return y
