"""The README's commands write only under the git-ignored ``runs/`` of the checkout, and refuse
an output they cannot write in one line."""

import itertools
import os
import pathlib
import re
import subprocess
import sys

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


def test_lm_export_to_an_existing_file_is_one_line_before_anything_is_read(tmp_path):
    """``--out`` naming a file: exit code 2 and one line naming it, no traceback, the file kept
    (the workdir does not exist: the output is checked first)."""
    out = tmp_path / "model"
    out.write_text("kept")
    run = subprocess.run([sys.executable, "-m", "experiments.lm_export", "--workdir",
                          str(tmp_path / "run"), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr == f"error: {out} exists and is not a directory: an export writes a " \
        "directory (config.json, safetensors, tokenizer files); name a new or empty one\n"
    assert out.read_text() == "kept"
