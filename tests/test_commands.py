"""The README's commands write only under the git-ignored ``runs/`` of the checkout."""

import itertools
import os
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Flags that name what a command writes.
OUTPUT_FLAGS = ("--out", "--json", "--plot", "--workdir", "--root", "--diagnostics")


def _readme_commands() -> list[str]:
    """The ``python -m experiments...`` and ``bash experiments/...`` commands the README shows."""
    text = (REPO / "README.md").read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```bash\n(.*?)```", text, re.S)
    return [s for s in spans if re.search(r"(python -m|bash) experiments", s)]


def test_runs_is_ignored_by_git():
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/x.json"], cwd=REPO)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0


def test_every_readme_command_writes_under_runs():
    commands = _readme_commands()
    assert len(commands) > 10  # the quickstart and the experiments table
    for command in commands:
        words = command.replace("=", " ").split()
        for flag, value in itertools.pairwise(words):
            if flag in OUTPUT_FLAGS:
                assert value.startswith("runs/"), f"{command!r}: {flag} {value} is outside runs/"
        assert "OUT=" not in command or "OUT=runs/" in command, command


def test_gradient_accuracy_writes_its_json_and_plot_under_runs(tmp_path, monkeypatch):
    """The README runs it without flags: the JSON and the plot go to runs/, nothing else."""
    from experiments import gradient_accuracy

    monkeypatch.chdir(tmp_path)
    gradient_accuracy.main(["--num-problems", "2", "--num-experts", "3", "--num-scales", "3",
                            "--top-k"])
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    assert sorted(os.listdir(tmp_path / "runs")) == ["gradient_accuracy.json",
                                                     "gradient_accuracy.png"]


def test_benchmark_and_plot_default_to_runs():
    from experiments import benchmark, plot

    assert benchmark.parse_args([]).out == "runs/bench.json"
    source = pathlib.Path(plot.__file__).read_text()
    assert '"--out", default="runs/curves.png"' in source
