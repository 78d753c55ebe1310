"""The train state, and the one function that finds and restores a run's checkpoint.

:class:`TrainState` is everything an update changes, as one pytree: the step, the parameters,
the layer state and the optimizer state. The compiled steps take it and return it
(:class:`sparsemixer_jax.training.steps.Steps`), the loop carries it, checkpoints hold it as it
is, and :func:`restore_checkpoint` gives it back. Randomness is not part of it: the key of step
``s`` is ``fold_in(key(seed + 3), s)`` (the loop's), a function of the config and the step.

:func:`restore_checkpoint` is how every reader of a workdir gets a checkpoint (resuming a run,
translating with it, fine-tuning from a pretrained run, exporting its parameters), with one
fallback rule: the checkpoints asked for are tried newest step first (``last`` before ``best``
at one step), and the first that passes its manifest and orbax's reading is restored. Each one
that fails is named with its reason on one warning line and the next older one is tried, so a
corrupt newest checkpoint costs one checkpoint interval, never the run.

Checkpoints written before the train state existed hold a dict of ``params``, ``opt_state`` and,
for models with layer state, ``batch_stats``, with the step in their meta only. They are read as
they are and converted here (:func:`_read`), so older workdirs resume, translate and fine-tune
unchanged; the next checkpoint a resumed run saves has the train state's layout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import flax.struct
import jax
import numpy as np

from sparsemixer_jax.training import checkpoint
from sparsemixer_jax.training.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


@flax.struct.dataclass
class TrainState:
    """What an update changes, as one pytree (every field is a pytree of arrays).

    ``step``: int32 ``[]``, the updates taken so far (the step a checkpoint of it is saved as).
    ``params``: the model's parameters (``nnx.Param``), a nested dict of arrays.
    ``layer_state``: the model's state that training forwards update and the optimizer does not
    (``nnx.BatchStat`` variables: Default MoE's running means of each expert's output, ``[D]``
    per expert of each MoE layer); ``{}`` for every other model.
    ``opt_state``: the optimizer's state of ``params`` (optax).
    """

    step: Any
    params: Any
    layer_state: Any
    opt_state: Any


FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
# The items of a checkpoint written before the train state (commit aba25a8 and earlier): its
# ``batch_stats`` is today's ``layer_state``, saved only for models that have one.
LEGACY_ITEMS = ("params", "opt_state")
LEGACY_LAYER_STATE = "batch_stats"


@dataclasses.dataclass
class Restored:
    """A restored checkpoint: its ``step``, ``state`` (a :class:`TrainState` placed like the
    template), ``meta`` (JSON: data position, best validation loss, ...), ``kind`` (``"last"`` or
    ``"best"``), its ``directory``, and the one-line reasons of the newer ones ``skipped``."""

    step: int
    state: TrainState
    meta: dict
    kind: str
    directory: str
    skipped: tuple[str, ...] = ()


def restore_checkpoint(workdir: str, template: TrainState, kind: str | None = None, *,
                       set_aside: bool = False) -> Restored | None:
    """The newest intact checkpoint of ``workdir``, restored into ``template``'s shapes and
    placement; None if it holds no checkpoint of ``kind``.

    Args:
      workdir: the run's directory (checkpoints under ``{workdir}/checkpoints/{last,best}/``).
      template: a :class:`TrainState` of the run's model, with arrays or
        ``jax.ShapeDtypeStruct`` leaves (:meth:`Steps.abstract_state` restores without
        computing anything first).
      kind: ``"last"`` or ``"best"`` to read that kind only; None for both (resuming: a best
        checkpoint holds the full train state too).
      set_aside: move each unreadable checkpoint to ``checkpoints/unreadable/`` (never deleted),
        out of orbax's sight so its step can be saved again. Only for the run that holds the
        workdir; readers such as translation leave the files where they are.

    The fallback rule: newest step first, ``last`` before ``best`` at one step; a checkpoint
    that fails its manifest or orbax's reading is named on one warning line and the next older
    one is tried. Raises :class:`CheckpointError` (one line, naming each) if checkpoints exist
    but none restores, and if several processes would restore different ones.
    """
    if kind not in (None, *checkpoint.KINDS):
        raise ValueError(f"checkpoint kind must be one of {checkpoint.KINDS} or None, got {kind!r}")
    failures = []
    for step, found in checkpoint.list_checkpoints(workdir, kind):
        step_dir = checkpoint.step_dir(workdir, found, step)
        try:
            state, meta = _read(step_dir, step, template)
        except CheckpointError as e:
            failures.append(str(e))
            logger.warning("unreadable checkpoint, trying an older one: %s", e)
            if set_aside:
                checkpoint.set_aside(workdir, found, step)
            continue
        if failures:
            logger.warning("using the intact checkpoint %s", step_dir)
        checkpoint.check_processes_agree(step, found)
        return Restored(step, state, meta, found, step_dir, tuple(failures))
    checkpoint.check_processes_agree(-1, "none")
    if failures:
        root = checkpoint.checkpoints_root(workdir)
        where = f"; the unreadable ones are in {os.path.join(root, 'unreadable')}" \
            if set_aside else ""
        raise CheckpointError(f"no readable {kind + ' ' if kind else ''}checkpoint in {root} "
                              f"({'; '.join(failures)}){where}")
    return None


def _read(step_dir: str, step: int, template: TrainState) -> tuple[TrainState, dict]:
    """The train state and meta of one checkpoint, either layout; :class:`CheckpointError` (one
    line naming ``step_dir``) for anything that makes it unusable."""
    checkpoint.check_manifest(step_dir)  # first: a missing file is named, not orbax's error
    items = checkpoint.saved_items(step_dir)
    if items == set(FIELDS):
        state, meta = checkpoint.read_checkpoint(step_dir, template, step)
    elif set(LEGACY_ITEMS) <= items <= {*LEGACY_ITEMS, LEGACY_LAYER_STATE}:
        # Saved before the train state: the same arrays under other names, the step in meta.
        # The layer state is expected exactly where the model has one (as it was then saved),
        # so a checkpoint of another model is refused by orbax's tree check, as before.
        legacy = {"params": template.params, "opt_state": template.opt_state}
        if jax.tree.leaves(template.layer_state):
            legacy[LEGACY_LAYER_STATE] = template.layer_state
        saved, meta = checkpoint.read_checkpoint(step_dir, legacy, step)
        state = TrainState(step=_placed_like(template.step, step), params=saved["params"],
                           layer_state=saved.get(LEGACY_LAYER_STATE, template.layer_state),
                           opt_state=saved["opt_state"])
    else:
        raise CheckpointError(
            f"{step_dir}: holds the items {sorted(items)}, neither a train state "
            f"{list(FIELDS)} nor the earlier layout {list(LEGACY_ITEMS)} (+ "
            f"{LEGACY_LAYER_STATE}): not a checkpoint of this project's training loop")
    saved_step = state.step
    if isinstance(saved_step, jax.Array):  # this host's copy: the step is replicated
        saved_step = saved_step.addressable_data(0)
    if int(np.asarray(saved_step)) != step:
        raise CheckpointError(f"{step_dir}: its train state says step {int(saved_step)}")
    return state, meta


def _placed_like(like: Any, step: int) -> jax.Array:
    """``step`` as int32 ``[]``, placed as the template's step is (replicated on a mesh)."""
    value = np.asarray(step, np.int32)
    sharding = getattr(like, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
