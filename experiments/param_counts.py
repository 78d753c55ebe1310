"""Parameter counts of the Transformer-base Switch models (dense and N = 2, 4, 8, 16 experts).

Models are built abstractly with ``nnx.eval_shape``: nothing is allocated. "Active" counts the
parameters one token uses (one expert per MoE layer); the dense model's are all active.

    python -m experiments.param_counts [--vocab 32000]
"""

from __future__ import annotations

import argparse

from configs.wmt import get_config
from lab.studies.param_counts import EXPERTS, count


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
