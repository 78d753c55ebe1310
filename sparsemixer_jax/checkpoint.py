"""Checkpoints of a training run with orbax: the last one and the best by validation loss.

Layout under ``{workdir}/checkpoints/``: ``last/<step>/`` and ``best/<step>/``, each an orbax
checkpoint with two items: ``state`` (params and optimizer state, a pytree of arrays saved from
every host) and ``meta`` (JSON: step, data position, best validation loss so far). Orbax writes
to a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint intact and the partial one is ignored.

``best`` keeps two steps: a run killed after saving a new best but before the ``last`` checkpoint
of that step resumes from a ``last`` whose meta names the previous best, which must still exist.
Best checkpoints newer than the step a run resumes from are discarded
(:meth:`RunCheckpoints.discard_best_after`): the resumed run recomputes them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def has_checkpoint(workdir: str) -> bool:
    """Whether ``workdir`` holds a complete ``last`` checkpoint (without opening orbax)."""
    last = os.path.join(os.path.abspath(workdir), "checkpoints", "last")
    return os.path.isdir(last) and any(name.isdigit() for name in os.listdir(last))


class RunCheckpoints:
    """The ``last`` and ``best`` checkpoint managers of one workdir."""

    def __init__(self, workdir: str):
        root = os.path.join(os.path.abspath(workdir), "checkpoints")
        self.last = ocp.CheckpointManager(
            os.path.join(root, "last"), options=ocp.CheckpointManagerOptions(max_to_keep=1)
        )
        self.best = ocp.CheckpointManager(
            os.path.join(root, "best"), options=ocp.CheckpointManagerOptions(max_to_keep=2)
        )

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

    def discard_best_after(self, step: int) -> None:
        """Deletes best checkpoints of steps after ``step`` (called on every process)."""
        for later in self.best.all_steps():
            if later > step:
                self.best.delete(later)

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
