"""Starting a run in a workdir: refusing a changed config, resuming the newest intact checkpoint.

Exact resumption: the train state (step, parameters, layer state, optimizer state) and the data
position are checkpointed; the random keys of step ``s`` are derived from ``(seed, s)``; the
learning rate depends on the step only. A run stopped at step ``k`` and resumed to ``2k``
therefore ends with the parameters of an uninterrupted ``2k``-step run.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from sparsemixer_jax.parallel.sharding import MeshConfig
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.checkpoint import CheckpointError, RunCheckpoints, has_checkpoint
from sparsemixer_jax.training.hosts import is_main_process
from sparsemixer_jax.training.logs import flatten
from sparsemixer_jax.training.run_config import RunConfig
from sparsemixer_jax.training.state import Restored, TrainState, restore_checkpoint

logger = logging.getLogger(__name__)

# Config fields (or whole sections) a resumed run may change: schedules of the loop, decoding, and
# settings that change speed or float rounding but not what is trained.
RESUMABLE_CHANGES = (
    "train_steps",
    "eval_every",
    "checkpoint_every",
    "log_every",
    "collapse_share",
    "collapse_evals",
    "decode",
    "model.attention_impl",
    "model.cudnn_document_mask",
    "model.dispatch",
    "model.grouped_impl",
    "model.max_segments_per_row",
    "runtime.deterministic",
    "runtime.matmul_precision",
    "runtime.triton_ragged_dot",
)


class ResumeError(ValueError):
    """The workdir cannot be resumed with this config; the message names what and how to fix it."""


def check_resume_config(workdir: str, run: RunConfig) -> None:
    """Refuses to resume a workdir whose saved config differs from ``run``'s (its
    :attr:`~sparsemixer_jax.training.run_config.RunConfig.record`) in anything but
    RESUMABLE_CHANGES.

    A workdir without a checkpoint (a run stopped by a config or data error) starts afresh with
    the new config; its cached vocabulary is dropped if the data settings changed.
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    current = json.loads(run.record)
    if not has_checkpoint(workdir):
        vocabulary = os.path.join(workdir, "spm.model")
        stale = saved.get("data") != current.get("data") or saved.get("seed") != current.get("seed")
        if stale and is_main_process() and os.path.exists(vocabulary):
            logger.info("data settings changed, nothing trained yet: retraining %s", vocabulary)
            os.remove(vocabulary)
        return
    if config_schema.task_of(saved) != config_schema.task_of(current):
        raise ResumeError(f"workdir {workdir} holds a {config_schema.task_of(saved)} run, not "
                          f"{config_schema.task_of(current)}: use a fresh --workdir")
    changed = [
        f"config.{name} (saved {before!r}, now {after!r})"
        for name, (before, after) in config_differences(saved, current).items()
        if name not in RESUMABLE_CHANGES and name.split(".")[0] not in RESUMABLE_CHANGES
    ]
    if changed:
        raise ResumeError(
            f"workdir {workdir} holds a run with a different {'; '.join(changed)}: "
            "restore the saved setting, or use a fresh --workdir"
        )


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (saved, current)}`` of every leaf that differs. A field the saved config
    lacks is compared as :data:`sparsemixer_jax.training.config.ADDED_FIELD_DEFAULTS` reads it; mesh
    sizes as resolved on this machine (``mesh.data = -1`` and the device count it stands for
    agree)."""
    missing = object()
    task = config_schema.task_of(saved)
    saved = json.loads(config_schema.with_defaults(saved).to_json())
    saved, current = _resolved_mesh(saved), _resolved_mesh(current)
    flat_saved, flat_current = (flatten(c, sep=".") for c in (saved, current))
    flat_saved.setdefault("task", task)
    out = {}
    for name in sorted(set(flat_saved) | set(flat_current)):
        before, after = flat_saved.get(name, missing), flat_current.get(name, missing)
        if before != after:
            out[name] = tuple(None if v is missing else v for v in (before, after))
    return out


def _resolved_mesh(config: dict) -> dict:
    """The mesh section as the number of devices it spans: a run resumes on any layout of as
    many devices (its checkpoint is restored onto the new layout, and the numbers do not depend
    on it), but not on another number of devices (its batches would change)."""
    mesh = config.get("mesh")
    if not isinstance(mesh, dict):
        return config
    data, fsdp, expert = MeshConfig.from_config(mesh).sizes(jax.device_count())
    return {**config, "mesh": {"devices": data * fsdp * expert}}


def resume_from_newest_intact(template: TrainState, workdir: str,
                              train_steps: int) -> tuple[Restored | None, RunCheckpoints]:
    """The newest intact checkpoint (``last`` or ``best``) to resume from (None for a new run),
    and the workdir's checkpoint managers to save the next ones with.

    :func:`~sparsemixer_jax.training.state.restore_checkpoint` with both kinds, setting the
    unreadable ones aside (this run holds the workdir). Raises :class:`ResumeError` (one line)
    when checkpoints exist but none can be read, or when the run is already past
    ``train_steps``. A ``best`` checkpoint resumed from is copied to ``last``: its full train
    state is nowhere else once later best checkpoints replace it.
    """
    try:
        restored = restore_checkpoint(workdir, template, set_aside=True)
    except CheckpointError as e:
        raise ResumeError(f"{e}. To start over, use a fresh --workdir (or move this one's "
                          "checkpoints/ and metrics.jsonl away)") from None
    if restored is not None and restored.step > train_steps:
        raise ResumeError(
            f"config.train_steps={train_steps} but {workdir} holds a checkpoint of step "
            f"{restored.step}: set config.train_steps >= {restored.step}, or use a fresh --workdir"
        )
    # Made after the restore: orbax's managers list the steps on disk when they are made, and
    # the unreadable ones have been set aside by now.
    checkpoints = RunCheckpoints(workdir)
    if restored is None:
        return None, checkpoints
    if restored.kind == "best" and restored.step not in checkpoints.last.all_steps():
        checkpoints.save_last(restored.step, restored.state, restored.meta)
    logger.info("resumed from %s (step %d)", restored.directory, restored.step)
    return restored, checkpoints
