"""Commands start quietly where accelerator plugins are installed but no accelerator is present
(``requirements-compile.txt`` on a laptop or a CI runner), and keep the platforms a user chose."""

import importlib.util
import os
import subprocess
import sys

import pytest

from sparsemixer_jax.training import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_environment() -> dict[str, str]:
    """This process's environment without what the test set-up adds to quiet JAX (conftest.py):
    a command here starts as it does for a user who set nothing."""
    env = dict(os.environ, PYTHONPATH=REPO)
    for name in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        env.pop(name, None)
    return env


def test_a_command_with_the_compile_plugins_and_no_accelerator_prints_no_traceback(tmp_path):
    if importlib.util.find_spec("jax_plugins") is None and not importlib.util.find_spec("libtpu"):
        pytest.skip("no accelerator plugin installed (pip install -r requirements-compile.txt)")
    if cli._accelerator_visible():
        pytest.skip("an accelerator is present: its plugin's own start-up checks are meant to run")
    # A training command starts JAX's backend before it reads its data, and a data directory that
    # does not exist then stops it at once with one line.
    missing = tmp_path / "no_data"
    run = subprocess.run(
        [sys.executable, "-m", "experiments.wmt", "--config", "tests/tiny_wmt_config.py",
         "--workdir", str(tmp_path / "run"), "--config.data.source=text",
         f"--config.data.dir={missing}"],
        cwd=REPO, env=_user_environment(), capture_output=True, text=True, timeout=300)
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"error: no text file for prefix 'train', language 'en': tried {missing}/train.en and "
        f"{missing}/train.en.gz"]


def test_platforms_a_user_chose_are_kept():
    """``JAX_PLATFORMS=cuda`` (a GPU user's setting) reaches JAX unchanged through the entry
    points' start-up; with nothing chosen and no accelerator, JAX gets the CPU alone."""
    show = [sys.executable, "-c", "import experiments, jax; print(jax.config.jax_platforms)"]
    env = _user_environment()
    chosen = subprocess.run(show, cwd=REPO, env=dict(env, JAX_PLATFORMS="cuda"),
                            capture_output=True, text=True, timeout=120, check=True)
    assert chosen.stdout.split() == ["cuda"]
    if not cli._accelerator_visible():
        unset = subprocess.run(show, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=120, check=True)
        expected = "cpu" if all(p.startswith(cli._PROBED_PLUGINS)
                                for p in cli._installed_plugins()) else "None"
        assert unset.stdout.split() == [expected]


@pytest.mark.parametrize("accelerator, plugins, changed", [
    (False, ["xla_cuda13"], True),
    (False, [], True),
    (True, ["xla_cuda13"], False),  # a GPU or TPU user: JAX chooses, the plugin checks its libs
    (False, ["xla_cuda13", "a_vendor_plugin"], False),  # hardware the probes cannot see
])
def test_cpu_only_where_no_accelerator_and_no_unprobed_plugin(monkeypatch, accelerator, plugins,
                                                              changed):
    import jax

    updates = []
    monkeypatch.setattr(cli, "_platforms_chosen", lambda: False)
    monkeypatch.setattr(cli, "_accelerator_visible", lambda: accelerator)
    monkeypatch.setattr(cli, "_installed_plugins", lambda: plugins)
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    assert cli.cpu_only_where_no_accelerator() is changed
    assert updates == ([("jax_platforms", "cpu")] if changed else [])
