"""The routing options ``experiments.bench_routing_options`` times against the plain router:
their config overrides, the model they run in, and the results table and JSON."""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from configs.wmt import get_config
from sparsemixer_jax.tasks import check_config

#: The options timed, each a set of config overrides on top of the plain router.
OPTIONS: dict[str, dict] = {
    "plain": {},
    "bias_balancing": {"router.bias_update_rate": 1e-3},
    "bias_only (no loss)": {"router.bias_update_rate": 1e-3, "router.balance_weight": 0.0},
    "global_batch_loss": {"router.balance_scope": "global_batch"},
    "sequence_loss": {"router.balance_scope": "sequence"},
    "sigmoid": {"router.score": "sigmoid"},
    "groups_1_of_2": {"router.num_groups": 2, "router.top_groups": 1},
    "shared_expert": {"model.num_shared_experts": 1},
}


def bench_config(args: argparse.Namespace, overrides: dict):
    """``configs/wmt.py`` at the command's sizes, routed by Switch top-2, with ``overrides``."""
    config = get_config()
    config.model.update(emb_dim=args.emb, mlp_dim=args.mlp, encoder_layers=args.layers,
                        decoder_layers=args.layers, num_heads=max(1, args.emb // 64),
                        num_experts=args.experts, dispatch="auto")
    config.router.update(name="switch", top_k=2)
    config.data.vocab_size = args.vocab
    config.update_from_flattened_dict(overrides)
    check_config(config)
    return config


def results_table(args: argparse.Namespace, times: dict[str, list[float]]) -> dict:
    """Prints the table of ``times`` (per option, each round's median seconds per step) and
    returns it per option: median and fastest round's ms, their ratios to the plain router's,
    and the per-round ratio range."""
    plain = np.array(times["plain"])
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"emb={args.emb} mlp={args.mlp} layers={args.layers}+{args.layers} "
          f"experts={args.experts} tokens={args.tokens}x{args.micro_batches} micro-batches, "
          f"{args.repeats} rounds x {args.steps} steps")
    print(f"{'option':22s} {'median ms':>10s} {'ratio':>7s} {'fastest ms':>11s} {'ratio':>7s} "
          f"{'per-round ratio range':>22s}")
    results = {}
    for name in args.options:
        t = np.array(times[name])
        ratio = t / plain
        results[name] = {"ms": float(np.median(t) * 1e3),
                         "ratio": float(np.median(t) / np.median(plain)),
                         "fastest_ms": float(t.min() * 1e3),
                         "fastest_ratio": float(t.min() / plain.min()),
                         "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max())}
        r = results[name]
        print(f"{name:22s} {r['ms']:10.1f} {r['ratio']:7.3f} {r['fastest_ms']:11.1f} "
              f"{r['fastest_ratio']:7.3f} {ratio.min():13.3f}..{ratio.max():.3f}")
    return results


def write_json(path: str, settings: dict, results: dict | None, times: dict) -> None:
    """The run's JSON: ``options`` (the table) is ``None`` until every round is done."""
    with open(path, "w") as f:
        json.dump({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                   "settings": settings, "options": results, "rounds_s": times}, f, indent=1)
