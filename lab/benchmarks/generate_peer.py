"""Greedy generation on the CPU, side by side with transformers' ``generate`` in PyTorch: new
tokens per second of each, in interleaved rounds, and their ratio.

One tiny random Mixtral (:func:`write_model`: :data:`GENERATE_PEER_SIZES`, the model sizes of
:data:`lab.benchmarks.cpu_peer.CPU_PEER_SIZES`) is saved with ``hf.save_pretrained`` with its
prompts (``prompts.json``: ``batch`` rows of ``prompt`` random ids); each arm loads that
directory: ours with ``hf.load_pretrained`` and times
:func:`sparsemixer_jax.models.lm_generate.generate` (:func:`serve_ours`), the peer with
``AutoModelForCausalLM.from_pretrained`` and times ``model.generate``
(``scripts/peer_generate.py``, under a Python with torch and transformers). A step is one call:
``new_tokens`` greedy tokens for every row, with no end token, so every call makes
``batch * new_tokens`` tokens. The workers speak :mod:`lab.benchmarks.cpu_peer`'s protocol and
its driver times them in ABBA rounds; each reply also carries the tokens generated, and
:func:`agreement` compares every arm's to the reference's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from lab.benchmarks.cpu_peer import CPU_PEER_SIZES, Arm, pinned

MODEL_SIZES = ("emb", "mlp", "heads", "kv_heads", "layers", "vocab", "experts", "top_k")
GENERATE_PEER_SIZES = {**{k: CPU_PEER_SIZES[k] for k in MODEL_SIZES},
                       "batch": 4, "prompt": 32, "new_tokens": 64}
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "peer_generate.py")


def mixtral_config(sizes: dict[str, int]) -> dict[str, Any]:
    """The ``config.json`` of the benchmark's Mixtral: top-``top_k`` softmax routing
    renormalised, no jitter, no sliding window, float32."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "vocab_size": sizes["vocab"], "hidden_size": sizes["emb"],
            "intermediate_size": sizes["mlp"], "num_hidden_layers": sizes["layers"],
            "num_attention_heads": sizes["heads"], "num_key_value_heads": sizes["kv_heads"],
            "head_dim": sizes["emb"] // sizes["heads"], "num_local_experts": sizes["experts"],
            "num_experts_per_tok": sizes["top_k"], "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "dtype": "float32"}


def write_model(sizes: dict[str, int], out_dir: str, seed: int = 0) -> None:
    """The benchmark's random Mixtral (:func:`mixtral_config`) and ``prompts.json`` in
    ``out_dir``: ``batch`` rows of ``prompt`` ids drawn from ``[2, vocab)``."""
    import numpy as np
    from flax import nnx

    from sparsemixer_jax import hf
    from sparsemixer_jax.models.causal_lm import CausalLM

    lm = hf.from_hf(mixtral_config(sizes))
    hf.save_pretrained(CausalLM(lm, rngs=nnx.Rngs(params=seed, router=seed + 1)), lm, out_dir)
    prompts = np.random.default_rng(seed).integers(2, sizes["vocab"],
                                                   (sizes["batch"], sizes["prompt"]))
    with open(os.path.join(out_dir, "prompts.json"), "w") as f:
        json.dump(prompts.tolist(), f)


def ours_arm(name: str, model_dir: str, sizes: dict[str, int], cpus: str = "") -> Arm:
    """Our ``generate`` in this Python."""
    return Arm(name, (*pinned(cpus), sys.executable, "-m", "lab.benchmarks.generate_peer",
                      model_dir, str(sizes["new_tokens"])))


def peer_arm(name: str, python: str, model_dir: str, sizes: dict[str, int], threads: int,
             experts_implementation: str = "", cpus: str = "") -> Arm:
    """transformers' ``generate`` under ``python`` with ``threads`` torch threads
    (``experts_implementation`` "": transformers' default experts kernel)."""
    argv = (*pinned(cpus), python, PEER_SCRIPT, model_dir, str(sizes["new_tokens"]),
            "--threads", str(threads))
    if experts_implementation:
        argv += ("--experts-implementation", experts_implementation)
    return Arm(name, argv, peer=True)


def agreement(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per arm, its last call's tokens against the reference arm's: ``rows_equal`` (rows that
    equal it throughout) and ``first_difference`` (the first new position where any row
    differs, None if none). Random weights leave near ties that float rounding can flip."""
    ref = result["arms"][result["reference"]]["generated"]
    out = {}
    for name, arm in result["arms"].items():
        rows = arm["generated"]
        diffs = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), None)
                 for r, g in zip(ref, rows, strict=True)]
        found = [d for d in diffs if d is not None]
        out[name] = {"rows_equal": diffs.count(None), "rows": len(rows),
                     "first_difference": min(found) if found else None}
    return out


def serve_ours(model_dir: str, new_tokens: int) -> None:
    """The worker of our arm (:mod:`lab.benchmarks.cpu_peer`'s protocol): each step one
    greedy ``generate`` call on the directory's prompts, float32, on the CPU; each reply also
    carries the new tokens of the last call (``generated``, ``[batch][new_tokens]``)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    from flax import nnx

    from sparsemixer_jax import hf
    from sparsemixer_jax.models.lm_generate import generate

    model, config = hf.load_pretrained(model_dir)
    with open(os.path.join(model_dir, "prompts.json")) as f:
        prompts = jnp.asarray(json.load(f), jnp.int32)
    print(json.dumps({"ready": {
        "jax": jax.__version__, "backend": jax.default_backend(),
        "num_params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "dispatch": config.execution.dispatch}}), flush=True)
    out = None
    for line in sys.stdin:
        times, cpu_times = [], []
        for _ in range(json.loads(line)["steps"]):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(generate(model, prompts, new_tokens))
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        generated = [] if out is None else out[:, prompts.shape[1]:].tolist()
        print(json.dumps({"times": times, "cpu_times": cpu_times, "generated": generated}),
              flush=True)


if __name__ == "__main__":
    serve_ours(sys.argv[1], int(sys.argv[2]))
