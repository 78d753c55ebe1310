"""sparsemixer-jax: SparseMixer routing (Liu, Gao & Chen, ICLR 2024) for JAX/Flax MoE models."""

from sparsemixer_jax.routing import (
    ROUTERS,
    RouterOutput,
    get_router,
    load_balancing_loss,
    router_probs,
    router_z_loss,
    routing_mask,
    routing_metrics,
    sparsemixer_route,
    switch_route,
    uses_omega,
)

__all__ = [
    "ROUTERS",
    "RouterOutput",
    "get_router",
    "load_balancing_loss",
    "router_probs",
    "router_z_loss",
    "routing_mask",
    "routing_metrics",
    "sparsemixer_route",
    "switch_route",
    "uses_omega",
]

__version__ = "0.1.0"

# The Switch Transformer and its decoding (flax only, no TensorFlow).
from sparsemixer_jax.decode import (
    beam_search,
    beam_search_model,
    greedy_search,
    greedy_search_model,
)
from sparsemixer_jax.models import DecodeCache, Encoded, Transformer, fold_omega

__all__ += [
    "DecodeCache",
    "Encoded",
    "Transformer",
    "beam_search",
    "beam_search_model",
    "fold_omega",
    "greedy_search",
    "greedy_search_model",
]

# The MoE feed-forward layer and expert parallelism.
from sparsemixer_jax.moe import MoEFeedForward, expert_ffn  # noqa: E402 (appended block)
from sparsemixer_jax.sharding import make_mesh, shard_state  # noqa: E402

__all__ += ["MoEFeedForward", "expert_ffn", "make_mesh", "shard_state"]
