"""Beam-search decoding speed: sentences per second, per model and batch shape."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.harness import load_average, stats, time_interleaved
from lab.benchmarks.training_step import model_config

# Decoding shapes: sentences per batch x padded source length. Multi30k's test_2016_flickr has
# 1,000 sentences of about 12-16 subword tokens (at most ~40); WMT newstest2014 has 3,003
# sentences of about 30-35 (long tail past 100). Buckets of 32 and 64 cover most of each.
DECODE_SHAPES = {"multi30k": (128, 32), "newstest": (64, 64)}


def bench_decode(sizes, experts, dtype, warmup, repeats, beam_size=4, max_extra_len=50,
                 shapes=None) -> dict[str, Any]:
    """Beam search (``decode.beam_search_model``) in sentences per second, per model and shape.

    Compile time (first call minus a timed call) is reported apart. The model is untrained, so
    it rarely emits EOS and every search runs to its length limit (source + ``max_extra_len``):
    an upper bound on a trained model's time per sentence."""
    import jax
    import numpy as np

    from sparsemixer_jax.models import decode
    from sparsemixer_jax.tasks import run_config

    shapes = shapes or DECODE_SHAPES
    out: dict[str, Any] = {"beam_size": beam_size, "max_extra_len": max_extra_len}
    for n in [0, *experts]:
        config = model_config(sizes, n, "sparsemixer", dtype)
        run = run_config(config)
        model = run.task.build_model(run, sizes["vocab"], None)
        name = "dense" if n == 0 else f"n{n}"
        for shape_name, (rows, length) in shapes.items():
            rng = np.random.default_rng(0)
            inputs = rng.integers(3, sizes["vocab"], (rows, length), dtype=np.int32)
            inputs[:, -1] = 1  # EOS

            def search(inputs=inputs, model=model):
                return decode.beam_search_model(model, inputs, eos_id=1, beam_size=beam_size,
                                                max_extra_len=max_extra_len)[0]

            start = time.perf_counter()
            jax.block_until_ready(search())
            first = time.perf_counter() - start
            times = time_interleaved({"search": search}, max(warmup - 1, 0), repeats)["search"]
            st = stats(times)
            out[f"{name}/{shape_name}"] = {
                "num_experts": n, "sentences": rows, "source_len": length,
                "search_s": st, "sentences_per_s": rows / st["median"],
                "compile_s": max(first - st["median"], 0.0), "load_average": load_average()}
            print(f"decode {name} {shape_name} ({rows} x {length}, beam {beam_size}): "
                  f"{rows / st['median']:.1f} sentences/s ({st['median']*1e3:.0f} ms per batch), "
                  f"compile {out[f'{name}/{shape_name}']['compile_s']:.1f} s", flush=True)
    return out


def parse_shapes(specs: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``{name: (rows, length)}`` of ``NAME=ROWSxLEN`` items (``--decode-shapes``)."""
    shapes = {}
    for item in specs:
        name, _, dims = item.partition("=")
        rows, _, length = dims.partition("x")
        shapes[name] = (int(rows), int(length))
    return shapes
