"""The training loop (:func:`sparsemixer_jax.training.train`) with a small fake task.

The fake task is a linear regression: every step compiles in well under a second, so the loop's
own behaviour (extending a run, exact resumption after a SIGKILL, the stop on a non-finite loss,
a data-parallel mesh, the deferred metric read) is tested here once, for every task. The task
tests (``test_train.py``, ``test_pretrain.py``) keep what is theirs.

The config is the tiny translation config (the loop validates a config of a known task): the
fake task reads only the loop's fields (seed, optim, intervals, mesh, runtime) and
``fake.*``. ``python tests/test_loop.py WORKDIR KILL_AT`` runs the fake task in a process that
SIGKILLs itself when it draws batch ``KILL_AT``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

if __name__ == "__main__":  # the killed child process: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparsemixer_jax import training
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.training.checkpoint import RunCheckpoints
from tests import kit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES, ROWS = 4, 8
TRUE_WEIGHTS = np.arange(1.0, FEATURES + 1, dtype=np.float32)


def fake_config(**overrides):
    """The tiny translation config (6 steps, validation and checkpoints every 3, logs every 2)
    with an inverse-sqrt learning rate of 0.5 and no warm-up, then ``overrides``."""
    return kit.tiny_config("translation", **{"optim.peak_lr": 0.5, "optim.warmup_steps": 0,
                                             **overrides})


def rows(seed: int, index: int) -> dict[str, np.ndarray]:
    """Batch ``index`` of stream ``seed``: ``y = x @ TRUE_WEIGHTS`` plus noise."""
    rng = np.random.default_rng([seed, index])
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = x @ TRUE_WEIGHTS + 0.1 * rng.normal(size=ROWS).astype(np.float32)
    return {"x": x, "y": y}


class Stream:
    """Endless training batches whose position is saved in checkpoints; SIGKILLs its own
    process when it is asked for batch ``kill_at`` (a run killed mid-training)."""

    def __init__(self, seed: int, kill_at: int = -1):
        self.seed, self.index, self.kill_at = seed, 0, kill_at

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = rows(self.seed, self.index)
        self.index += 1
        return batch

    def state(self) -> dict[str, int]:
        return {"index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


class Regression(nnx.Module):
    def __init__(self, *, mesh, rngs: nnx.Rngs):
        del mesh
        self.linear = nnx.Linear(FEATURES, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x)[:, 0]


@dataclasses.dataclass(frozen=True)
class FakeTask:
    """Summed squared error (the gradient is divided by the rows) of a linear model."""

    kill_at: int = -1
    micro_batches: int = 1
    seed: int = 0  # the data stream's

    batch_keys = ("x", "y")
    progress_keys = ("loss",)

    def loss(self, model, batch, key):
        del key  # nothing random
        error = jnp.sum((model(batch["x"]) - batch["y"]) ** 2)
        return error, {"error": error, "tokens": jnp.asarray(batch["y"].shape[0], jnp.float32)}

    def summarize(self, m):
        return m["tokens"], {"loss": m["error"] / m["tokens"], "tokens": m["tokens"]}

    def evaluate(self, model, batch, key):
        del key
        return jnp.stack([jnp.sum((model(batch["x"]) - batch["y"]) ** 2),
                          jnp.asarray(batch["y"].shape[0], jnp.float32)])

    def load_data(self, workdir, batch_multiple):
        del workdir, batch_multiple
        return training.TaskData(train=Stream(self.seed, self.kill_at),
                                 valid=[rows(10**6, i) for i in range(2)], vocab_size=0,
                                 stats={"rows": ROWS}, micro_batches=self.micro_batches)

    def build_model(self, run, vocab_size, mesh):
        del vocab_size
        return training.build_model(Regression, mesh, seed=run.seed, rules=run.mesh.rules)

    def validation_metrics(self, sums):
        error, count = (float(x) for x in sums)
        return {"valid_loss": error / count}

    def finish(self, run):
        # Floats round-trip exactly through JSON: equal lists are equal parameters, bit for bit.
        return {"weights": np.asarray(run.state.params["linear"]["kernel"]).ravel().tolist(),
                "bias": np.asarray(run.state.params["linear"]["bias"]).tolist()}


def train(task, config, workdir):
    return training.train(run_config(config, task), workdir)


def without_clock(records):
    """Metric records without their wall-clock fields."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


