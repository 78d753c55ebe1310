"""End-to-end tests of translation training: results, exact resume, CLI, translate, plot.

The loop itself (extension, SIGKILL, the non-finite stop, the mesh) is tested once with a
fake task in ``test_loop.py``; these keep what is the translation task's.

All runs use ``tests/tiny_wmt_config.py`` (one padded shape, so each step function compiles once
per process and the in-process runs share the compilations).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lab.studies.curves import plot_losses, read_run
from sparsemixer_jax import training
from sparsemixer_jax.data.sources import DataConfig, read_split
from sparsemixer_jax.data.translation import load_datasets
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.tasks import check_config, run_config, translate, translation
from sparsemixer_jax.training import cli, resume
from sparsemixer_jax.training.checkpoint import RunCheckpoints
from sparsemixer_jax.training.hosts import BatchPlacer
from sparsemixer_jax.training.logs import Progress
from sparsemixer_jax.training.optim import OptimSettings, learning_rate_schedule
from sparsemixer_jax.training.state import restore_checkpoint
from tests import kit
from tests.tiny_wmt_config import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The resume test every training task runs, here with this module's ``task`` and ``task_steps``.
test_extending_a_run_equals_the_uninterrupted_run = (
    kit.test_extending_a_run_equals_the_uninterrupted_run)


@pytest.fixture(scope="module")
def task():
    """Translation training for the shared ``straight_run`` fixture and resume test (tests/kit)."""
    return kit.Task("translation",
                    lambda workdir, **o: translation.train_and_evaluate(tiny(**o), workdir))


@pytest.fixture(scope="module")
def task_steps():
    """The steps of the tiny model: the template checkpoints are read into."""
    return training.build_steps(run_config(tiny()), tiny().data.vocab_size)


def check_resume_config(workdir, config):
    """The resumption check of ``config``'s run in ``workdir``."""
    resume.check_resume_config(workdir, run_config(config))


def test_straight_run_learns_and_writes_results(straight_run):
    workdir, results = straight_run
    assert results["steps"] == 6
    for key in ("bleu", "bleu_best", "valid_loss", "tokens_per_second", "config"):
        assert key in results
    with open(os.path.join(workdir, "results.json")) as f:
        on_disk = json.load(f)
    assert on_disk["valid_loss"] == results["valid_loss"]
    records = kit.read_metrics(workdir)
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == list(range(1, 7))
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0], losses  # it learns, even in six steps
    # The per-step median leaves out the first step's compilation, which the overall rate holds.
    rates = sorted(r["tokens_per_s"] for r in records if "loss" in r)
    assert results["tokens_per_second_median_step"] == pytest.approx((rates[2] + rates[3]) / 2)
    assert results["tokens_per_second_median_step"] > results["tokens_per_second"]
    moe = [r for r in records if "moe" in r]
    assert moe and "encoder/layer_0" in moe[0]["moe"]
    assert len(moe[0]["moe"]["encoder/layer_0"]["expert_fraction"]) == 2
    valid = [r for r in records if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6]
    assert os.path.exists(os.path.join(workdir, "translations_last.txt"))


