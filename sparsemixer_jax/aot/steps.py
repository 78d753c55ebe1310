"""Any task's training programs, compiled for a target: the part of the compile command that
does not depend on the task.

A task's aot module builds its model abstractly on the target's mesh, its
:class:`~sparsemixer_jax.training.steps.Steps` (with the mesh's
:class:`~sparsemixer_jax.parallel.partitioning.Partitioner`) and one abstract batch;
:func:`train_state`
places the train state as the training loop does, and :func:`compile_training` compiles the
programs the loop runs for it (the fused step, or ``accumulate`` and ``update``), each reported
per device with the train state's parameters and optimizer state counted apart.
"""

from __future__ import annotations

import time
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.aot.analysis import ProgramReport, analyse
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.parallel.partitioning import Partitioner
from sparsemixer_jax.training.state import TrainState
from sparsemixer_jax.training.steps import Steps


def placed(tree: Any, shardings: Any) -> Any:
    """``tree``'s shapes and dtypes as ``jax.ShapeDtypeStruct`` placed by ``shardings``."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


def train_state(steps: Steps, mesh: Mesh, partitioner: Partitioner) -> tuple[TrainState, Any]:
    """``(train state, rest)`` of ``steps`` (built on an abstract model) as
    ``jax.ShapeDtypeStruct`` placed as the training loop places them on ``mesh``: parameters,
    layer state and optimizer state by ``partitioner``'s rules, the step and the model's RNG
    streams replicated."""
    params = placed(steps.params, partitioner.shardings(steps.params))
    layer_state = placed(steps.layer_state, partitioner.shardings(steps.layer_state))
    rest = placed(steps.rest, sharding.state_shardings(steps.rest, partitioner))
    state = jax.eval_shape(steps.new_state, params, layer_state)
    state = TrainState(step=placed(state.step, NamedSharding(mesh, P())), params=params,
                       layer_state=layer_state,
                       opt_state=placed(state.opt_state, partitioner.shardings(state.opt_state)))
    return state, rest


def compile_program(name: str, fn: Any, args: tuple, donate: tuple[int, ...] = (),
                    state: TrainState | None = None) -> ProgramReport:
    """``fn`` lowered with the abstract ``args``, compiled, and analysed (``state``: the train
    state among the arguments, whose parameters and optimizer state the report counts)."""
    started = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return analyse(name, compiled, time.perf_counter() - started, state)


def compile_training(steps: Steps, state: TrainState, rest: Any, batch: dict[str, Any],
                     micro_batches: int, batch_label: str) -> list[ProgramReport]:
    """The training programs the loop runs for ``batch`` (abstract, placed as the loop places a
    micro-batch): one fused step, or for several micro-batches ``accumulate`` and ``update``,
    and ``cast`` where the model consumes parameters through copies in its compute dtype
    (:meth:`~sparsemixer_jax.training.steps.Steps.compute_copies`, made once per update)."""
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=jax.tree.leaves(state.step)[0].sharding)
    if micro_batches == 1:
        def train_step(state, rest, batch, key):
            return steps.with_rest(rest).train_step(state, [batch], key)

        return [compile_program(f"train step, batch {batch_label}", train_step,
                                (state, rest, batch, key), donate=(0,), state=state)]

    def accumulate(state, rest, acc, batch, key, copies):
        return steps.with_rest(rest).accumulate(state, acc, batch, key, copies)

    def cast(state, rest, batch):
        return steps.with_rest(rest).compute_copies(state, batch)

    acc = jax.eval_shape(lambda s, r, b: steps.with_rest(r).zeros(s, b), state, rest, batch)
    copies = jax.eval_shape(cast, state, rest, batch)
    copies = jax.tree.map(  # placed as their parameters
        lambda c, p: None if c is None else jax.ShapeDtypeStruct(c.shape, c.dtype,
                                                                 sharding=p.sharding),
        copies, state.params, is_leaf=lambda x: x is None)
    reports = [compile_program("cast (once per update)", cast, (state, rest, batch),
                               state=state)] if jax.tree.leaves(copies) else []
    return [
        *reports,
        compile_program(f"accumulate (one of {micro_batches} micro-batches), batch "
                        f"{batch_label}", accumulate, (state, rest, acc, batch, key, copies),
                        donate=(2,), state=state),
        compile_program("update", steps.update, (state, acc, state.layer_state), donate=(0,),
                        state=state),
    ]
