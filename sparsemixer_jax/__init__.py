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
