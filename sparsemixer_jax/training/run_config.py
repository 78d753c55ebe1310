"""A run as the training loop reads it: the task, the loop's seed, steps and intervals, and the
sections every trained task shares (optimiser, mesh, runtime, the routing diagnostics' rule).

:class:`RunConfig` is built once, by the task's door (:func:`sparsemixer_jax.tasks.run_config`),
before anything is read or written; the loop, resumption and the compile programs read its typed
attributes only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsemixer_jax.parallel.sharding import MeshConfig
from sparsemixer_jax.section import check_positive, get_field, has_field, read_fields
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.optim import OptimSettings
from sparsemixer_jax.training.routing_watch import CollapseRule
from sparsemixer_jax.training.runtime import RuntimeConfig

#: The loop's intervals, in steps (each > 0); a resumed run may change any of them.
LOOP_INTERVALS = ("train_steps", "eval_every", "checkpoint_every", "log_every")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The typed sections of a trained run.

    ``task``: the task (:class:`sparsemixer_jax.training.Task`), holding its own sections.
    ``train_steps`` updates; validation every ``eval_every``, the ``last`` checkpoint every
    ``checkpoint_every`` and the MoE layers' metrics every ``log_every`` steps. ``seed`` seeds the
    model's initialisation (``seed``, ``+1``, ``+2``), the steps' keys (``+3``) and evaluation
    (``+5``). ``record``: the config as JSON text, written to ``{workdir}/config.json`` and
    ``results.json`` and compared with a workdir's saved one on resumption.
    """

    task: Any
    train_steps: int
    eval_every: int
    checkpoint_every: int
    log_every: int
    seed: int
    collapse: CollapseRule = dataclasses.field(default_factory=CollapseRule)
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    record: str = "{}"

    @classmethod
    def from_config(cls, config: Any, task: Any, where: str = "config.") -> RunConfig:
        """The loop's fields of an experiment config and its ``optim``, ``mesh`` and
        ``runtime`` sections, each checked (one-line ValueErrors naming the field), around
        ``task`` (built from the same config by its ``from_config``)."""
        fields = read_fields(cls, config, where,
                             skip=("task", "collapse", "optim", "mesh", "runtime", "record"))
        check_positive(where, **{name: fields[name] for name in LOOP_INTERVALS})
        router = get_field(config, "router") if has_field(config, "router") else None
        return cls(task=task, **fields,
                   optim=OptimSettings.from_config(get_field(config, "optim"), router=router),
                   collapse=CollapseRule.from_config(config, where),
                   runtime=RuntimeConfig.from_config(get_field(config, "runtime")),
                   mesh=MeshConfig.from_config(get_field(config, "mesh")),
                   record=config_schema.as_json(config))
