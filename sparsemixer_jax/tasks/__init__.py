"""The experiments as tasks of the one training loop (:mod:`sparsemixer_jax.training`).

* :mod:`~sparsemixer_jax.tasks.translation`: the Switch Transformer on a language pair (WMT'14).
* :mod:`~sparsemixer_jax.tasks.pretraining`: ELECTRA-style pretraining of the MoE encoder.
* :mod:`~sparsemixer_jax.tasks.finetuning`: GLUE fine-tuning of a pretrained encoder.
* :mod:`~sparsemixer_jax.tasks.language_model`: decoder-only MoE language models, from scratch
  or fine-tuned from a Hugging Face checkpoint.

A task's ``from_config`` builds the typed section of every part of its config (each checks its
own fields) and then :func:`sparsemixer_jax.config.validate`'s rules between sections, once per
run and before anything is read or written; :func:`check_config` does it for any task.
"""

from __future__ import annotations

import importlib
from typing import Any

from sparsemixer_jax import config as config_schema
from sparsemixer_jax.runtime import RuntimeConfig
from sparsemixer_jax.section import cast, check_positive
from sparsemixer_jax.sharding import MeshConfig

#: The function that trains each task of the one loop, as ``(module, name)``: imported only when
#: called, so naming a task does not import its data pipeline.
TRAINERS = {
    "translation": ("sparsemixer_jax.tasks.translation", "train_and_evaluate"),
    "pretraining": ("sparsemixer_jax.tasks.pretraining", "pretrain"),
    "lm": ("sparsemixer_jax.tasks.language_model", "train_lm"),
}

LOOP_FIELDS = ("train_steps", "eval_every", "checkpoint_every", "log_every")


def check_loop_sections(config: Any) -> None:
    """Checks what every trained task shares: the loop's intervals and the routing
    diagnostics' collapse rule (top-level fields), the optimiser, the runtime and the mesh."""
    from sparsemixer_jax.training.optim import OptimSettings  # needs Optax
    from sparsemixer_jax.training.routing_watch import CollapseRule

    check_positive("config.", **{name: cast(int, config[name], f"config.{name}")
                                 for name in LOOP_FIELDS})
    cast(int, config.seed, "config.seed")
    OptimSettings.from_config(config.optim, router=config.router)
    CollapseRule.from_config(config)
    RuntimeConfig.from_config(config.runtime)
    MeshConfig.from_config(config.mesh)


def check_config(config: Any) -> Any:
    """Builds every typed section of ``config``'s task, each checking its own fields, then
    checks the rules between them (:func:`sparsemixer_jax.config.validate`); returns the task
    (its sections). ValueError naming the first field that makes no sense."""
    task = config_schema.task_of(config)
    if task == "translation":
        from sparsemixer_jax.tasks.translation import TranslationTask

        return TranslationTask.from_config(config)
    if task == "pretraining":
        from sparsemixer_jax.tasks.pretraining import PretrainingTask

        return PretrainingTask.from_config(config)
    if task == "finetuning":
        from sparsemixer_jax.tasks.finetuning import FinetuningConfig

        return FinetuningConfig.from_config(config)
    if task == "lm":
        from sparsemixer_jax.tasks.language_model import LMTask

        return LMTask.from_config(config)
    config_schema.validate(config)  # names the unknown task
    return None


def train_task(config: Any, workdir: str) -> dict[str, Any]:
    """Trains ``config``'s task in ``workdir`` (resuming) with its own training function
    (:data:`TRAINERS`); returns the run's ``results.json``. ValueError for a task the loop does
    not train (GLUE fine-tuning runs its own grid: ``experiments.glue``)."""
    task = config_schema.task_of(config)
    if task not in TRAINERS:
        raise ValueError(f"config.task={task!r} is not trained by the loop; tasks: "
                         f"{', '.join(TRAINERS)}")
    module, name = TRAINERS[task]
    return getattr(importlib.import_module(module), name)(config, workdir)
