"""Parameter counts of the Transformer-base Switch models (dense and N = 2, 4, 8, 16 experts).

Models are built abstractly with ``nnx.eval_shape``: nothing is allocated. "Active" counts the
parameters one token uses (one expert per MoE layer); the dense model's are all active.

    python -m experiments.param_counts [--vocab 32000]
"""

from __future__ import annotations

import argparse
import math

import jax
from flax import nnx

from configs.wmt import get_config
from sparsemixer_jax.models import Transformer
from sparsemixer_jax.moe import MoEFeedForward

EXPERTS = (0, 2, 4, 8, 16)
# Stacked per-expert parameters of an MoE layer (leading axis N); the router and omega are shared.
_EXPERT_PARAMS = ("wi", "bi", "wo", "bo")


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def count(num_experts: int, vocab_size: int, config=None) -> dict[str, int]:
    """Parameter counts of the Transformer-base model with ``num_experts`` (0 = dense).

    Returns ``total``, ``embedding`` (the shared, tied table), ``experts`` (all expert FFN
    parameters), ``router`` (router and omega) and ``active`` (per-token: total minus the
    ``N - 1`` experts a token does not use in each MoE layer).
    """
    config = config or get_config()
    config.model.num_experts = num_experts
    model = nnx.eval_shape(lambda: Transformer(config, vocab_size, rngs=nnx.Rngs(0)))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    base = get_config()
    m = base.model
    print(
        f"Transformer-base: {m.encoder_layers}+{m.decoder_layers} layers, emb {m.emb_dim}, "
        f"mlp {m.mlp_dim}, heads {m.num_heads}, MoE every {m.moe_every} layers, "
        f"vocab {args.vocab} (tied), router {base.router.name}"
    )
    header = f"{'experts':>8} {'total':>13} {'active/token':>13} {'experts':>13} {'router':>9}"
    print(header)
    print("-" * len(header))
    for n in EXPERTS:
        c = count(n, args.vocab, get_config())
        name = "dense" if n == 0 else str(n)
        print(
            f"{name:>8} {c['total']:>13,} {c['active']:>13,} {c['experts']:>13,} {c['router']:>9,}"
        )


if __name__ == "__main__":
    main()
