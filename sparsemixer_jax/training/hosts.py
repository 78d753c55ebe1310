"""What a run on several processes needs: who writes, barriers, batches as global arrays."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.parallel import sharding


def is_main_process() -> bool:
    """Process 0 writes logs, results and the config; every process saves checkpoints."""
    return jax.process_index() == 0


def write_atomically(path: str, text: str) -> None:
    """A reader sees the old file or the new one, never a half-written one."""
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w") as f:
        f.write(text)
    os.replace(tmp_path, path)


def wait_for_all_processes(name: str, timeout_s: int = 4 * 3600) -> None:
    """Barrier across processes, then the first collective while they are in step.

    ``multihost_utils.sync_global_devices`` alone is a collective, and on CPU hosts its first use
    sets up gloo with a 30 s deadline: too short for process 0 training a vocabulary while the
    others wait. The coordination service's barrier waits as long as needed.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordination-service client; no public wrapper yet
    from jax.experimental import multihost_utils

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)
    multihost_utils.sync_global_devices(name)


class BatchPlacer:
    """This host's numpy batch (the fields ``keys``) as arrays split over the mesh's devices."""

    def __init__(self, mesh: jax.sharding.Mesh | None, keys: Sequence[str]):
        self.sharding = None if mesh is None else sharding.batch_sharding(mesh)
        self.keys = tuple(keys)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.sharding is None:
            return {k: jnp.asarray(batch[k]) for k in self.keys}
        return {k: jax.make_array_from_process_local_data(self.sharding, batch[k])
                for k in self.keys}
