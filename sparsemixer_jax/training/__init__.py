"""One training loop for every task, and the pieces it is made of.

* :mod:`~sparsemixer_jax.training.loop`: :func:`train`, the :class:`Task` interface and
  :func:`build_steps` (a task's model with its compiled steps).
* :mod:`~sparsemixer_jax.training.run_config`: :class:`RunConfig`, a run's typed sections.
* :mod:`~sparsemixer_jax.training.state`: :class:`TrainState` (step, parameters, layer state,
  optimizer state) and :func:`restore_checkpoint`, the one way a run's checkpoint is read back.
* :mod:`~sparsemixer_jax.training.steps`: the compiled gradient, update and evaluation steps.
* :mod:`~sparsemixer_jax.training.optim`: AdamW and the learning-rate schedules.
* :mod:`~sparsemixer_jax.training.resume`: config checks on resumption, resuming the newest
  intact checkpoint.
* :mod:`~sparsemixer_jax.training.logs`: ``metrics.jsonl``, TensorBoard, the progress line.
* :mod:`~sparsemixer_jax.training.hosts`: several processes, batches as global arrays.
"""

from sparsemixer_jax.training.loop import (
    Run,
    Task,
    TaskData,
    TrainingDiverged,
    build_model,
    build_steps,
    train,
)
from sparsemixer_jax.training.resume import ResumeError
from sparsemixer_jax.training.run_config import RunConfig
from sparsemixer_jax.training.state import Restored, TrainState, restore_checkpoint

__all__ = ["Restored", "ResumeError", "Run", "RunConfig", "Task", "TaskData", "TrainState",
           "TrainingDiverged", "build_model", "build_steps", "restore_checkpoint", "train"]
