"""Checkpoints that survive corruption: each fault ends in a resume from an intact checkpoint or in
a one-line error naming the directory, and no intact best checkpoint or metrics line is lost.

One finished tiny run (``finished``: last and best checkpoints at steps 3 and 6) is copied with
``shutil.copytree`` and damaged in each test; nothing is retrained except where a test must. That
run is the test run's one training of the tiny translation config without test BLEU
(tests/conftest.py's ``translation_run``, the reference of ``test_preemption.py`` too).
"""

import argparse
import ast
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from sparsemixer_jax import training
from sparsemixer_jax.tasks import run_config, translation
from sparsemixer_jax.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    RunCheckpoints,
    check_manifest,
    read_checkpoint,
    step_dir,
    write_manifest,
)
from sparsemixer_jax.training.state import TrainState, restore_checkpoint
from tests import tiny_wmt_config

# Reading a damaged checkpoint, orbax abandons its other shard-reading coroutines; Python reports
# them as "never awaited" when they are collected. That is the expected end of a failed read.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**overrides):
    config = tiny_wmt_config.get_config()
    config.decode.test_bleu = False  # BLEU is not what these tests check
    config.update_from_flattened_dict(overrides)  # keys are dotted paths, e.g. "model.emb_dim"
    return config


def read_lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return f.readlines()


def steps_on_disk(workdir, kind):
    path = os.path.join(workdir, "checkpoints", kind)
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def largest_data_file(step_dir):
    files = [os.path.join(parent, name) for parent, _, names in os.walk(step_dir)
             for name in names if os.sep + "d" + os.sep in os.path.join(parent, name)]
    return max(files, key=os.path.getsize)


@pytest.fixture(scope="module")
def finished(translation_run):
    """A finished 6-step run of ``tiny()``: last and best checkpoints at 3 and 6, eight metrics
    lines. The test run's one training of it (tests/conftest.py's ``translation_run``, which
    ``test_preemption.py`` reads too): tests damage copies of it, never the run itself."""
    workdir, results = translation_run
    assert steps_on_disk(workdir, "last") == [3, 6] and steps_on_disk(workdir, "best") == [3, 6]
    return workdir, results


@pytest.fixture(scope="module")
def template():
    steps = training.build_steps(run_config(tiny()), tiny().data.vocab_size)
    return steps.abstract_state()


def test_a_one_device_template_places_every_leaf_on_that_device(template):
    """The step and the optimizer state too, not only the parameters: orbax restores an
    unplaced leaf onto the devices that saved it, which for a run saved on several hosts are
    other processes' devices (tests/test_multiprocess.py reads such a run in this process)."""
    placements = {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(template)}
    assert placements == {frozenset({jax.devices()[0]})}


def read_last(workdir, step, template):
    """The train state and meta of ``last/<step>`` (with its manifest check, no fallback)."""
    directory = step_dir(workdir, "last", step)
    check_manifest(directory)
    state, meta = read_checkpoint(directory, template, step)
    return argparse.Namespace(state=state, meta=meta)


@pytest.fixture
def copy(finished, tmp_path):
    workdir = str(tmp_path / "copy")
    shutil.copytree(finished[0], workdir)
    return workdir


def params_of(restored):
    return jax.tree.map(np.asarray, restored.state.params)


def _truncate_data(step_dir):
    path = largest_data_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(10)


def _truncate_data_and_drop_manifest(step_dir):  # only orbax's own reading can tell
    _truncate_data(step_dir)
    os.remove(os.path.join(step_dir, MANIFEST))


def _flip_a_byte(step_dir):  # same size: only the manifest's digest can tell
    path = largest_data_file(step_dir)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