@pytest.fixture(scope="module")
def task():
    """The fake task for the shared ``straight_run`` fixture (tests/conftest.py): the reference."""
    return kit.Task("fake", lambda workdir, **o: train(FakeTask(), fake_config(**o),
                                                                workdir))


def test_straight_run_learns_logs_every_step_and_validates_on_schedule(straight_run):
    workdir, results = straight_run
    records = kit.read_metrics(workdir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in records if "valid_loss" in r] == [3, 6]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert valid[1] < valid[0], valid  # it learns
    assert results["steps"] == 6 and results["best_step"] in (3, 6)
    assert results["valid_loss"] == [r for r in records if "valid_loss" in r][-1]["valid_loss"]
    with open(os.path.join(workdir, "results.json")) as f:
        assert json.load(f)["weights"] == results["weights"]
    # The learning rate logged is the update's own (inverse_sqrt, no warm-up: 0.5 / sqrt(n)).
    lrs = [r["lr"] for r in records if "loss" in r]
    np.testing.assert_allclose(lrs, [0.5 / np.sqrt(max(n, 1)) for n in range(6)], rtol=1e-6)


def test_extending_a_run_equals_the_uninterrupted_run(straight_run, tmp_path):
    workdir = str(tmp_path / "extended")
    train(FakeTask(), fake_config(train_steps=3), workdir)
    extended = train(FakeTask(), fake_config(), workdir)
    reference_dir, reference = straight_run
    for key in ("weights", "bias", "valid_loss", "best_valid_loss", "best_step"):
        assert extended[key] == reference[key], key
    # Each step is logged once although the run stopped and started again, with the same values.
    assert (without_clock(kit.read_metrics(workdir))
            == without_clock(kit.read_metrics(reference_dir)))


def test_rerunning_a_finished_run_returns_its_results(straight_run):
    workdir, results = straight_run
    assert train(FakeTask(), fake_config(), workdir) == results


def test_sigkill_mid_run_then_resume_is_bit_for_bit(straight_run, tmp_path):
    """A process killed while drawing step 5's batch (checkpoints after every step, the last
    possibly half-written) resumes from the newest intact one to the uninterrupted result."""
    workdir = str(tmp_path / "killed")
    child = subprocess.run([sys.executable, __file__, workdir, "4"], cwd=REPO,
                           capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not os.path.exists(os.path.join(workdir, "results.json"))
    checkpoints = RunCheckpoints(workdir)
    saved = checkpoints.last.all_steps()
    checkpoints.close()
    assert saved and 3 <= max(saved) <= 4, saved  # it resumes, not starts afresh
    resumed = train(FakeTask(), fake_config(checkpoint_every=1), workdir)
    reference_dir, reference = straight_run
    assert (resumed["weights"], resumed["bias"]) == (reference["weights"], reference["bias"])
    assert (without_clock(kit.read_metrics(workdir))
            == without_clock(kit.read_metrics(reference_dir)))


def test_non_finite_loss_stops_before_the_update_and_keeps_the_last_good_checkpoint(
        tmp_path, last_checkpoint):
    workdir = str(tmp_path / "diverged")
    # lr 1e30: the first update makes the weights ~1e30, the next forward overflows.
    config = fake_config(**{"optim.peak_lr": 1e30, "checkpoint_every": 1, "eval_every": 100})
    with pytest.raises(training.TrainingDiverged, match=r"step 2: .* not finite.*after step 1"):
        train(FakeTask(), config, workdir)
    records = kit.read_metrics(workdir)
    assert [r["step"] for r in records] == [1, 2] and "error" in records[-1]
    assert not os.path.exists(os.path.join(workdir, "results.json"))
    checkpoints = RunCheckpoints(workdir)
    saved = checkpoints.last.all_steps()
    checkpoints.close()
    assert list(saved) == [1]
    params, meta = last_checkpoint(workdir, training.build_steps(run_config(config, FakeTask()), 0))
    assert meta["step"] == 1 and all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))


