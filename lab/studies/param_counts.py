"""Parameter counts of Transformer models, dense and with MoE layers: total, embedding, experts,
router and the parameters one token uses.

Models are built abstractly with ``nnx.eval_shape``: nothing is allocated. "Active" counts the
parameters one token uses (one expert per MoE layer); the dense model's are all active.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from sparsemixer_jax.models.encoder_decoder import Transformer
from sparsemixer_jax.moe import MoEFeedForward
from sparsemixer_jax.tasks import build_task

EXPERTS = (0, 2, 4, 8, 16)
# Stacked per-expert parameters of an MoE layer (leading axis N); the router and omega are shared.
_EXPERT_PARAMS = ("wi", "bi", "wo", "bo")


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def count(num_experts: int, vocab_size: int, config=None) -> dict[str, int]:
    """Parameter counts of the model of ``config`` (default: ``configs/wmt.py``,
    Transformer-base) with ``num_experts`` (0 = dense).

    Returns ``total``, ``embedding`` (the shared, tied table), ``experts`` (all expert FFN
    parameters), ``router`` (router and omega) and ``active`` (per-token: total minus the
    ``N - 1`` experts a token does not use in each MoE layer).
    """
    if config is None:
        from configs.wmt import get_config

        config = get_config()
    config.model.num_experts = num_experts
    task = build_task(config)
    model = nnx.eval_shape(lambda: Transformer(task.model, task.router, vocab_size,
                                               rngs=nnx.Rngs(0)))
    total = _size(nnx.state(model, nnx.Param))
    experts = router = unused = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoEFeedForward):
            layer_experts = sum(_size(getattr(module, name)) for name in _EXPERT_PARAMS)
            experts += layer_experts
            router += _size(nnx.state(module.router, nnx.Param))
            router += _size(module.omega) if module.omega is not None else 0
            unused += layer_experts * (num_experts - 1) // num_experts
    return {
        "total": total,
        "embedding": _size(nnx.state(model.embed, nnx.Param)),
        "experts": experts,
        "router": router,
        "active": total - unused,
    }

