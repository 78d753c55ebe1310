"""Expert routing (top-1 and top-k): SparseMixer, GRIN's SparseMixer-v2, the Switch baseline, and
the dense-backward routers DenseMixer and Default MoE; the public router API.

Every router here is a pure function of the router logits ``[..., N]`` (any number of leading
token axes) and a PRNG key, and returns a :class:`RouterOutput`. The caller computes the layer
output as ``gate * f_expert(x)``, summed over the ``k`` experts of a token for top-k (times
``omega`` for SparseMixer, see the paper's Section 3.5). Routing math runs in float32 whatever
the dtype of the logits. Needs only JAX: no Flax, Optax or Orbax is imported here, so a
``pip install sparsemixer-jax`` without extras can use it.

One module per concern; import the names from this package, not from the modules:

* :mod:`~sparsemixer_jax.routers.common`: :class:`RouterOutput` and the argument checks.
* :mod:`~sparsemixer_jax.routers.sparsemixer`: :func:`sparsemixer_route`, SparseMixer and
  GRIN's SparseMixer-v2, which checks its arguments and picks one of the routes below.
* :mod:`~sparsemixer_jax.routers.sparsemixer_softmax`: SparseMixer on softmax scores, top-1 or
  top-k, every estimator.
* :mod:`~sparsemixer_jax.routers.sparsemixer_selection_bias`: SparseMixer on softmax scores
  under a selection bias (bias balancing), with its two-path backward.
* :mod:`~sparsemixer_jax.routers.sampling`: what the SparseMixer routes share: the mask, the
  masked softmax, the keys of a draw, and the gates whose backward carries an estimator.
* :mod:`~sparsemixer_jax.routers.estimators`: SparseMixer's gradient estimators as data (their
  forward weights, coins and backward scales, and their two-path split) and the checks of their
  options.
* :mod:`~sparsemixer_jax.routers.sigmoid_scores`: SparseMixer under sigmoid scores (its sampling
  distribution and two-path backward over the chosen set).
* :mod:`~sparsemixer_jax.routers.switch`: Switch routing (also DenseMixer's and Default MoE's
  forward).
* :mod:`~sparsemixer_jax.routers.unchosen`: DenseMixer's and Default MoE's term for the experts
  a token did not choose (the "unchosen-expert term"; the layer's side is
  :mod:`sparsemixer_jax.moe.unchosen`).
* :mod:`~sparsemixer_jax.routers.losses`: load-balancing losses (micro-batch, sequence,
  global batch), z-loss, routing statistics.
* :mod:`~sparsemixer_jax.routers.selection`: group-limited selection, per-expert loads and the
  bias step of auxiliary-loss-free balancing.
* :mod:`~sparsemixer_jax.routers.registry`: routers by name and their config section
  :class:`RouterConfig` (``config.router``), which checks itself.
* :mod:`~sparsemixer_jax.routers.replay`: routing replay: given experts, the live router's
  gates over them.
"""

from sparsemixer_jax.routers.common import (
    RouterOutput,
    check_finite_logits,
    check_jitter_eps,
    check_route_args,
    check_top_k,
)
from sparsemixer_jax.routers.estimators import (
    ESTIMATORS,
    TWO_PATH_RULES,
    Estimator,
    EstimatorRule,
    TwoPathRule,
    two_path_scales,
)
from sparsemixer_jax.routers.losses import (
    global_balancing_loss,
    load_balancing_loss,
    router_z_loss,
    routing_metrics,
    sequence_balancing_loss,
)
from sparsemixer_jax.routers.registry import (
    BALANCE_NORMALIZATIONS,
    DEFAULT_MEANS,
    DEFAULT_UPDATES,
    ROUTER_OPTIONS,
    ROUTERS,
    UNCHOSEN_EXPERT_RULES,
    RouterConfig,
    RouterFn,
    check_router,
    get_router,
    router_fn,
    uses_omega,
)
from sparsemixer_jax.routers.replay import (
    check_given_experts,
    check_replay_router,
    replayed_route,
    replays,
)
from sparsemixer_jax.routers.sampling import (
    MaskRule,
    router_probs,
    routing_keys,
    routing_mask,
    scaled_gate,
    selection_probs,
    two_path_gate,
)
from sparsemixer_jax.routers.selection import (
    BALANCE_SCOPES,
    SCORES,
    bias_step,
    expert_load,
    limit_to_groups,
    selection_scores,
)
from sparsemixer_jax.routers.sigmoid_scores import (
    renormalised_gates,
    sigmoid_sample_probs,
    sparsemixer_sigmoid_route,
)
from sparsemixer_jax.routers.sparsemixer import sparsemixer_route
from sparsemixer_jax.routers.sparsemixer_selection_bias import sparsemixer_selection_bias_route
from sparsemixer_jax.routers.sparsemixer_softmax import sparsemixer_softmax_route
from sparsemixer_jax.routers.switch import switch_route
from sparsemixer_jax.routers.unchosen import UnchosenExperts, unchosen_expert_term

__all__ = [
    "BALANCE_NORMALIZATIONS",
    "BALANCE_SCOPES",
    "DEFAULT_MEANS",
    "DEFAULT_UPDATES",
    "ESTIMATORS",
    "ROUTERS",
    "ROUTER_OPTIONS",
    "SCORES",
    "TWO_PATH_RULES",
    "UNCHOSEN_EXPERT_RULES",
    "Estimator",
    "EstimatorRule",
    "MaskRule",
    "RouterConfig",
    "RouterFn",
    "RouterOutput",
    "TwoPathRule",
    "UnchosenExperts",
    "bias_step",
    "check_finite_logits",
    "check_given_experts",
    "check_jitter_eps",
    "check_replay_router",
    "check_route_args",
    "check_router",
    "check_top_k",
    "expert_load",
    "get_router",
    "global_balancing_loss",
    "limit_to_groups",
    "load_balancing_loss",
    "renormalised_gates",
    "replayed_route",
    "replays",
    "router_fn",
    "router_probs",
    "router_z_loss",
    "routing_keys",
    "routing_mask",
    "routing_metrics",
    "scaled_gate",
    "selection_probs",
    "selection_scores",
    "sequence_balancing_loss",
    "sigmoid_sample_probs",
    "sparsemixer_route",
    "sparsemixer_selection_bias_route",
    "sparsemixer_sigmoid_route",
    "sparsemixer_softmax_route",
    "switch_route",
    "two_path_gate",
    "two_path_scales",
    "unchosen_expert_term",
    "uses_omega",
]
