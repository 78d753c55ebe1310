"""The experiments as tasks of the one training loop (:mod:`sparsemixer_jax.training`).

* :mod:`~sparsemixer_jax.tasks.translation`: the Switch Transformer on a language pair (WMT'14).
* :mod:`~sparsemixer_jax.tasks.pretraining`: ELECTRA-style pretraining of the MoE encoder.
* :mod:`~sparsemixer_jax.tasks.finetuning`: GLUE fine-tuning of a pretrained encoder.
* :mod:`~sparsemixer_jax.tasks.language_model`: decoder-only MoE language models, from scratch
  or fine-tuned from a Hugging Face checkpoint.

Each is registered once, in :data:`TASKS`. A task's ``from_config`` builds the typed section of
every part of its own config (each checks its own fields) and then
:func:`sparsemixer_jax.training.config.validate`'s rules between sections; :func:`run_config` adds
the
loop's sections around it, once per run and before anything is read or written. This package,
the command-line helpers and the compile command are where an experiment config is read; past
them, code takes the typed sections.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from sparsemixer_jax.training import config as config_schema

if TYPE_CHECKING:  # the loop's sections need Optax: imported when a run is built
    from sparsemixer_jax.training.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class RegisteredTask:
    """A task of the library: the sections of its config and the config file that shows them,
    and where its code lives, each as ``"module:name"`` (imported when used: the task modules
    import this package, so it cannot import them): ``sections_of`` (the class whose
    ``from_config`` builds its typed sections) and ``trainer`` (``(config, workdir) ->
    results``: the training loop's run; empty for a task with its own loop). Code built on the
    tasks keeps its own map of what it does with each (the compile command's compilers)."""

    sections: tuple[str, ...]
    schema: str
    sections_of: str
    trainer: str = ""


TASKS = {
    "translation": RegisteredTask(
        ("data", "model", "router", "optim", "decode", "runtime", "mesh"), "configs/wmt.py",
        "sparsemixer_jax.tasks.translation:TranslationTask",
        "sparsemixer_jax.tasks.translation:train_and_evaluate"),
    "pretraining": RegisteredTask(
        ("data", "model", "generator", "router", "optim", "runtime", "mesh"),
        "configs/electra.py", "sparsemixer_jax.tasks.pretraining:PretrainingTask",
        "sparsemixer_jax.tasks.pretraining:pretrain"),
    # One section of fine-tuning settings, checked by themselves; experiments.glue runs its grid.
    "finetuning": RegisteredTask((), "configs/glue.py",
                                 "sparsemixer_jax.tasks.finetuning:FinetuningConfig"),
    "lm": RegisteredTask(
        ("data", "model", "router", "optim", "runtime", "mesh", "sample"),
        "configs/lm_quickstart.py", "sparsemixer_jax.tasks.language_model:LMTask",
        "sparsemixer_jax.tasks.language_model:train_lm"),
}


def load(name: str) -> Any:
    """The object a ``"module:name"`` of :data:`TASKS` names (its module imported)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def check_sections(config: Any) -> RegisteredTask:
    """``config``'s registered task, after checking that it is known and that the config has
    every section of that task (so the sections' typed values can be built); ValueError
    otherwise."""
    task = config_schema.task_of(config)
    if task not in TASKS:
        raise ValueError(f"config.task={task!r}; choose one of {tuple(TASKS)}")
    registered = TASKS[task]
    missing = [s for s in registered.sections if s not in config]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)} section "
                         f"(schema: {registered.schema})")
    return registered


def build_task(config: Any) -> Any:
    """The task of ``config`` built by its ``from_config`` (every section of its own, each
    checked, and the rules between sections): ValueError naming the first bad field."""
    return load(check_sections(config).sections_of).from_config(config)


def run_config(config: Any, task: Any = None) -> RunConfig:
    """The run of a trained task's ``config``: its task (:func:`build_task`, unless ``task``
    built from the same config is given) and the loop's sections (the seed, steps and intervals,
    the optimiser, mesh and runtime), each built once and checked."""
    from sparsemixer_jax.training.run_config import RunConfig

    return RunConfig.from_config(config, build_task(config) if task is None else task)


def check_config(config: Any) -> Any:
    """Builds every typed section of ``config``'s task, each checking its own fields, and checks
    the rules between them (:func:`sparsemixer_jax.training.config.validate`): ValueError naming
    the first
    field that makes no sense. Returns the :class:`~sparsemixer_jax.training.run_config.RunConfig`
    of a task the loop trains, the typed sections of another (GLUE fine-tuning's settings)."""
    if not check_sections(config).trainer:
        return build_task(config)
    return run_config(config)


def train_task(config: Any, workdir: str) -> dict[str, Any]:
    """Trains ``config``'s task in ``workdir`` (resuming) with its registered trainer
    (:data:`TASKS`); returns the run's ``results.json``. ValueError for a task the loop does
    not train (GLUE fine-tuning runs its own grid: ``experiments.glue``)."""
    trainer = check_sections(config).trainer
    if not trainer:
        trained = ", ".join(name for name, task in TASKS.items() if task.trainer)
        raise ValueError(f"config.task={config_schema.task_of(config)!r} is not trained by the "
                         f"loop; tasks: {trained}")
    return load(trainer)(config, workdir)
