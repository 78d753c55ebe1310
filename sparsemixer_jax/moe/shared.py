"""Shared experts: always-on experts beside the routed ones (DeepSeek-MoE, Qwen2-MoE).

``num_shared_experts`` experts of width ``mlp_dim`` that every token goes through are one dense
feed-forward of width ``num_shared_experts * mlp_dim`` (the sum of their outputs), as DeepSeek
fuses them; Qwen2-MoE multiplies its shared expert's output by a learned sigmoid gate per token.
The router never sees them, so every router and routing option composes with them unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import feed_forward_init
from sparsemixer_jax.moe.dispatch import activation_fn


class SharedExperts(nnx.Module):
    """``y = [sigmoid(x w_g)] * ffn(x)``, ``x [..., emb] -> float32 [..., emb]``.

    ``ffn`` is the routed experts' kind at width ``width``: ``act(x wi + bi) wo + bo``, or gated
    without biases, ``(act(x w_gate) * (x w_up)) w_down``. Params ``wi``, ``wo`` (or ``w_gate``,
    ``w_up``, ``w_down``) as ``nnx.Linear`` drawn by the dense feed-forward's initialisation
    scheme, and ``gate`` (``Linear(emb -> 1)`` without bias) when ``use_gate``.
    """

    def __init__(self, emb_dim: int, width: int, *, gated: bool, activation: str,
                 use_gate: bool, init: str, dtype, rngs: nnx.Rngs):
        self.activation, self.gated = activation, gated
        fc1, fc2 = feed_forward_init(init, emb_dim), feed_forward_init(init, width)
        if gated:
            self.w_gate = fc1.linear(emb_dim, width, dtype=dtype, rngs=rngs, use_bias=False)
            self.w_up = fc1.linear(emb_dim, width, dtype=dtype, rngs=rngs, use_bias=False)
            self.w_down = fc2.linear(width, emb_dim, dtype=dtype, rngs=rngs, use_bias=False)
        else:
            self.wi = fc1.linear(emb_dim, width, dtype=dtype, rngs=rngs)
            self.wo = fc2.linear(width, emb_dim, dtype=dtype, rngs=rngs)
        self.gate = nnx.Linear(emb_dim, 1, use_bias=False, dtype=jnp.float32,
                               rngs=rngs) if use_gate else None

    def __call__(self, x: jax.Array) -> jax.Array:
        act = activation_fn(self.activation)
        if self.gated:
            y = self.w_down(act(self.w_gate(x)) * self.w_up(x))
        else:
            y = self.wo(act(self.wi(x)))
        y = y.astype(jnp.float32)
        if self.gate is not None:
            y = y * jax.nn.sigmoid(self.gate(x.astype(jnp.float32)))
        return y
