"""Checkpoints of a training run with orbax: the last ones and the best by validation loss.

Layout under ``{workdir}/checkpoints/``: ``last/<step>/`` and ``best/<step>/``, each an orbax
checkpoint with two items: ``state`` (the train state,
:class:`sparsemixer_jax.training.state.TrainState`: a pytree of arrays saved from every host)
and ``meta`` (JSON: step, data position, best validation loss so far), plus our
``manifest.json`` (size and SHA-256 of every file). Orbax writes to a temporary directory and
renames it when complete, so a run killed mid-save leaves the previous checkpoints intact and the
partial one is ignored.

This module writes checkpoints and reads one given its directory (:func:`read_checkpoint`);
:func:`sparsemixer_jax.training.state.restore_checkpoint` is the one function that finds a
run's checkpoint and restores it, with the fallback rule. Nothing is lost to one bad checkpoint:

* ``last`` keeps :data:`KEEP_LAST` steps and ``best`` keeps two, so a corrupt newest checkpoint
  costs at most one checkpoint interval.
* An unreadable checkpoint is named with its reason on one line; the run that holds the workdir
  moves it to ``checkpoints/unreadable/`` (:func:`set_aside`; never deleted).
* Orbax has no checksum of the array data (only of the OCDBT index), so a flipped bit in a data
  file would load silently; the manifest catches that, and a truncated or missing file before
  orbax starts its asynchronous reads (whose failures otherwise surface as pages of tracebacks).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import logging
import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)

KEEP_LAST = 2  # the newest and one before it: a corrupt newest costs one interval
KEEP_BEST = 2
MANIFEST = "manifest.json"
KINDS = ("last", "best")
# Files of every checkpoint that orbax opens first: their absence gives orbax's most obscure errors
# ("Dict key mismatch" for a missing tree structure).
REQUIRED_FILES = ("state/_METADATA", "meta/metadata")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message is one line naming the directory and the cause."""


class DiskFull(CheckpointError):
    """A checkpoint save ran out of space; the message is one line naming the workdir, the save
    and the space a checkpoint needs. The run stops at it: nothing after the last good save is
    lost but the steps since, and a rerun with space freed resumes there."""


def is_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a full disk or an exceeded quota: an
    ``OSError`` with ``ENOSPC`` / ``EDQUOT``, or tensorstore's ``RESOURCE_EXHAUSTED`` status
    whose text carries the system's message (orbax raises it as a ``ValueError``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in (os.strerror(errno.ENOSPC),
                                               os.strerror(errno.EDQUOT))):
            return True
        error = error.__cause__ or error.__context__
    return False


