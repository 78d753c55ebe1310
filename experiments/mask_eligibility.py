"""How many experts SparseMixer's mask leaves eligible at initialisation, ours vs the reference's.

    python -m experiments.mask_eligibility

The router sees a post-LayerNorm activation (zero mean, unit variance over its ``d`` features,
as in both our model and the reference's fairseq post-norm layers). Two router inits:

* ours: ``nnx.Linear`` defaults, kernel ``lecun_normal`` (std ``1/sqrt(d)``), zero bias;
* the reference's: PyTorch ``nn.Linear`` defaults (what ``gating_network`` in
  microsoft/SparseMixer's ``transformer_switch_layer.py`` gets), kernel and bias both
  ``U(-1/sqrt(d), 1/sqrt(d))``.

For each, and for the logits shifted by a constant ``c`` (a common shift, which the softmax
ignores), it prints the share of tokens with a single eligible expert and the mean number
eligible under the reference mask, for ``jitter_eps`` 0.1 and 0.5. Random Gaussian activations
stand in for real ones, so this describes the start of training only; the training logs
(``eligible_fraction`` in ``metrics.jsonl``) describe the rest.
"""

from __future__ import annotations

import jax

from lab.studies.mask_eligibility import eligibility, router_logits


def main() -> None:
    tokens, d = 8192, 256
    print(f"{tokens} tokens, d = {d}, reference mask; cells: share with 1 eligible / mean "
          "eligible; shift in units of the logits' std")
    print("| N | init | logit std | shift | eps 0.1 | eps 0.5 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in (4, 8):
        for init in ("ours", "reference"):
            for seed in range(3):  # three draws of the router: the init varies
                z = router_logits(jax.random.key(seed), tokens, d, n, init)
                std = float(z.std())
                for shift in ((0.0, 1.0, 3.0) if seed == 0 else (0.0,)):
                    cells = [eligibility(z + shift * std, eps) for eps in (0.1, 0.5)]
                    text = " | ".join(f"{one:.2f} / {mean:.2f}" for one, mean in cells)
                    print(f"| {n} | {init} (router {seed}) | {std:.2f} | {shift:+.0f} | {text} |")


if __name__ == "__main__":
    main()
