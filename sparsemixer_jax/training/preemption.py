"""Stopping a run on SIGTERM or SIGINT: the step in flight finishes and is checkpointed.

Preemptible machines (spot and TPU VMs, SLURM's ``--signal``) send SIGTERM some time before
they are taken away; Ctrl-C sends SIGINT. Either way the training loop finishes the step it is
in, saves a checkpoint of that step and raises :class:`Stopped`; the command line prints
``stopped at step N, checkpoint saved; rerun to resume`` and exits with 128 + the signal's
number (what a shell reports for a process the signal ended: 130 for Ctrl-C, 143 for SIGTERM).
Rerunning the command resumes from that step, bit-identical to a run never stopped. A second
signal ends the process at once, without a checkpoint; the earlier checkpoints stay intact
(orbax writes each one to a temporary directory and renames it when complete).

Several processes must stop at the same step, or the checkpoint's collectives would wait
forever. There SIGTERM is left to JAX's preemption service, which ``jax.distributed.initialize``
starts: the process that receives it tells the others, and
:func:`orbax.checkpoint.multihost.reached_preemption` (JAX's
``multihost_utils.reached_preemption_sync_point``) turns true on every process at the same
step. SIGINT is passed on to that service as a SIGTERM to this process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import orbax.checkpoint as ocp


class Stopped(KeyboardInterrupt):
    """The run stopped on signal ``signum`` after saving a checkpoint of ``step``.

    A KeyboardInterrupt, as the Ctrl-C it often is: code that catches ``Exception`` around a
    run (a study going on to its next run) does not swallow the request to stop.
    """

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"stopped at step {step}, checkpoint saved; rerun to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _say(message: str) -> None:
    # os.write, not print: a signal handler may run while the main thread is inside a write to
    # sys.stderr (the progress bar), and the buffered stream refuses a reentrant call.
    os.write(sys.stderr.fileno(), f"\n{message}\n".encode())


class StopSignals:
    """SIGTERM and SIGINT handlers for the training steps; :meth:`close` restores the earlier ones.

    Python runs signal handlers in the main thread only: a run started from another thread
    keeps the default handlers (and so stops without a checkpoint).
    """

    def __init__(self):
        self.signum: int | None = None
        self.several_processes = jax.process_count() > 1
        self.previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        handled = [signal.SIGINT] if self.several_processes else [signal.SIGINT, signal.SIGTERM]
        for signum in handled:
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(f"{name} again: stopping now, without a checkpoint of this step")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        _say(f"{name}: finishing this step and saving a checkpoint (send it again to stop now)")
        if self.several_processes:  # JAX's preemption service tells the other processes
            os.kill(os.getpid(), signal.SIGTERM)

    def requested(self, step: int) -> bool:
        """Whether to checkpoint ``step`` and stop; called after every step (on every process,
        where there are several: the agreement needs each step's call)."""
        if self.several_processes:
            return ocp.multihost.reached_preemption(step)
        return self.signum is not None

    def stopped(self, step: int) -> Stopped:
        return Stopped(step, self.signum or signal.SIGTERM)

    def close(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
