"""A program for ``tests/test_multiprocess.py``, run as every process of a multi-process JAX job:
loads a Hugging Face checkpoint onto a mesh spanning the processes, writes its logits and
exports it.

    python -m tests.hf_on_processes CHECKPOINT OUT

Each process joins the others (:func:`sparsemixer_jax.training.cli.initialize_distributed`), loads
``CHECKPOINT`` onto a ``data=1 x fsdp=2 x expert=2`` mesh (the fsdp axis across the processes:
no process holds a whole tensor), runs the model on the input ids of the checkpoint's
``reference.npz``, and calls ``hf.save_pretrained`` into ``OUT/<its process index>``. Then it
places the model again by other rules (:data:`WIDTH_WHOLE`: the shards move between the
processes' devices) and runs it again. Process 0 writes both logits, gathered from every
process, to ``OUT/logits.npy`` and ``OUT/logits_width_whole.npy``.
"""

from __future__ import annotations

import os
import sys

from sparsemixer_jax.training import cli

MAX_SHARD_BYTES = 40_000  # several safetensors files and an index, as a large model has
WIDTH_WHOLE = {"embed": None}  # rules that no longer split the model width over fsdp


def main(checkpoint: str, out: str) -> None:
    cli.initialize_distributed()
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from sparsemixer_jax import hf
    from sparsemixer_jax.parallel import sharding
    from sparsemixer_jax.parallel.partitioning import Partitioner

    mesh = sharding.make_mesh(1, 2, fsdp=2)
    model, config = hf.load_pretrained(checkpoint, mesh=mesh)
    ids = np.load(os.path.join(checkpoint, "reference.npz"))["input_ids"]
    logits_of = nnx.jit(lambda m, x: m(x))

    def write_logits(name: str) -> None:
        logits = multihost_utils.process_allgather(logits_of(model, ids), tiled=True)
        if jax.process_index() == 0:
            np.save(os.path.join(out, name), np.asarray(logits))

    write_logits("logits.npy")
    hf.save_pretrained(model, config, os.path.join(out, str(jax.process_index())),
                       max_shard_bytes=MAX_SHARD_BYTES)
    sharding.shard_state(model, Partitioner(mesh, WIDTH_WHOLE))
    write_logits("logits_width_whole.npy")


if __name__ == "__main__":
    main(*sys.argv[1:])
