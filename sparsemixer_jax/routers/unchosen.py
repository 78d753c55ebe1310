"""DenseMixer and Default MoE: the term that gives the router a gradient for the experts a
token did not choose.

Switch-style routing gives ``pi_j`` a gradient only for the experts a token chose. DenseMixer
(Yao et al., 2025, github yaof20/DenseMixer) and Default MoE (Panda et al., 2025, arXiv
2504.12463) also give it one for the others, from a vector ``v_j`` standing for expert ``j``'s
output: every expert's output from a dense pass (DenseMixer), or a default vector per expert,
an exponential moving average of its past outputs (Default MoE). Their forward is Switch's
deterministic top-k (:func:`sparsemixer_jax.routers.switch.switch_route`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp


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
        (``default_moe_forward``) or only of its backward pass (straight-through: DenseMixer's
        code, and ``default_moe``).
    """

    values: Literal["outputs", "defaults"]
    weight: Literal["one", "prob"] = "one"
    in_forward: bool = False


def chosen_mask(expert: jax.Array, num_experts: int, probs_ndim: int) -> jax.Array:
    """float32 ``[..., N]``: 1 for the experts a token chose (``expert`` ``[...]`` top-1 or
    ``[..., k]`` top-k, ``probs_ndim`` the number of axes of the probabilities)."""
    chosen = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32)
    if expert.ndim == probs_ndim:  # top-k: [..., k, N] -> [..., N]
        chosen = jnp.sum(chosen, axis=-2)
    return chosen


def unchosen_expert_term(
    probs: jax.Array,
    expert: jax.Array,
    values: jax.Array,
    rule: UnchosenExperts,
    *,
    normalize_top_k: bool = False,
) -> jax.Array:
    """The term DenseMixer and Default MoE add to the MoE output for the router's gradient.

    ``T = sum_j c_j pi_j v_j`` with ``v`` held constant (no gradient flows into it) and ``c_j``
    the rule's weight.

    Args:
      probs: float32 ``[..., N]``, the router probabilities the chosen experts' gates come from
        (differentiable; ``RouterOutput.probs``).
      expert: int ``[...]`` (top-1) or ``[..., k]``: the chosen experts.
      values: ``[..., N, d]`` (every expert's output per token, DenseMixer) or ``[N, d]`` (one
        default vector per expert, Default MoE).
      rule: :class:`UnchosenExperts`.
      normalize_top_k: the router's gates are renormalised over the chosen experts
        (``pi_j / S``, ``S = sum_{chosen} pi``). Then an unchosen expert's weight is
        ``pi_j / S`` with ``S`` held constant, as DenseMixer's released code writes its dense
        weights under ``norm_topk_prob``: ``pi (1 - mask) / S.detach() + pi mask / S``, whose
        chosen half is the router's own renormalised gate. Not defined for ``weight="prob"``.

    Returns:
      float32 ``[..., d]``, to be added to the layer's output. With ``rule.in_forward`` its value
      is ``sum_{j unchosen} pi_j v_j`` (over ``S`` when normalised). Otherwise its value is
      exactly zero and only its gradient acts (straight-through): with ``weight="one"``,
      ``dL/dpi_j = v_j . dL/dy`` (``/ S``) for every unchosen ``j`` (DenseMixer's released code);
      with ``weight="prob"``, ``dL/dpi_j = pi_j v_j . dL/dy`` for every ``j``, which added to
      the gate's own gradient gives DenseMixer's blog formula ``(pi_j + TopK(pi)_j) v_j . dL/dy``.
    """
    probs = probs.astype(jnp.float32)
    chosen = chosen_mask(expert, probs.shape[-1], probs.ndim)
    if rule.weight == "one":
        coeff = probs * (1.0 - chosen)
    elif rule.weight == "prob":
        if normalize_top_k:
            raise ValueError("normalize_top_k is not defined for the blog formula (weight='prob')")
        coeff = probs * jax.lax.stop_gradient(probs)
    else:
        raise ValueError(f"unknown weight rule {rule.weight!r}; expected 'one' or 'prob'")
    if normalize_top_k:
        coeff = coeff / jax.lax.stop_gradient(jnp.sum(probs * chosen, axis=-1, keepdims=True))
    values = jax.lax.stop_gradient(values).astype(jnp.float32)
    # values [N, d] are shared by every token; [..., N, d] are per token.
    term = coeff @ values if values.ndim == 2 else jnp.einsum("...n,...nd->...d", coeff, values)
    if rule.in_forward:
        return term
    # Zero in value (x - x is exactly 0 for finite x), the term's gradient in the backward.
    return term - jax.lax.stop_gradient(term)