CORRUPTIONS = {
    "truncated data file": (_truncate_data, r"has 10 bytes, \d+ were saved"),
    "truncated data file, no manifest": (_truncate_data_and_drop_manifest, "OUT_OF_RANGE"),
    "flipped byte": (_flip_a_byte, r"differs from the saved one \(SHA-256\)"),
    "missing _METADATA": (
        lambda d: os.remove(os.path.join(d, "state", "_METADATA")), "state/_METADATA is missing"),
    "missing meta": (
        lambda d: os.remove(os.path.join(d, "meta", "metadata")), "meta/metadata is missing"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_last_checkpoint_is_named_and_the_intact_best_of_its_step_restored(
    finished, copy, template, corruption, caplog
):
    damage, reason = CORRUPTIONS[corruption]
    bad = os.path.join(copy, "checkpoints", "last", "6")
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="sparsemixer_jax.training.state"):
        restored = restore_checkpoint(copy, template, set_aside=True)
    assert (restored.step, restored.kind) == (6, "best")
    assert restored.skipped and bad in restored.skipped[0]
    reference = read_last(finished[0], 6, template)
    jax.tree.map(np.testing.assert_array_equal, params_of(restored), params_of(reference))
    # One line naming the directory and the cause; no asyncio task tracebacks.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    named = [w for w in warnings if bad in w]
    assert len(named) == 1 and "\n" not in named[0], warnings
    assert re.search(reason, named[0]), named[0]
    assert not any("never retrieved" in r.getMessage() for r in caplog.records)
    # The bad one is set aside, not deleted; every best checkpoint is still there.
    assert os.path.isdir(os.path.join(copy, "checkpoints", "unreadable", "last-6"))
    assert steps_on_disk(copy, "best") == [3, 6] and steps_on_disk(copy, "last") == [3]


def test_deleting_the_last_checkpoint_resumes_from_best_and_keeps_everything(finished, copy):
    """A reported data loss: `rm -rf checkpoints/last/<newest>` then a rerun must not start from
    step 0, delete the best checkpoints and cut metrics.jsonl."""
    lines = read_lines(copy)
    shutil.rmtree(os.path.join(copy, "checkpoints", "last", "6"))
    # The reported command asked for fewer steps than the workdir holds: refused, nothing touched.
    with pytest.raises(training.ResumeError, match=r"train_steps=3 but .* step 6: set"):
        translation.train_and_evaluate(tiny(train_steps=3), copy)
    assert read_lines(copy) == lines and steps_on_disk(copy, "best") == [3, 6]
    results = translation.train_and_evaluate(tiny(), copy)
    assert results["valid_loss"] == finished[1]["valid_loss"]
    assert read_lines(copy) == lines
    assert steps_on_disk(copy, "best") == [3, 6]
    assert 6 in steps_on_disk(copy, "last")  # best/6 was copied to last: resumable from there


def test_without_any_last_checkpoint_the_run_resumes_from_best(finished, copy):
    lines = read_lines(copy)
    shutil.rmtree(os.path.join(copy, "checkpoints", "last"))
    results = translation.train_and_evaluate(tiny(train_steps=7), copy)
    records = [json.loads(line) for line in read_lines(copy)]
    assert [json.loads(line) for line in lines] == records[: len(lines)]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 8))
    assert results["steps"] == 7
    assert steps_on_disk(copy, "best") == [6, 7]  # KEEP_BEST = 2: step 7 retires step 3


def test_corrupt_newest_checkpoints_fall_back_one_interval_and_end_like_the_straight_run(
    finished, copy, template
):
    """last/6 and best/6 both bad: the run resumes from step 3, redoes 4..6 and ends with the
    parameters of the uninterrupted run (KEEP_LAST = 2 is what keeps step 3)."""
    _truncate_data(os.path.join(copy, "checkpoints", "last", "6"))
    os.remove(os.path.join(copy, "checkpoints", "best", "6", "meta", "metadata"))
    results = translation.train_and_evaluate(tiny(), copy)
    assert results["valid_loss"] == finished[1]["valid_loss"]
    assert steps_on_disk(copy, "best") == [3, 6]  # 6 recomputed; the bad one kept aside
    assert sorted(os.listdir(os.path.join(copy, "checkpoints", "unreadable"))) == [
        "best-6", "last-6"]
    steps = [json.loads(line)["step"] for line in read_lines(copy)
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 7))
    ours = read_last(copy, 6, template)
    reference = read_last(finished[0], 6, template)
    jax.tree.map(np.testing.assert_array_equal, params_of(ours), params_of(reference))


