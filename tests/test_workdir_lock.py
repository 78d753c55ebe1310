"""One run per workdir: a second run is refused naming the holder; a killed holder frees it."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from absl import flags

from sparsemixer_jax import training
from sparsemixer_jax.tasks import run_config, translation
from sparsemixer_jax.training import cli
from sparsemixer_jax.training.workdir_lock import (
    LOCK_FILE,
    WorkdirError,
    WorkdirInUse,
    WorkdirLock,
    hold_workdir,
)
from tests import tiny_wmt_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_lock_is_refused_naming_the_holder_until_the_first_is_released(tmp_path):
    workdir = str(tmp_path)
    first = WorkdirLock(workdir)
    with pytest.raises(WorkdirInUse) as err:
        WorkdirLock(workdir)  # another open file description: flock refuses it in-process too
    message = str(err.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started 20" in message
    assert message.startswith(f"workdir {workdir} is in use by another run") and "\n" not in message
    first.release()
    with hold_workdir(workdir), open(os.path.join(workdir, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == os.getpid()
    with open(os.path.join(workdir, LOCK_FILE)) as f:
        assert f.read() == ""  # released: no holder named


class DataThatWaits:
    """A task whose data loading waits for ``go`` and then fails: the run holds its workdir (the
    lock comes first) for as long as the test wants, and ends without compiling anything."""

    def __init__(self):
        self.loading, self.go = threading.Event(), threading.Event()

    def load_data(self, workdir, batch_multiple):
        self.loading.set()
        self.go.wait(timeout=60)
        raise ValueError("the test ends this run here")


def test_two_runs_at_once_the_second_is_refused_and_the_first_ends_normally(tmp_path):
    workdir, config = str(tmp_path / "run"), tiny_wmt_config.get_config()
    first, outcome = DataThatWaits(), []

    def first_run():
        try:
            training.train(run_config(config, first), workdir)
        except ValueError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        assert first.loading.wait(timeout=60)
        with pytest.raises(WorkdirInUse, match=rf"pid {os.getpid()}, started 20"):
            translation.train_and_evaluate(config, workdir)
    finally:
        first.go.set()
        thread.join()
    assert outcome == ["the test ends this run here"]
    with hold_workdir(workdir):  # the first run released it when it ended
        pass


def test_a_lock_held_by_a_process_killed_with_sigkill_does_not_stop_the_next_run(tmp_path):
    workdir = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from sparsemixer_jax.training.workdir_lock import WorkdirLock\n"
         "lock = WorkdirLock(sys.argv[1]); print('held', flush=True); time.sleep(600)", workdir],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(WorkdirInUse, match=rf"pid {holder.pid}, started 20"):
            WorkdirLock(workdir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    WorkdirLock(workdir).release()


def test_a_workdir_that_is_a_file_is_one_line_before_anything_runs(tmp_path, capsys):
    if not flags.FLAGS.is_parsed():  # train_or_exit reads --verbosity
        flags.FLAGS.mark_as_parsed()
    path = tmp_path / "results.txt"
    path.write_text("not a directory\n")
    config = tiny_wmt_config.get_config()
    with pytest.raises(WorkdirError, match=r"results\.txt is a file, not a directory"):
        translation.train_and_evaluate(config, str(path))
    under_a_file = str(path / "run")
    with pytest.raises(SystemExit) as exit_:
        cli.train_or_exit(translation.train_and_evaluate, config, under_a_file)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: --workdir {under_a_file}: cannot create it: {path} is a file\n"
    assert path.read_text() == "not a directory\n"
    blocked = tmp_path / "blocked"
    (blocked / LOCK_FILE).mkdir(parents=True)  # the lock file cannot be opened (as read-only would)
    with pytest.raises(WorkdirError, match=r"blocked: cannot open .*lock for writing: Is a dir"):
        WorkdirLock(str(blocked))


@pytest.mark.slow  # fast counterparts: the two runs at once in-process, the SIGKILLed holder
def test_two_command_line_runs_on_one_workdir(tmp_path):
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "experiments.wmt", "--config", "tests/tiny_wmt_config.py",
               "--workdir", workdir, "--config.train_steps=100000"]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        lock_path, deadline = os.path.join(workdir, LOCK_FILE), time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            try:
                with open(lock_path) as f:
                    holder = json.load(f)
                if holder["pid"] == first.pid:
                    started = holder["started"]
                    break
            except (OSError, ValueError):  # not created or not written yet
                pass
            time.sleep(0.1)
        assert first.poll() is None, "the first run ended before the second started"
        second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2
        assert second.stderr.splitlines() == [
            f"error: workdir {workdir} is in use by another run (host {socket.gethostname()}, "
            f"pid {first.pid}, started {started}): wait for it to end or stop it, or use another "
            "--workdir"]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with hold_workdir(workdir):  # the kernel released the killed run's lock
        pass
