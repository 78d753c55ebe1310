"""SIGTERM and SIGINT: the step in flight finishes and is checkpointed, the rerun resumes there and
ends bit-identical to a run never stopped; time and tokens add up across the two parts.

The fast test signals its own process from the data stream, at the first batch of step 4, so the
stop lands on a known step (between the periodic checkpoints at 3 and 6); the slow one SIGTERMs
the command line.
"""

import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import flags

from sparsemixer_jax.tasks import run_config, translation
from sparsemixer_jax.training import TrainingDiverged, build_steps, cli, train
from sparsemixer_jax.training.preemption import Stopped, StopSignals
from tests import tiny_wmt_config
from tests.multiprocess import run_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_AT = 4  # not a multiple of checkpoint_every (3): only the stop itself saves it


def tiny(**overrides):
    config = tiny_wmt_config.get_config()
    config.decode.test_bleu = False  # the comparison is of training; no beam search to compile
    config.update_from_flattened_dict(overrides)
    return config


class SignalOnFetch:
    """The training stream, sending ``signum`` to this process when batch ``at`` is fetched."""

    def __init__(self, stream, at: int, signum: int):
        self.stream, self.at, self.signum, self.fetched = stream, at, signum, 0

    def __next__(self):
        self.fetched += 1
        if self.fetched == self.at:
            os.kill(os.getpid(), self.signum)
        return next(self.stream)

    def state(self):
        return self.stream.state()

    def restore(self, state):
        self.stream.restore(state)


@dataclasses.dataclass(frozen=True)
class SignalledTranslation(translation.TranslationTask):
    """Translation whose run gets ``signum`` while it fetches the first batch of ``step``."""

    step: int = 0
    signum: int = signal.SIGTERM

    @classmethod
    def of(cls, config, step: int, signum: int) -> "SignalledTranslation":
        task = translation.TranslationTask.from_config(config)
        fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
        return cls(**fields, step=step, signum=signum)

    def load_data(self, workdir, batch_multiple):
        data = super().load_data(workdir, batch_multiple)
        first_batch = (self.step - 1) * data.micro_batches + 1
        return dataclasses.replace(data, train=SignalOnFetch(data.train, first_batch, self.signum))


def tensorboard_steps(workdir, tag="loss"):
    """The steps of ``tag``'s scalars in the run's TensorBoard event files, as on disk now
    (TFRecords: length, its CRC, an ``Event``, its CRC)."""
    from tensorboardX.proto import event_pb2

    steps = []
    folder = os.path.join(workdir, "tensorboard")
    for name in sorted(os.listdir(folder)):
        data = pathlib.Path(folder, name).read_bytes()
        at = 0
        while at + 12 <= len(data):
            length = int.from_bytes(data[at:at + 8], "little")
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            steps += [event.step for v in event.summary.value if v.tag == tag]
            at += 12 + length + 4
    return steps


def test_closing_the_metric_log_puts_every_tensorboard_event_on_disk(tmp_path):
    """A stopped run closes its log before the command line ends the process at once: no
    event may wait in the writer's queue (its flush alone leaves some there)."""
    from sparsemixer_jax.training.logs import MetricLog

    log = MetricLog(str(tmp_path), 0)
    for step in range(1, 301):
        log.write({"step": step, "loss": 1 / step})
    log.close()
    assert tensorboard_steps(str(tmp_path)) == list(range(1, 301))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 301))


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timing(record):
    return {k: v for k, v in record.items() if k != "tokens_per_s"}


def checkpointed(read, workdir, config):
    """``(params, meta)`` of the last checkpoint of a translation run of ``config``."""
    task = translation.TranslationTask.from_config(config)
    return read(workdir, build_steps(run_config(config, task), config.data.vocab_size))


@pytest.fixture(scope="module")
def uninterrupted(translation_run):
    """The run of ``tiny()`` never stopped: the test run's one training of it (tests/conftest.py's
    ``translation_run``, which ``test_checkpoint.py`` reads too)."""
    return translation_run