def _bytes(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover - unreachable


class _DropOutOfSpaceTracebacks(logging.Filter):
    """Orbax logs a full disk in its background save threads as several ERROR records with
    tracebacks before the failure reaches the run, which reports it in one line
    (:class:`DiskFull`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and is_out_of_space(error)) and \
            os.strerror(errno.ENOSPC) not in record.getMessage()


def _step_dirs(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def checkpoints_root(workdir: str) -> str:
    """``{workdir}/checkpoints``, absolute."""
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def step_dir(workdir: str, kind: str, step: int) -> str:
    """The directory of checkpoint ``kind/step`` of ``workdir``."""
    return os.path.join(checkpoints_root(workdir), kind, str(step))


def list_checkpoints(workdir: str, kind: str | None = None) -> list[tuple[int, str]]:
    """``(step, kind)`` of every finished checkpoint of ``kind`` (None: both), newest first,
    ``last`` before ``best`` at one step; read from the directory names, without orbax (which
    would create the directories of a workdir that has none)."""
    root = checkpoints_root(workdir)
    found = [(step, k) for k in (KINDS if kind is None else (kind,))
             for step in _step_dirs(os.path.join(root, k))]
    return sorted(found, key=lambda sk: (-sk[0], KINDS.index(sk[1])))


def has_checkpoint(workdir: str) -> bool:
    """Whether ``workdir`` holds any finished ``last`` or ``best`` checkpoint (without orbax)."""
    return bool(list_checkpoints(workdir))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(step_dir: str) -> None:
    """Writes ``{step_dir}/manifest.json``: size and SHA-256 of every file of the checkpoint."""
    files = {}
    for parent, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, step_dir)
            if rel != MANIFEST:
                files[rel] = [os.path.getsize(path), _sha256(path)]
    tmp = os.path.join(step_dir, f"{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def checkpoint_digest(step_dir: str) -> str:
    """A SHA-256 of a checkpoint's content: of the sorted ``(file, size, SHA-256)`` list of its
    manifest, or of its files when it has no manifest (the same value either way). Two
    checkpoints with the same digest hold the same bytes; it names what a fine-tuning started
    from."""
    path = os.path.join(step_dir, MANIFEST)
    files = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{step_dir}: unreadable {MANIFEST} ({e})") from None
    if files is None:
        files = {}
        for parent, _, names in os.walk(step_dir):
            for name in names:
                full = os.path.join(parent, name)
                rel = os.path.relpath(full, step_dir)
                if rel != MANIFEST and not name.startswith(f"{MANIFEST}.tmp"):
                    files[rel] = [os.path.getsize(full), _sha256(full)]
    listing = json.dumps(sorted([rel, int(size), digest] for rel, (size, digest) in files.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def check_manifest(step_dir: str) -> None:
    """Raises :class:`CheckpointError` if a required file or a file the manifest lists is missing,
    or a listed one has another size or another digest. A checkpoint without a manifest (killed
    between orbax's save and ours) passes: orbax's own reading is then the only check."""
    for rel in REQUIRED_FILES:  # what orbax reads first; its own errors name none of them
        if not os.path.exists(os.path.join(step_dir, rel)):
            raise CheckpointError(f"{step_dir}: file {rel} is missing")
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{step_dir}: unreadable {MANIFEST} ({e})") from None
    for rel, (size, digest) in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.exists(full):
            raise CheckpointError(f"{step_dir}: file {rel} is missing")
        actual = os.path.getsize(full)
        if actual != size:
            raise CheckpointError(f"{step_dir}: file {rel} has {actual} bytes, {size} were saved")
        if _sha256(full) != digest:
            raise CheckpointError(f"{step_dir}: file {rel} differs from the saved one (SHA-256)")


def _one_line(error: BaseException) -> str:
    """The root cause of an exception chain, on one line: tensorstore's status (e.g.
    ``OUT_OF_RANGE: ... byte range ...``) sits at the bottom, under orbax's generic wrappers."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


class _DropUnretrievedTaskErrors(logging.Filter):
    """Orbax reads every array in its own asyncio task; when one read fails, the failures of the
    others are logged by asyncio as "Task exception was never retrieved", each with a full
    TensorStore spec (a thousand lines for a small model). The first failure is reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


@contextlib.contextmanager
def _quiet_failed_reads():
    log = logging.getLogger("asyncio")
    drop = _DropUnretrievedTaskErrors()
    log.addFilter(drop)
    try:
        yield
    finally:
        gc.collect()  # the failed tasks report now, while the filter is on
        log.removeFilter(drop)


def saved_items(step_dir: str) -> set[str]:
    """The top-level names of the ``state`` saved in ``step_dir`` (from orbax's tree metadata,
    without reading an array): which layout the checkpoint has."""
    from etils import epath

    try:
        tree = ocp.StandardCheckpointHandler().metadata(
            epath.Path(os.path.join(step_dir, "state"))).tree
    except Exception as e:  # orbax raises several types for an unreadable _METADATA
        raise CheckpointError(f"{step_dir}: {_one_line(e)}") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{step_dir}: its state is a {type(tree).__name__}, not a dict")
    return set(tree)


def read_checkpoint(step_dir: str, template: Any, step: int) -> tuple[Any, dict]:
    """``(state, meta)`` of the checkpoint in ``step_dir``, placed like ``template`` (a pytree
    of arrays or ``jax.ShapeDtypeStruct`` whose structure is the saved one).

    No manifest check (:func:`check_manifest` first; it hashes every file) and no fallback
    (:func:`sparsemixer_jax.training.state.restore_checkpoint`). Any failure of orbax, or a
    meta whose step is not ``step``, is a :class:`CheckpointError` whose one-line message names
    the directory.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
        with _quiet_failed_reads(), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            restored = reader.restore(step_dir, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        meta = dict(restored.meta)
        if int(meta["step"]) != step:
            raise ValueError(f"meta says step {meta['step']}")
    except Exception as e:  # orbax / tensorstore raise many types; all mean "unusable"
        raise CheckpointError(f"{step_dir}: {_one_line(e)}") from None
    return restored.state, meta


def set_aside(workdir: str, kind: str, step: int) -> str:
    """Moves the unreadable checkpoint ``kind/step`` to ``checkpoints/unreadable/{kind}-{step}``
    (``.2``, ``.3``, ... if taken; by process 0), out of orbax's sight so the step can be saved
    again. Returns where it went."""
    root = checkpoints_root(workdir)
    target = os.path.join(root, "unreadable", f"{kind}-{step}")
    suffix = 1
    while os.path.exists(target if suffix == 1 else f"{target}.{suffix}"):
        suffix += 1
    target = target if suffix == 1 else f"{target}.{suffix}"
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(step_dir(workdir, kind, step), target)
    return target


def check_processes_agree(step: int, kind: str) -> None:
    """Every process must restore the same checkpoint (a read error on one host only would
    otherwise make the hosts train from different states)."""
    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.array([step, (*KINDS, "none").index(kind)], np.int64)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    if not (everyone == mine).all():
        raise CheckpointError(
            f"the processes found different checkpoints to resume from (step, kind index per "
            f"process: {everyone.tolist()}); check that every host sees the same workdir"
        )


class RunCheckpoints:
    """The ``last`` and ``best`` checkpoint managers of one workdir: saving (reading is
    :func:`read_checkpoint`'s).

    Saves run in the background; a save that fails for want of space is a :class:`DiskFull`
    raised by the next call here (:meth:`poll` finds it as soon as the save ends), and a save
    the filesystem's free space cannot hold (less than the newest checkpoint's size) is refused
    before it starts."""

    def __init__(self, workdir: str, keep_last: int = KEEP_LAST, keep_best: int = KEEP_BEST):
        self.workdir = workdir
        self.root = checkpoints_root(workdir)
        # Each manager names its multi-host barriers with its own prefix: orbax names them by
        # step, so saving `best` and `last` of the same step at once would share a barrier name
        # and fail ("Barrier _async_write_complete.N is already ongoing") on several hosts.
        self.last, self.best = (
            ocp.CheckpointManager(
                os.path.join(self.root, kind),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=keep,
                    multiprocessing_options=ocp.options.MultiprocessingOptions(
                        barrier_sync_key_prefix=kind
                    ),
                ),
            )
            for kind, keep in (("last", keep_last), ("best", keep_best))
        )
        self._pending: dict[str, tuple[int, int]] = {}  # kind -> (step, state bytes) in flight
        self._quiet = _DropOutOfSpaceTracebacks()
        logging.getLogger("absl").addFilter(self._quiet)

    def manager(self, kind: str) -> ocp.CheckpointManager:
        return {"last": self.last, "best": self.best}[kind]

    def step_dir(self, kind: str, step: int) -> str:
        return os.path.join(self.root, kind, str(step))

    # ------------------------------------------------------------------------------ saving

    def _write_manifests(self, manager: ocp.CheckpointManager, kind: str) -> None:
        """Manifests of every finished save of ``manager`` that has none yet (process 0)."""
        manager.wait_until_finished()
        if jax.process_index() != 0:
            return
        for step in manager.all_steps():
            step_dir = self.step_dir(kind, step)
            if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, MANIFEST)):
                write_manifest(step_dir)

    def _confirm(self, kind: str) -> None:
        """Waits for the save of ``kind`` in flight, if any, and writes its manifest; a
        :class:`DiskFull` if it ran out of space."""
        step, state_bytes = self._pending.pop(kind, (None, 0))
        try:
            self._write_manifests(self.manager(kind), kind)
        except Exception as e:
            if step is None or not is_out_of_space(e):
                raise
            raise self._disk_full(kind, step, state_bytes) from None

    def _newest_size(self) -> int | None:
        """The bytes of the newest finished checkpoint of this run (from its manifest), or None
        when there is none yet."""
        for step, kind in list_checkpoints(self.workdir):
            try:
                with open(os.path.join(self.step_dir(kind, step), MANIFEST)) as f:
                    return sum(size for size, _ in json.load(f)["files"].values())
            except (OSError, ValueError, KeyError):
                continue
        return None

    def _disk_full(self, kind: str, step: int, state_bytes: int) -> DiskFull:
        free = shutil.disk_usage(self.root).free
        size = self._newest_size()
        if size is None:  # the first save: the state's size bounds it (orbax compresses)
            needed = f"this run's state is {_bytes(state_bytes)} before compression"
            size = state_bytes
        else:
            needed = f"a checkpoint of this run takes {_bytes(size)}"
        return DiskFull(
            f"{self.workdir}: no space left on its filesystem to save checkpoint {kind}/{step} "
            f"({_bytes(free)} free; {needed}, and the oldest is removed only once the new one "
            f"is written): free at least {_bytes(max(size - free, 0) or size)} more and rerun, "
            "which resumes from the newest checkpoint")

    def _save(self, kind: str, step: int, state: Any, meta: dict) -> None:
        manager = self.manager(kind)
        # The previous save of this manager finishes here anyway (orbax waits for it before it
        # starts the next); its manifest is written now, while this one runs in the background.
        self._confirm(kind)
        state_bytes = sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(state))
        size = self._newest_size()
        if size is not None and shutil.disk_usage(self.root).free < size:
            raise self._disk_full(kind, step, state_bytes)
        try:
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except Exception as e:
            if not is_out_of_space(e):
                raise
            raise self._disk_full(kind, step, state_bytes) from None
        self._pending[kind] = (step, state_bytes)

    def save_last(self, step: int, state: Any, meta: dict) -> None:
        self._save("last", step, state, meta)

    def save_best(self, step: int, state: Any, meta: dict) -> None:
        self._save("best", step, state, meta)

    def poll(self) -> None:
        """Between steps: a save that has ended is confirmed (:class:`DiskFull` if it ran out
        of space), so that a run stops at its failed save, not at the next one."""
        for kind in list(self._pending):
            if not self.manager(kind).is_saving_in_progress():
                self._confirm(kind)

    def wait(self) -> None:
        """Blocks until asynchronous saves are on disk and have their manifests."""
        self._confirm("last")
        self._confirm("best")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.last.close()
            self.best.close()
            logging.getLogger("absl").removeFilter(self._quiet)