def test_when_no_checkpoint_is_readable_the_run_refuses_and_loses_nothing(copy):
    lines = read_lines(copy)
    for kind in ("last", "best"):
        for step in (3, 6):
            os.remove(os.path.join(copy, "checkpoints", kind, str(step), "state", "_METADATA"))
    with pytest.raises(training.ResumeError) as error:
        translation.train_and_evaluate(tiny(), copy)
    message = str(error.value)
    assert "\n" not in message and "fresh --workdir" in message
    assert os.path.join(copy, "checkpoints", "last", "6") in message
    assert read_lines(copy) == lines
    assert sorted(os.listdir(os.path.join(copy, "checkpoints", "unreadable"))) == [
        "best-3", "best-6", "last-3", "last-6"]


def test_manifest_detects_missing_and_changed_files(tmp_path):
    step_dir = tmp_path / "7"
    (step_dir / "state").mkdir(parents=True)
    (step_dir / "meta").mkdir()
    (step_dir / "state" / "_METADATA").write_text("{}")
    (step_dir / "meta" / "metadata").write_text("{}")
    (step_dir / "state" / "blob").write_bytes(b"abc")
    write_manifest(str(step_dir))
    check_manifest(str(step_dir))  # intact: no error
    (step_dir / "state" / "blob").write_bytes(b"abd")
    with pytest.raises(CheckpointError, match=r"state/blob differs"):
        check_manifest(str(step_dir))
    (step_dir / "state" / "blob").unlink()
    with pytest.raises(CheckpointError, match=r"state/blob is missing"):
        check_manifest(str(step_dir))


_KILL_DURING_SAVE = """
import os, signal, sys
from sparsemixer_jax.training import checkpoint
from sparsemixer_jax.tasks import translation
from tests import tiny_wmt_config

save = checkpoint.RunCheckpoints._save

def save_then_die(self, kind, step, state, meta):
    save(self, kind, step, state, meta)  # orbax writes in the background...
    if kind == "last" and step == 6:
        os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies mid-write

checkpoint.RunCheckpoints._save = save_then_die
config = tiny_wmt_config.get_config()
config.decode.test_bleu = False
translation.train_and_evaluate(config, sys.argv[1])
"""


def test_sigkill_during_a_checkpoint_save_then_rerun_resumes(finished, tmp_path, template):
    workdir = str(tmp_path / "killed")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    killed = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE, workdir], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    results = translation.train_and_evaluate(tiny(), workdir)
    assert results["valid_loss"] == finished[1]["valid_loss"]
    records = [json.loads(line) for line in read_lines(workdir)]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in records if "valid_loss" in r] == [3, 6]
    ours = read_last(workdir, 6, template)
    reference = read_last(finished[0], 6, template)
    jax.tree.map(np.testing.assert_array_equal, params_of(ours), params_of(reference))


# ------------------------------------------------ checkpoints written before the train state


def rewrite_in_the_layout_before_the_train_state(workdir, kind, step, template):
    """Replaces ``kind/step`` with what the code before the train state saved for this model:
    the state item a dict ``{"params", "opt_state"}`` (plus ``batch_stats`` for a model with
    layer state), the step in its meta only, with its manifest."""
    directory = step_dir(workdir, kind, step)
    check_manifest(directory)
    state, meta = read_checkpoint(directory, template, step)
    shutil.rmtree(directory)
    old = {"params": state.params, "opt_state": state.opt_state}
    if jax.tree.leaves(state.layer_state):
        old["batch_stats"] = state.layer_state
    checkpoints = RunCheckpoints(workdir)
    checkpoints._save(kind, step, old, meta)
    checkpoints.close()  # waits, and writes the manifest
    return old


