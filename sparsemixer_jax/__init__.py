"""sparsemixer-jax: SparseMixer routing (Liu, Gao & Chen, ICLR 2024) for JAX/Flax MoE models.

Importing the package loads JAX and Flax only; the data pipeline (TensorFlow Datasets,
SentencePiece) and the training loop are imported from their modules when needed.
"""

from sparsemixer_jax.decode import (
    beam_search,
    beam_search_model,
    greedy_search,
    greedy_search_model,
)
from sparsemixer_jax.models import DecodeCache, Encoded, Transformer
from sparsemixer_jax.moe import MoEFeedForward, expert_ffn, fold_omega
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
from sparsemixer_jax.sharding import make_mesh, shard_state

__all__ = [
    "ROUTERS",
    "DecodeCache",
    "Encoded",
    "MoEFeedForward",
    "RouterOutput",
    "Transformer",
    "beam_search",
    "beam_search_model",
    "expert_ffn",
    "fold_omega",
    "get_router",
    "greedy_search",
    "greedy_search_model",
    "load_balancing_loss",
    "make_mesh",
    "router_probs",
    "router_z_loss",
    "routing_mask",
    "routing_metrics",
    "shard_state",
    "sparsemixer_route",
    "switch_route",
    "uses_omega",
]

__version__ = "0.1.0"
