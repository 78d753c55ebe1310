"""The student: the project's :class:`~sparsemixer_jax.MoEFeedForward` layers, residual, on
token vectors; and the dense baselines as the same layer with one expert.

A one-expert ``MoEFeedForward`` with the Switch router is exactly a dense FFN: the softmax of a
single logit is 1, so the gate is the constant 1 and the router gets no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lab.router_bench.arms import Arm
from sparsemixer_jax.moe import MoEConfig, MoEFeedForward
from sparsemixer_jax.routers import RouterConfig, check_router

ORACLE_ROUTER_SCALE = 20.0


class Student(nnx.Module):
    """``depth`` residual layers; the output is ``h_L - x`` as for the teacher.

    Args:
      arm: the configuration (router, eps, top-k, N, depth, dense baselines, expert family:
        ReLU experts, or tanh where ``arm.student_experts`` is ``"tanh"``).
      dim: token width ``d``; hidden: width of each expert's MLP.
      rngs: streams ``params`` and ``router``.
      dispatch: the layer's dispatch (``"ragged"`` or ``"padded"``); the same arithmetic.
    """

    def __init__(self, arm: Arm, dim: int, hidden: int, *, rngs: nnx.Rngs,
                 dispatch: str = "padded"):
        layers = []
        for _ in range(arm.depth):
            if arm.dense is not None:
                width = hidden * arm.num_experts if arm.dense == "params" else hidden
                layer = MoEFeedForward(
                    (dim, width), MoEConfig(num_experts=1, activation_dropout=0.0,
                                            dispatch=dispatch, init="flax"),
                    RouterConfig(name="switch", jitter_eps=0.0), rngs=rngs)
            else:
                activation = "tanh" if arm.student_experts == "tanh" else "relu"
                layer = MoEFeedForward(
                    (dim, hidden), MoEConfig(num_experts=arm.num_experts, activation_dropout=0.0,
                                             dispatch=dispatch, activation=activation,
                                             init="flax"),
                    check_router(arm.router, jitter_eps=arm.jitter_eps, top_k=arm.top_k,
                                 num_experts=arm.num_experts, **arm.router_options()),
                    rngs=rngs)
            layers.append(layer)
        self.layers = nnx.List(layers)

    def __call__(self, x: jax.Array, *, deterministic: bool = False
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``x [B, d]`` -> ``(y [B, d], aux)``.

        ``aux``: ``balance_loss`` (sum over layers), ``zero_grad`` (mean over layers of the
        share of tokens with one eligible expert, whose router gets no gradient),
        ``non_argmax``, ``load_max`` (means over layers), ``expert_share`` ``[L, N]`` (each
        layer's share of routed rows per expert) and ``choices`` int32 ``[L, B]``: each layer's
        argmax expert (the expert at evaluation; with bias balancing, of the biased logits).
        """
        h = x
        balance, zero_grad, non_argmax, load_max, choices, share = 0.0, [], [], [], [], []
        for layer in self.layers:
            logits = layer.router(h)
            if layer.expert_bias is not None:
                logits = logits + layer.expert_bias[...]
            choices.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
            out, metrics = layer(h[None], deterministic=deterministic)
            h = h + out[0]
            balance = balance + metrics["balance_loss"]
            zero_grad.append(metrics["eligible_fraction"][0])
            non_argmax.append(metrics["non_argmax_share"])
            load_max.append(metrics["load_max"])
            share.append(metrics["expert_fraction"])
        aux = {
            "balance_loss": jnp.asarray(balance, jnp.float32),
            "zero_grad": jnp.mean(jnp.stack(zero_grad)),
            "non_argmax": jnp.mean(jnp.stack(non_argmax)),
            "load_max": jnp.mean(jnp.stack(load_max)),
            "expert_share": jnp.stack(share),
            "choices": jnp.stack(choices),
        }
        return h - x, aux


def set_oracle_router(model: Student, router_w: jax.Array, router_b: jax.Array) -> None:
    """Give every layer the teacher's router (``router_w [L, d, K]``, ``router_b [L, K]``),
    scaled by :data:`ORACLE_ROUTER_SCALE` so that its softmax is one-hot on the data."""
    for i, layer in enumerate(model.layers):
        layer.router.kernel[...] = ORACLE_ROUTER_SCALE * router_w[i]
        layer.router.bias[...] = ORACLE_ROUTER_SCALE * router_b[i]
