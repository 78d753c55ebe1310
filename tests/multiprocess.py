"""Runs a command as several JAX processes on this machine: the tests' stand-in for several hosts.

Each process is started with the variables a user sets on every host of a cluster
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; the coordinator on a
free local port), its own simulated CPU devices (``XLA_FLAGS``) and ``JAX_PLATFORMS=cpu``; the
commands' :func:`sparsemixer_jax.training.cli.initialize_distributed` then joins them with gloo
collectives. :func:`run_processes` waits for all of them, stops the others as soon as one fails
(a process whose peer died would otherwise wait minutes in a collective) and reports every
process's log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Finished:
    """What one process left: its exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, other_math: bool = False, **extra: str) -> dict[str, str]:
    """This process's environment for a child JAX process with ``devices`` simulated CPU devices:
    no inherited ``JAX_*`` variable, the other XLA flags (the tests' optimisation level) kept,
    ``extra`` added; with ``other_math``, XLA's other elementwise math
    (:func:`tests.kit.other_math_env`)."""
    from tests.kit import other_math_env

    source = other_math_env() if other_math else os.environ
    env = {k: v for k, v in source.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        JAX_PLATFORMS="cpu",
        JAX_DEFAULT_MATMUL_PRECISION="highest",
        TF_CPP_MIN_LOG_LEVEL="3",
        **extra,
    )
    return env


def _report(finished: list[Finished], why: str) -> str:
    """``why``, then each process's exit code (negative: stopped by that signal) and the end
    of its stderr."""
    parts = [why]
    for i, f in enumerate(finished):
        parts.append(f"--- process {i}: exit code {f.returncode}; the end of its stderr:\n"
                     f"{f.stderr[-4000:]}")
    return "\n".join(parts)


def run_processes(args: list[str], *, processes: int = 2, devices: int = 2,
                  timeout: float = 300, cwd: str = REPO, check: bool = True,
                  stop_on_failure: bool = True, other_math: bool = False,
                  while_running: Callable[[list[subprocess.Popen]], None] | None = None,
                  ) -> list[Finished]:
    """Runs ``python args...`` as ``processes`` JAX processes of ``devices`` CPU devices each
    (``processes * devices`` global devices) joined through a coordinator on this machine, and
    returns each one's :class:`Finished`, in process order.

    Stops every process still running when ``timeout`` seconds pass, and (``stop_on_failure``)
    when one exits with an error; with ``check`` (the default) raises AssertionError then, or
    when any exit code is not 0, with every process's stderr. ``stop_on_failure=False`` waits
    for every process: for a test of how each one fails. ``while_running(processes)`` is
    called once they have started (to signal one, say); the timeout counts its time too.
    ``other_math``: the processes use XLA's other elementwise math (:func:`process_env`)."""
    address = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as files:
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(processes)]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(processes)]
        running = [
            subprocess.Popen(
                [sys.executable, *args], cwd=cwd, stdout=outs[i], stderr=errs[i],
                env=process_env(devices, other_math, JAX_COORDINATOR_ADDRESS=address,
                                JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i)))
            for i in range(processes)
        ]
        deadline = time.monotonic() + timeout
        why = None
        try:
            if while_running is not None:
                while_running(running)
            while None in (codes := [p.poll() for p in running]):  # polls every process
                if stop_on_failure and any(code not in (None, 0) for code in codes):
                    why = "a process failed; the others were stopped"
                    break
                if time.monotonic() > deadline:
                    why = f"timed out after {timeout:.0f} s"
                    break
                # Wakes when the first process still running ends, or after half a second.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    next(p for p in running if p.returncode is None).wait(timeout=0.5)
        finally:
            for p in running:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for f in (*outs, *errs):
            f.seek(0)
        finished = [Finished(p.returncode, out.read(), err.read())
                    for p, out, err in zip(running, outs, errs, strict=True)]
    if why is None and any(f.returncode != 0 for f in finished):
        why = "a process failed"
    if check and why is not None:
        raise AssertionError(_report(finished, why))
    return finished