@pytest.mark.slow  # fast counterparts: a SIGKILL during a save (test_checkpoint), exact resume
def test_sigkill_mid_run_then_resume(straight_run, tmp_path, task_steps, last_checkpoint):
    workdir = str(tmp_path / "killed")
    command = [sys.executable, "-m", "experiments.wmt", "--config", "tests/tiny_wmt_config.py",
               "--workdir", workdir, "--config.checkpoint_every=1"]
    # A fresh compilation cache: with a warm one the run could finish before it is killed.
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    last = os.path.join(workdir, "checkpoints", "last")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        done = [d for d in os.listdir(last) if d.isdigit()] if os.path.isdir(last) else []
        if done and max(int(d) for d in done) >= 2:
            break
        time.sleep(0.2)
    assert process.poll() is None, "run ended before it could be killed: " + (
        process.stderr.read().decode()[-2000:]
    )
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    killed_at = max(int(d) for d in os.listdir(last) if d.isdigit())
    assert 2 <= killed_at < 6

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    assert config["checkpoint_every"] == 1  # the command-line override reached the run
    params, meta = last_checkpoint(workdir, task_steps)
    expected, _ = last_checkpoint(straight_run[0], task_steps)
    assert meta["step"] == 6
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_config_errors_are_caught_before_compiling(tmp_path):
    cases = [
        ({"router.name": "top2"}, "router.name"),
        ({"model.emb_dim": 17}, "not divisible by num_heads"),
        ({"model.dropout": 1.0}, "model.dropout"),
        ({"train_steps": 0}, "train_steps"),
        ({"model.compute_dtype": "float16"}, "compute_dtype"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            check_config(tiny(**overrides))
    with pytest.raises(ValueError, match=r"not divisible by config\.mesh\.expert"):
        check_config(tiny(**{"mesh.data": 1, "mesh.expert": 4,
                                        "model.num_experts": 6}))
    with pytest.raises(ValueError, match="devices"):
        sharding.device_mesh(sharding.MeshConfig(data=16))


def test_rerunning_a_finished_run_keeps_its_results(straight_run):
    """Nothing is trained, decoded or rewritten: the results are those the run measured."""
    workdir, results = straight_run
    paths = [os.path.join(workdir, name) for name in ("results.json", "translations_last.txt")]
    before = [os.stat(p).st_mtime_ns for p in paths]
    again = translation.train_and_evaluate(tiny(), workdir)
    assert again == json.loads(json.dumps(results))
    assert again["tokens_per_second"] and again["train_time_s"] > 0
    assert [os.stat(p).st_mtime_ns for p in paths] == before


def test_a_bad_config_writes_nothing(tmp_path):
    """The validator runs before any data is read or file written."""
    workdir = tmp_path / "never"
    with pytest.raises(ValueError, match=r"router\.top_k=9 is larger than .*num_experts=2"):
        translation.train_and_evaluate(tiny(**{"router.top_k": 9}), str(workdir))
    assert not workdir.exists()


def test_resuming_with_a_different_model_is_refused(straight_run):
    with pytest.raises(ValueError, match=r"different config\.model"):
        translation.train_and_evaluate(tiny(**{"model.emb_dim": 32}), straight_run[0])


def test_resume_after_a_kill_between_the_best_and_the_last_save(straight_run, tmp_path,
                                                                task_steps, last_checkpoint):
    """Step 6 saved its best checkpoint but not its last one: the rerun resumes from best/6 (a
    best checkpoint holds the whole training state) and ends like the straight run."""
    workdir = str(tmp_path / "copy")
    shutil.copytree(straight_run[0], workdir)
    checkpoints = RunCheckpoints(workdir)
    assert checkpoints.best.all_steps() == [3, 6] and checkpoints.last.all_steps() == [3, 6]
    checkpoints.close()
    shutil.rmtree(os.path.join(workdir, "checkpoints", "last", "6"))
    results = translation.train_and_evaluate(tiny(), workdir)
    assert results["valid_loss"] == straight_run[1]["valid_loss"]
    assert results["bleu_best"] == straight_run[1]["bleu_best"]
    params, meta = last_checkpoint(workdir, task_steps)
    assert meta["step"] == 6
    expected, _ = last_checkpoint(straight_run[0], task_steps)
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_rerun_after_a_config_error_is_not_refused_and_shrinking_a_run_is(straight_run, tmp_path):
    workdir = str(tmp_path / "fixed")
    with pytest.raises(ValueError, match="vocab_size"):
        translation.train_and_evaluate(tiny(**{"data.vocab_size": 100_000}), workdir)
    # Nothing was trained, so the corrected config is a fresh start, not a "different config".
    translation.train_and_evaluate(tiny(**{"train_steps": 3, "decode.test_bleu": False}), workdir)
    with pytest.raises(ValueError, match=r"train_steps=2 but .* step 3"):
        translation.train_and_evaluate(tiny(train_steps=2), workdir)


def test_vocabulary_of_an_untrained_workdir_is_retrained_when_the_data_settings_change(tmp_path):
    workdir = str(tmp_path)
    vocabulary = tmp_path / "spm.model"
    with open(tmp_path / "config.json", "w") as f:
        f.write(tiny().to_json())
    vocabulary.write_text("cached")
    check_resume_config(workdir, tiny(**{"train_steps": 9}))  # data unchanged: kept
    assert vocabulary.exists()
    check_resume_config(workdir, tiny(**{"data.vocab_size": 100}))
    assert not vocabulary.exists()


def test_learning_rate_schedule_is_inverse_sqrt():
    config = tiny(**{"optim.warmup_steps": 100, "optim.peak_lr": 1e-3, "optim.init_lr": 1e-7})
    lr = learning_rate_schedule(OptimSettings.from_config(config.optim))
    np.testing.assert_allclose(lr(0), 1e-7, rtol=1e-5)
    np.testing.assert_allclose(lr(50), 1e-7 + (1e-3 - 1e-7) / 2, rtol=1e-5)
    np.testing.assert_allclose(lr(100), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(lr(400), 5e-4, rtol=1e-5)


def test_label_smoothed_loss_hand_computed():
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]]], np.float32))
    targets = np.array([[1, 0]])  # second position is padding
    smoothed, nll, tokens = translation.token_losses(logits, targets, 0.1)
    expected_smooth = -np.mean(np.log([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(nll, -np.log(0.25), rtol=1e-6)
    np.testing.assert_allclose(smoothed, 0.9 * -np.log(0.25) + 0.1 * expected_smooth, rtol=1e-6)
    assert float(tokens) == 1.0


def test_translate_and_plot(straight_run, tmp_path):
    workdir, _ = straight_run
    lines = ["ta gabapa tarano", "mo numu robano dari"]
    out = translate.translate_lines(workdir, lines, batch_size=4)
    assert len(out) == 2 and all(isinstance(o, str) for o in out)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        translate.translate_lines(str(tmp_path), lines)
    # stdin is split at newlines only: a stray \r or U+2028 inside a line keeps it whole.
    assert translate.split_lines("a\rb\r\nc\u2028d\n\ne\n".encode()) == [
        "a\rb", "c\u2028d", "", "e"]
    assert translate.split_lines(b"") == [] and translate.split_lines(b"x") == ["x"]
    png = tmp_path / "curves.png"
    plot_losses([read_run(workdir), read_run(workdir)], str(png))
    assert png.stat().st_size > 10_000


@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
def test_training_on_an_expert_mesh_matches_one_device(tmp_path, task_steps, last_checkpoint):
    """The whole model on a (data 2, expert 2) mesh: batch split over all four devices, experts
    over two, tokens exchanged with all_to_all, under XLA's other elementwise math (a child
    process). Both runs with Adam in its linear regime; losses and parameters follow the
    one-device run to the rounding :func:`tests.kit.assert_same_training` derives, and the
    test-set beam search on the mesh gives the translations of a one-device beam search."""
    reference, workdir = str(tmp_path / "one"), str(tmp_path / "mesh")
    run = {"train_steps": 3, "eval_every": 3, "checkpoint_every": 3, **kit.LINEAR_ADAM}
    translation.train_and_evaluate(tiny(**run), reference)
    os.makedirs(workdir)
    shutil.copy(os.path.join(reference, "spm.model"), workdir)  # the same vocabulary
    mesh = {"mesh.data": 2, "mesh.expert": 2}
    kit.train_with_other_math("experiments.wmt", "tests/tiny_wmt_config.py", workdir,
                              {**run, **mesh})
    # 1,024 token positions an update, more than 2 layers x the vocab (128).
    kit.assert_same_training(workdir, reference, 1024, lambda w: last_checkpoint(w, task_steps))

    config = tiny(**run, **mesh)
    state = restore_checkpoint(workdir, task_steps.abstract_state(), "last").state
    data = load_datasets(DataConfig.from_config(config), workdir, batch_multiple=4)  # mesh batches
    texts = translation.translate_batches(
        task_steps.model(state), data.test, data.tokenizer,
        len(data.test_sources), config.decode, BatchPlacer(None, ("inputs", "targets")),
    )
    with open(os.path.join(workdir, "translations_last.txt")) as f:
        assert f.read().splitlines() == texts


def test_resume_refusal_names_every_changed_field_and_accepts_equivalent_meshes(tmp_path):
    workdir = str(tmp_path)
    os.makedirs(tmp_path / "checkpoints" / "last" / "3")  # a trained run
    saved = tiny(**{"mesh.data": jax.device_count(), "mesh.expert": 1})
    with open(tmp_path / "config.json", "w") as f:
        f.write(saved.to_json())
    # mesh.data = -1 means every device: the same mesh as the saved explicit count.
    check_resume_config(workdir, tiny(**{"mesh.data": -1, "mesh.expert": 1,
                                                "train_steps": 9}))
    changed = tiny(**{"mesh.data": -1, "mesh.expert": 1, "model.emb_dim": 32,
                      "optim.peak_lr": 1.0})
    with pytest.raises(training.ResumeError) as error:
        check_resume_config(workdir, changed)
    message = str(error.value)
    assert "config.model.emb_dim (saved 16, now 32)" in message
    assert "config.optim.peak_lr (saved 0.003, now 1.0)" in message
    assert "mesh" not in message and "\n" not in message and "fresh --workdir" in message


def test_resume_accepts_a_config_saved_before_later_fields_existed(tmp_path):
    """A workdir saved before router.top_k / runtime existed resumes under today's defaults,
    may change speed-only settings, and is refused a new value of a field that changes training."""
    os.makedirs(tmp_path / "checkpoints" / "last" / "3")
    saved = json.loads(tiny().to_json())
    del saved["router"]["top_k"]
    del saved["runtime"]
    saved["model"].pop("attention_impl")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    check_resume_config(str(tmp_path), tiny(**{"runtime.deterministic": True,
                                                       "runtime.matmul_precision": "highest"}))
    with pytest.raises(training.ResumeError, match=r"config\.router\.top_k \(saved 1, now 2\)"):
        check_resume_config(str(tmp_path), tiny(**{"router.top_k": 2}))
    with pytest.raises(training.ResumeError, match=r"config\.runtime\.rng_impl"):
        check_resume_config(str(tmp_path), tiny(**{"runtime.rng_impl": "rbg"}))


def test_translate_errors_name_the_missing_file_or_the_bad_flag(straight_run, tmp_path):
    workdir = tmp_path / "untrained"
    workdir.mkdir()
    shutil.copy(os.path.join(straight_run[0], "config.json"), workdir)
    with pytest.raises(FileNotFoundError, match=r"spm\.model not found: .*experiments\.wmt"):
        translate.translate_lines(str(workdir), ["ta"])
    shutil.copy(os.path.join(straight_run[0], "spm.model"), workdir)
    with pytest.raises(FileNotFoundError, match=r"no best checkpoint in .*--checkpoint last"):
        translate.translate_lines(str(workdir), ["ta"])
    with pytest.raises(ValueError, match=r"--beam_size must be >= 1, got 0"):
        translate.translate_lines(straight_run[0], ["ta"], beam_size=0)
    with pytest.raises(ValueError, match=r"--batch_size must be >= 1, got 0"):
        translate.translate_lines(straight_run[0], ["ta"], batch_size=0)


def test_translate_cli_prints_translations_without_library_info_logs(straight_run):
    run = subprocess.run(
        [sys.executable, "-m", "experiments.translate", "--workdir", straight_run[0],
         "--batch_size=2"], input="ta gabapa tarano\n", cwd=REPO, capture_output=True,
        text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.stdout.splitlines()) == 1
    info = [line for line in run.stderr.splitlines() if line.startswith("I")]
    assert not info, info[:5]  # orbax announced its restore in ~30 INFO lines


def test_progress_eta_leaves_out_compilation_and_elapsed_time_never_runs_backwards():
    """A 60 s compilation then steps of 0.5 s: the rate shown is 2 steps/s, not the 1/60 step/s
    a smoothed rate would carry for many refreshes; the elapsed time is the wall time. Resumed at
    step 100 of 200, the steps before this process count for neither rate nor elapsed time."""
    clock = [0.0]
    progress = Progress(total=200, initial=100, clock=lambda: clock[0], enabled=False)
    clock[0] = 60.0  # the first step compiles
    progress.advance(compiled=True)
    assert progress.rate is None and progress.postfix == "01:00"
    shown = []
    for _ in range(20):
        clock[0] += 0.5
        progress.advance(compiled=False)
        shown.append(progress.postfix.split(",")[0])
    assert progress.rate == pytest.approx(2.0)
    assert shown == sorted(shown) and shown[-1] == "01:10"  # 60 s + 20 x 0.5 s, never back
    assert progress.postfix == "01:10, 2.00 step/s, 00:39 left"  # 79 steps to go at 2 step/s
    progress.close()


def test_quickstart_hint_names_the_generated_language_and_a_test_line(tmp_path):
    config = tiny()
    hint = cli.try_it_hint(config, str(tmp_path))
    first_test_source = read_split(DataConfig.from_config(config), "test")[0][0]
    assert "generated language" in hint and first_test_source in hint
    assert f"python -m experiments.translate --workdir {tmp_path}" in hint
    config.data.source = "text"
    assert cli.try_it_hint(config, str(tmp_path)) is None


def test_unknown_config_field_is_one_line_with_close_matches():
    argv = ["wmt", "--config", "configs/quickstart.py", "--workdir", "/tmp/unused"]
    assert cli.unknown_config_field([*argv, "--config.model.emb_dim=8"]) is None
    message = cli.unknown_config_field([*argv, "--config.model.emb_dimm=8"])
    assert message == ("--config.model.emb_dimm: config.model has no field 'emb_dimm'; did you "
                       "mean config.model.emb_dim, config.model.mlp_dim?")
    run = subprocess.run([sys.executable, "-m", "experiments.wmt", *argv[1:],
                          "--config.model.foo=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --config.model.foo: config.model has no field 'foo'; its fields are: "), lines
