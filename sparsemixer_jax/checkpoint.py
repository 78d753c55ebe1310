"""Checkpoints of a training run with orbax: the last one and the best by validation loss.

Layout under ``{workdir}/checkpoints/``: ``last/<step>/`` and ``best/<step>/``, each an orbax
checkpoint with two items: ``state`` (params and optimizer state, a pytree of arrays saved from
every host) and ``meta`` (JSON: step, data position, best validation loss so far). Orbax writes
to a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint intact and the partial one is ignored.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
    """The ``last`` and ``best`` checkpoint managers of one workdir."""

    def __init__(self, workdir: str):
        root = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
        self.last = ocp.CheckpointManager(os.path.join(root, "last"), options=options)
        self.best = ocp.CheckpointManager(os.path.join(root, "best"), options=options)

    @staticmethod
    def _save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def save_last(self, step: int, state: Any, meta: dict) -> None:
        self._save(self.last, step, state, meta)

    def save_best(self, step: int, state: Any, meta: dict) -> None:
        self._save(self.best, step, state, meta)

    @staticmethod
    def restore(manager: ocp.CheckpointManager, template: Any, step: int | None = None):
        """``(state, meta)`` of ``step`` (default: latest), placed like ``template``; or None."""
        step = manager.latest_step() if step is None else step
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        """Blocks until asynchronous saves are on disk."""
        self.last.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.last.close()
        self.best.close()
