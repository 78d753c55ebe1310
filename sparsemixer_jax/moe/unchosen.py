"""What DenseMixer and Default MoE need for the experts a token did not choose.

Both give the router a gradient for every expert, not only the chosen ones
(:func:`sparsemixer_jax.routers.unchosen_expert_term`); they differ in the vector that stands
for an unchosen expert's output:

* DenseMixer computes it: :func:`all_expert_outputs`, a dense pass of every token through every
  expert, in training only. It costs about ``N / k`` times the routed experts' forward FLOPs,
  and nothing in the backward beyond reading its result (no gradient flows into it); memory:
  ``rows x N x mlp`` hidden activations while it runs, ``rows x N x emb`` outputs kept for the
  backward.
* Default MoE keeps one default vector per expert, an exponential moving average of the
  expert's outputs: :func:`update_expert_defaults`, once per training forward (before or after
  the term reads them: ``router.default_update``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsemixer_jax.moe.dispatch import activation_fn, ungate


def all_expert_outputs(
    x: jax.Array, params: tuple[jax.Array, ...], activation: str = "relu"
) -> jax.Array:
    """Every expert's output for every row: ``[rows, N, emb]`` in the dtype of ``x``.

    Args:
      x: ``[rows, emb]``.
      params: ``(wi [N, emb, mlp], bi [N, mlp], wo [N, mlp, emb], bo [N, emb])``, or the gated
        experts' ``(w_gate, w_up, w_down)`` (:func:`sparsemixer_jax.moe.dispatch.ungate`).
      activation: the experts' nonlinearity.

    No dropout: the result only stands for the expert's output in the router's gradient (the
    released DenseMixer code calls the experts as they are, and the models it patches have no
    dropout in their experts). Gradients are not taken through it.
    """
    wi, bi, wo, bo, activation = ungate(params, activation)
    hidden = jnp.einsum("re,nem->rnm", x, wi)
    hidden = activation_fn(activation)(hidden if bi is None else hidden + bi)
    out = jnp.einsum("rnm,nme->rne", hidden, wo)
    return out if bo is None else out + bo


def update_expert_defaults(
    defaults: jax.Array, outputs: jax.Array, group: jax.Array, decay: float
) -> jax.Array:
    """One EMA step of the default vectors: ``[N, emb]`` float32.

    For every expert ``i`` that served at least one row,
    ``default_i <- decay * default_i + (1 - decay) * mean of its rows' outputs``; an expert
    that served none keeps its vector (Default MoE, Panda et al., 2025; the mean over the
    batch's rows, and keeping an idle expert's vector, are this library's choices).

    Args:
      defaults: float32 ``[N, emb]``, the current vectors.
      outputs: ``[rows, emb]``, what the EMA averages for each row: its expert output, or
        that times its gate (``router.default_mean``).
      group: int ``[rows]``, the expert of each row; ``N`` (or more) for rows that reached no
        expert (padding, dropped by capacity), which are left out.
      decay: the EMA decay ``beta`` in ``(0, 1)``.
    """
    num_experts = defaults.shape[0]
    outputs = jax.lax.stop_gradient(outputs).astype(jnp.float32)
    sums = jax.ops.segment_sum(outputs, group, num_segments=num_experts + 1)[:num_experts]
    counts = jax.ops.segment_sum(jnp.ones(group.shape, jnp.float32), group,
                                 num_segments=num_experts + 1)[:num_experts]
    means = sums / jnp.maximum(counts, 1.0)[:, None]
    updated = decay * defaults + (1.0 - decay) * means
    return jnp.where((counts > 0)[:, None], updated, defaults)
