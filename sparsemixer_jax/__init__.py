"""sparsemixer-jax: SparseMixer routing (Liu, Gao & Chen, ICLR 2024) for JAX/Flax MoE models.

The routers (:mod:`sparsemixer_jax.routers`) need JAX alone, so ``import sparsemixer_jax`` loads
only JAX: the names below that need Flax (the MoE layer, the model, decoding, sharding of model
state) are imported on first use, and a plain ``pip install sparsemixer-jax`` (no ``[train]``
extra) can route; importing what needs a missing extra names the extra to install
(:mod:`sparsemixer_jax.extras`). The data pipeline (TensorFlow Datasets, SentencePiece) and the
training loop are imported from their modules when needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsemixer_jax.extras import name_missing_extras
from sparsemixer_jax.lazy_names import lazy_names
from sparsemixer_jax.routers import (
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

if TYPE_CHECKING:
    from sparsemixer_jax.layers.attention import KVCache
    from sparsemixer_jax.models.decode import (
        beam_search,
        beam_search_model,
        greedy_search,
        greedy_search_model,
    )
    from sparsemixer_jax.models.encoder_decoder import Encoded, Transformer
    from sparsemixer_jax.moe import MoEFeedForward, expert_ffn, fold_omega
    from sparsemixer_jax.parallel.sharding import make_mesh, shard_state

# Names loaded on first use (module __getattr__ below), with the module that defines each: most
# import Flax, and the others (expert_ffn, make_mesh) load more than routing needs.
_LAZY = {
    "beam_search": "sparsemixer_jax.models.decode",
    "beam_search_model": "sparsemixer_jax.models.decode",
    "greedy_search": "sparsemixer_jax.models.decode",
    "greedy_search_model": "sparsemixer_jax.models.decode",
    "KVCache": "sparsemixer_jax.layers.attention",
    "Encoded": "sparsemixer_jax.models.encoder_decoder",
    "Transformer": "sparsemixer_jax.models.encoder_decoder",
    "MoEFeedForward": "sparsemixer_jax.moe",
    "expert_ffn": "sparsemixer_jax.moe",
    "fold_omega": "sparsemixer_jax.moe",
    "make_mesh": "sparsemixer_jax.parallel.sharding",
    "shard_state": "sparsemixer_jax.parallel.sharding",
}

__all__ = [
    "ROUTERS",
    "Encoded",
    "KVCache",
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


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
name_missing_extras()  # a missing optional dependency's ImportError names its extra