def saved_top_level(directory):
    """The top-level names of the saved state, read from orbax's own file (its keys are the
    reprs of each leaf's path tuple)."""
    with open(os.path.join(directory, "state", "_METADATA")) as f:
        tree = json.load(f)["tree_metadata"]
    return sorted({ast.literal_eval(path)[0] for path in tree})


def test_a_workdir_written_before_the_train_state_resumes_and_ends_like_the_straight_run(
        finished, copy, template):
    """Its step-3 checkpoints rewritten in the earlier layout and the later ones removed: the
    run resumes from step 3, redoes 4..6, ends with the parameters of the uninterrupted run, and
    saves its new checkpoints in the train state's layout."""
    for kind in ("last", "best"):
        shutil.rmtree(step_dir(copy, kind, 6))
        rewrite_in_the_layout_before_the_train_state(copy, kind, 3, template)
    assert saved_top_level(step_dir(copy, "last", 3)) == ["opt_state", "params"]
    restored = restore_checkpoint(copy, template)
    assert isinstance(restored.state, TrainState) and int(restored.state.step) == 3
    results = translation.train_and_evaluate(tiny(), copy)
    assert results["valid_loss"] == finished[1]["valid_loss"]
    assert saved_top_level(step_dir(copy, "last", 6)) == sorted(
        ["step", "params", "layer_state", "opt_state"])
    ours, reference = read_last(copy, 6, template), read_last(finished[0], 6, template)
    jax.tree.map(np.testing.assert_array_equal, params_of(ours), params_of(reference))
    jax.tree.map(np.testing.assert_array_equal, ours.state, reference.state)


def test_an_earlier_layout_with_layer_state_is_restored_as_saved(tmp_path):
    """Default MoE's layer state was saved as ``batch_stats``: it comes back as the train
    state's ``layer_state``, with the parameters, the optimizer state and the meta's step."""
    config = tiny(**{"router.name": "default_moe"})
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    state = steps.init_state()
    # Distinct values, so that a swapped or re-initialised part would show.
    state = jax.tree.map(lambda a: a + 0.5 if a.dtype.kind == "f" else a, state)
    assert jax.tree.leaves(state.layer_state)
    workdir = str(tmp_path)
    checkpoints = RunCheckpoints(workdir)
    checkpoints.save_last(4, state, {"step": 4})
    checkpoints.close()
    old = rewrite_in_the_layout_before_the_train_state(workdir, "last", 4,
                                                        steps.abstract_state())
    assert "batch_stats" in old
    assert saved_top_level(step_dir(workdir, "last", 4)) == ["batch_stats", "opt_state",
                                                             "params"]
    restored = restore_checkpoint(workdir, steps.abstract_state(), "last")
    assert restored.step == 4 and int(restored.state.step) == 4 and restored.meta == {"step": 4}
    expected = state.replace(step=np.int32(4))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.state),
                 jax.tree.map(np.asarray, expected))


def test_a_checkpoint_of_neither_layout_is_refused_in_one_line_naming_its_items(
        tmp_path, template, caplog):
    workdir = str(tmp_path)
    checkpoints = RunCheckpoints(workdir)
    checkpoints.save_last(2, {"weights": np.ones(3, np.float32)}, {"step": 2})
    checkpoints.close()
    with pytest.raises(CheckpointError) as error:
        restore_checkpoint(workdir, template)
    message = str(error.value)
    assert "\n" not in message and "['weights']" in message and "not a checkpoint" in message
    assert step_dir(workdir, "last", 2) in message
    assert os.path.isdir(step_dir(workdir, "last", 2))  # a reader moves nothing