def test_accumulating_micro_batches_and_a_data_parallel_mesh_match_one_device(straight_run,
                                                                               tmp_path):
    """Two micro-batches of 8 rows per update (the loop draws both, the steps sum them), on a
    mesh of 2 devices (each batch split in half): the losses of one device and one batch of
    16 rows drawn the same way, to float32 rounding."""
    one = str(tmp_path / "one")
    mesh = str(tmp_path / "mesh")
    train(FakeTask(micro_batches=2), fake_config(train_steps=3), one)
    train(FakeTask(micro_batches=2), fake_config(train_steps=3, **{"mesh.data": 2}),
                   mesh)
    losses = [[r["loss"] for r in kit.read_metrics(w) if "loss" in r] for w in (one, mesh)]
    assert len(losses[0]) == 3
    # Each loss sums 16 rows' squared errors, each from a 5-term dot product (4 features and
    # the bias): sum_rtol of 16 x 5 additions. Adam's update, with gradients of order 1 far above
    # its eps, is homogeneous of degree 0 in them, so the parameters carry the same relative
    # rounding into the next losses. No elementwise function other than the correctly rounded
    # sqrt runs, so XLA's math library cannot change these numbers.
    np.testing.assert_allclose(losses[1], losses[0], rtol=kit.sum_rtol(16 * (FEATURES + 1)))
    straight = [r["loss"] for r in kit.read_metrics(straight_run[0]) if "loss" in r]
    assert losses[0][0] != straight[0]  # 16 rows, not the first 8 alone


if __name__ == "__main__":
    workdir, kill_at = sys.argv[1], int(sys.argv[2])
    train(FakeTask(kill_at=kill_at), fake_config(checkpoint_every=1), workdir)


# What orbax raises for a save on a full disk (tensorstore's status, seen on a 2 MB tmpfs).
OUT_OF_SPACE = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "linear/kernel/0" in OCDBT database at local file '
    '"/x/checkpoints/last/3.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": '
    "Failed writing: ...: Failed to write 200022 bytes to file 7: No space left on device "
    "[OS error 28: No space left on device]")


@pytest.mark.parametrize("when", ["at_save", "in_background"])
def test_a_save_on_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes(
        straight_run, tmp_path, monkeypatch, when):
    """Orbax's error for a full disk, raised by step 3's save itself or (as a real full disk
    does) by its background writes: the run stops at that save with one line naming the workdir
    and the space a checkpoint takes; rerun with space, it resumes to the uninterrupted result."""
    import orbax.checkpoint as ocp

    from sparsemixer_jax.training.checkpoint import DiskFull

    save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    failed = []

    def full_at_step_3(self, step, *args, **kwargs):
        if step == 3 and "last" in str(self.directory) and not failed:
            failed.append(step)
            if when == "at_save":
                raise OUT_OF_SPACE
        return save(self, step, *args, **kwargs)

    def background_failure(self):
        wait(self)
        if when == "in_background" and failed == [3] and "last" in str(self.directory):
            failed.append("raised")
            raise OUT_OF_SPACE

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_at_step_3)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", background_failure)
    workdir = str(tmp_path / "full")
    config = fake_config(checkpoint_every=1)
    with pytest.raises(DiskFull) as error:
        train(FakeTask(), config, workdir)
    message = str(error.value)
    assert message.startswith(f"{workdir}: no space left on its filesystem to save checkpoint "
                              "last/3 (") and "\n" not in message
    assert "a checkpoint of this run takes " in message  # steps 1 and 2 were saved
    # At the failed save: step 3 (in the background: found between steps once it has ended).
    assert max(r["step"] for r in kit.read_metrics(workdir)) in ((3,) if when == "at_save"
                                                                  else (3, 4))
    monkeypatch.undo()
    resumed = train(FakeTask(), config, workdir)
    _, reference = straight_run
    assert (resumed["weights"], resumed["bias"]) == (reference["weights"], reference["bias"])
