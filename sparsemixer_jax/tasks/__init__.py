"""The experiments as tasks of the one training loop (:mod:`sparsemixer_jax.training`).

* :mod:`~sparsemixer_jax.tasks.translation`: the Switch Transformer on a language pair (WMT'14).
* :mod:`~sparsemixer_jax.tasks.pretraining`: ELECTRA-style pretraining of the MoE encoder.
* :mod:`~sparsemixer_jax.tasks.finetuning`: GLUE fine-tuning of a pretrained encoder.
* :mod:`~sparsemixer_jax.tasks.language_model`: decoder-only MoE language models, from scratch
  or fine-tuned from a Hugging Face checkpoint.

A task's ``from_config`` builds the typed section of every part of its own config (each checks
its own fields) and then :func:`sparsemixer_jax.config.validate`'s rules between sections;
:func:`run_config` adds the loop's sections around it, once per run and before anything is read
or written. This package, the command-line helpers and the compile command are where an
experiment config is read; past them, code takes the typed sections.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sparsemixer_jax import config as config_schema

if TYPE_CHECKING:  # the loop's sections need Optax: imported when a run is built
    from sparsemixer_jax.training.run_config import RunConfig

#: The function that trains each task of the one loop, as ``(module, name)``: imported only when
#: called, so naming a task does not import its data pipeline.
TRAINERS = {
    "translation": ("sparsemixer_jax.tasks.translation", "train_and_evaluate"),
    "pretraining": ("sparsemixer_jax.tasks.pretraining", "pretrain"),
    "lm": ("sparsemixer_jax.tasks.language_model", "train_lm"),
}

def build_task(config: Any) -> Any:
    """The task of ``config`` built by its ``from_config`` (every section of its own, each
    checked, and the rules between sections): ValueError naming the first bad field."""
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


def run_config(config: Any, task: Any = None) -> RunConfig:
    """The run of a trained task's ``config``: its task (:func:`build_task`, unless ``task``
    built from the same config is given) and the loop's sections (the seed, steps and intervals,
    the optimiser, mesh and runtime), each built once and checked."""
    from sparsemixer_jax.training.run_config import RunConfig

    return RunConfig.from_config(config, build_task(config) if task is None else task)


def check_config(config: Any) -> Any:
    """Builds every typed section of ``config``'s task, each checking its own fields, and checks
    the rules between them (:func:`sparsemixer_jax.config.validate`): ValueError naming the first
    field that makes no sense. Returns the :class:`~sparsemixer_jax.training.run_config.RunConfig`
    of a trained task, the fine-tuning settings of GLUE fine-tuning."""
    if config_schema.task_of(config) == "finetuning":
        return build_task(config)
    return run_config(config)


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
