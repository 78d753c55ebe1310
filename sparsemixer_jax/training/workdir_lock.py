"""One run per workdir: a kernel lock on ``{workdir}/lock`` held for the whole run.

Two runs writing the same checkpoints and ``metrics.jsonl`` corrupt each other quietly (steps
logged twice, orbax deleting a step the other one saved), so a second run is refused at once
with one line naming the holder: its host, process id and start time, which the holder writes
into the lock file.

The lock is ``fcntl.flock``: the kernel releases it when the holding process ends, however it
ends (a SIGKILL or a lost machine included), so a stale lock never stops the next run and there
is no pid to check. Linux NFS clients pass ``flock`` on to the server as a POSIX lock, so runs on
two machines that share the workdir exclude each other too. A filesystem without locks (some
FUSE mounts) is reported once as a warning and the run goes on unlocked.

Several processes (one run on several hosts): process 0 holds the lock for the whole run; every
process learns whether it got it, so they all start or all stop with the same message.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator

import jax

logger = logging.getLogger(__name__)

LOCK_FILE = "lock"


class WorkdirError(RuntimeError):
    """The workdir cannot be used; the message is one line naming it and the cause."""


class WorkdirInUse(WorkdirError):
    """Another run holds the workdir; the message names its host, process id and start time."""


def make_workdir(workdir: str) -> None:
    """Creates ``workdir`` (and its parents); a one-line :class:`WorkdirError` if it cannot."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory: name a directory "
                           "(it is created if missing)")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only filesystem
        parent = os.path.dirname(os.path.abspath(workdir))
        while parent != os.path.dirname(parent) and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        cause = f"{parent} is a file" if os.path.isfile(parent) else e.strerror
        raise WorkdirError(f"--workdir {workdir}: cannot create it: {cause}") from None


def _holder_record() -> str:
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started})


def describe_holder(workdir: str) -> str:
    """``host H, pid P, started T`` from the lock file (whatever of it is readable)."""
    try:
        with open(os.path.join(workdir, LOCK_FILE)) as f:
            record = json.loads(f.read())
        return f"host {record['host']}, pid {record['pid']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "its host and pid are not written yet"


def in_use_message(workdir: str) -> str:
    return (f"workdir {workdir} is in use by another run ({describe_holder(workdir)}): wait for "
            "it to end or stop it, or use another --workdir")


class WorkdirLock:
    """An exclusive, non-blocking ``flock`` on ``{workdir}/lock``; :meth:`release` ends it."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        # "a+": opening must not truncate; the holder's record stays readable to a refused run.
        try:
            self.file = open(self.path, "a+")  # noqa: SIM115  (held open for the whole run)
        except OSError as e:  # a read-only workdir, no permission
            raise WorkdirError(f"--workdir {workdir}: cannot open {self.path} for writing: "
                               f"{e.strerror}") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): a second run on this workdir would not be "
                               "refused", self.path, e.strerror)
                return
            self.file.close()
            raise WorkdirInUse(in_use_message(workdir)) from None
        self.file.truncate(0)
        self.file.write(_holder_record() + "\n")
        self.file.flush()

    def release(self) -> None:
        if self.file.closed:
            return
        self.file.truncate(0)  # a later reader sees no holder rather than a finished one
        self.file.close()  # closing the last descriptor releases the flock


def _agreed_error(error: WorkdirError | None, workdir: str) -> WorkdirError | None:
    """On several processes: this process's error, or one naming the first process that has
    one (so no process trains while another has stopped); on one process, ``error``."""
    if jax.process_count() == 1:
        return error
    import numpy as np
    from jax.experimental import multihost_utils

    mine = 0 if error is None else 2 if isinstance(error, WorkdirInUse) else 1
    codes = [int(c) for c in np.asarray(multihost_utils.process_allgather(np.int32(mine))).ravel()]
    if error is not None or not any(codes):
        return error
    first = next(i for i, c in enumerate(codes) if c)
    if codes[first] == 2:
        return WorkdirInUse(in_use_message(workdir))
    return WorkdirError(f"--workdir {workdir}: process {first} cannot use it (its message says "
                        "why)")


@contextlib.contextmanager
def hold_workdir(workdir: str) -> Iterator[None]:
    """Creates ``workdir`` and holds its lock (on process 0) until the block ends.

    Raises :class:`WorkdirError` if it is a file or cannot be created, :class:`WorkdirInUse` if
    another run holds it, on every process alike.
    """
    error, lock = None, None
    try:
        make_workdir(workdir)
        if jax.process_index() == 0:
            lock = WorkdirLock(workdir)
    except WorkdirError as e:
        error = e
    error = _agreed_error(error, workdir)
    if error is not None:
        if lock is not None:
            lock.release()
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