def test_sigterm_checkpoints_the_step_in_flight_and_the_rerun_matches_a_run_never_stopped(
        uninterrupted, tmp_path, caplog, last_checkpoint):
    workdir, config, signum = str(tmp_path / "stopped"), tiny(), signal.SIGTERM
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(run_config(config, SignalledTranslation.of(config, STOP_AT, signum)), workdir)
    assert (stop.value.step, stop.value.signum, stop.value.exit_code) == (STOP_AT, signum,
                                                                         128 + signum)
    assert str(stop.value) == f"stopped at step {STOP_AT}, checkpoint saved; rerun to resume"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    _, meta = checkpointed(last_checkpoint, workdir, config)
    assert meta["step"] == STOP_AT
    logged = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STOP_AT + 1))
    # On disk before anything closes the run's writer: the command line may end the process
    # at once (cli.exit_process), and the steps up to the stop are not logged again.
    assert tensorboard_steps(workdir) == list(range(1, STOP_AT + 1))
    assert meta["train_tokens"] == sum(r["tokens"] for r in logged)
    first_part_time = meta["train_time_s"]
    assert first_part_time > 0

    with caplog.at_level(logging.INFO):
        resumed = translation.train_and_evaluate(config, workdir)
    assert f"(step {STOP_AT})" in caplog.text  # resumed from the stop, not the step-3 checkpoint
    reference_dir, reference = uninterrupted
    params, meta = checkpointed(last_checkpoint, workdir, config)
    expected, expected_meta = checkpointed(last_checkpoint, reference_dir, config)
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    assert meta["data"] == expected_meta["data"]
    assert [without_timing(r) for r in records(workdir)] == \
        [without_timing(r) for r in records(reference_dir)]
    for key in ("valid_loss", "best_valid_loss", "best_step"):
        assert resumed[key] == reference[key]
    # Time and throughput cover both parts: all six steps' tokens, over both parts' time.
    all_tokens = sum(r["tokens"] for r in records(reference_dir) if "loss" in r)
    assert resumed["train_time_s"] > first_part_time
    assert resumed["tokens_per_second"] * resumed["train_time_s"] == pytest.approx(all_tokens)


def test_stop_signals_note_the_first_signal_and_restore_the_handlers():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopSignals()
    try:
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt, a request to stop
        assert stop.requested(2) and stop.stopped(2).exit_code == 130
    finally:
        stop.close()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_train_or_exit_reports_a_stop_on_one_line(capsys):
    if not flags.FLAGS.is_parsed():  # train_or_exit reads --verbosity
        flags.FLAGS.mark_as_parsed()

    def stopped(config, workdir):
        raise Stopped(17, signal.SIGTERM)

    with pytest.raises(SystemExit) as exit_:
        cli.train_or_exit(stopped, None, "unused")
    assert exit_.value.code == 143
    assert capsys.readouterr().err == "stopped at step 17, checkpoint saved; rerun to resume\n"

    def interrupted(config, workdir):  # Ctrl-C while the data is read: no handler there
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        cli.train_or_exit(interrupted, None, "unused")
    assert exit_.value.code == 130
    assert capsys.readouterr().err.startswith("interrupted outside the training steps; rerun")

    def diverged(config, workdir):
        raise TrainingDiverged("step 5: loss nan")

    with pytest.raises(SystemExit) as exit_:
        cli.train_or_exit(diverged, None, "unused")
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "training stopped: step 5: loss nan\n"


@pytest.mark.slow  # fast counterpart: the in-process signal above
def test_sigterm_to_the_command_line_then_rerun(tmp_path, last_checkpoint):
    steps = 300  # tiny steps take milliseconds: enough of them to signal one mid-run
    overrides = {"train_steps": steps, "eval_every": 100, "checkpoint_every": 100}
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "experiments.wmt", "--config", "tests/tiny_wmt_config.py",
               "--workdir", workdir, "--config.decode.test_bleu=False",
               *(f"--config.{k}={v}" for k, v in overrides.items())]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    metrics, deadline = os.path.join(workdir, "metrics.jsonl"), time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    stopped_at = int(last.split()[3].rstrip(","))
    assert last == f"stopped at step {stopped_at}, checkpoint saved; rerun to resume"
    assert 1 <= stopped_at < steps and "Traceback" not in stderr

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    reference = str(tmp_path / "reference")
    translation.train_and_evaluate(tiny(**overrides), reference)
    params, _ = checkpointed(last_checkpoint, workdir, tiny(**overrides))
    expected, _ = checkpointed(last_checkpoint, reference, tiny(**overrides))
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    assert [without_timing(r) for r in records(workdir)] == \
        [without_timing(r) for r in records(reference)]


@pytest.mark.slow  # two processes; the one-process stop above is the fast counterpart
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    workdir = str(tmp_path / "run")
    args = ["-m", "experiments.wmt", "--config", "tests/tiny_wmt_config.py",
            "--workdir", workdir, "--config.mesh.data=2", "--config.train_steps=300",
            "--config.eval_every=100", "--config.checkpoint_every=100",
            "--config.decode.test_bleu=False"]
    metrics = os.path.join(workdir, "metrics.jsonl")

    def preempt_one(processes):  # once the first step is logged
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and all(p.poll() is None for p in processes):
            if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                break
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)  # the preemption notice reaches one host only

    finished = run_processes(args, devices=1, timeout=800, check=False, stop_on_failure=False,
                             while_running=preempt_one)
    errors = [f.stderr for f in finished]
    assert [f.returncode for f in finished] == [143, 143], "\n".join(e[-3000:] for e in errors)
    lines = [err.strip().splitlines()[-1] for err in errors]
    assert lines[0] == lines[1], lines
    stopped_at = int(lines[0].split()[3].rstrip(","))
    assert lines[0] == f"stopped at step {stopped_at}, checkpoint saved; rerun to resume"
    assert str(stopped_at) in os.listdir(os.path.join(workdir, "checkpoints", "last"))
