"""``configs/lm_sft.py``, the chat fine-tuning config: its schedule follows ``train_steps`` as
the command line sets it, and it validates on the held-out chat rows alone."""

import os
import shutil
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from sparsemixer_jax.tasks import check_config
from sparsemixer_jax.training.optim import learning_rate_schedule

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint with a chat template: the tiny Mixtral with the ChatML tokenizer."""
    path = tmp_path_factory.mktemp("sft") / "hf"
    shutil.copytree(os.path.join(DATA, "hf", "mixtral"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DATA, "chat", "chatml", name), path / name)
    return str(path)


def _run(checkpoint, monkeypatch, *overrides):
    """The run experiments.lm builds from ``--config configs/lm_sft.py`` and ``overrides``, the
    flags parsed as the command parses them (ml_collections reads the overrides from argv)."""
    argv = ["lm", f"--config={REPO}/configs/lm_sft.py", f"--config.init_from={checkpoint}",
            "--config.data.train=rows.jsonl", *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
    values(argv)
    return check_config(values.config)


def _decay_end(optim) -> int:
    """The first update after the peak whose learning rate is 0, counted from 1 (the schedule
    takes the count of updates done: update n is count n - 1)."""
    schedule = learning_rate_schedule(optim)
    return next(n for n in range(optim.warmup_steps + 1, 10_000)
                if float(schedule(n - 1)) == 0.0)


def test_train_steps_on_the_command_line_moves_the_schedule(checkpoint, monkeypatch):
    default = _run(checkpoint, monkeypatch)
    short = _run(checkpoint, monkeypatch, "--config.train_steps=48")
    assert (default.train_steps, _decay_end(default.optim)) == (240, 240)
    assert (short.train_steps, _decay_end(short.optim)) == (48, 48)
    assert short.optim.warmup_steps == 4 < default.optim.warmup_steps == 20
    assert (short.eval_every, short.checkpoint_every) == (12, 12)  # each quarter of the run
    # A schedule field given by itself keeps its value, and leaves train_steps alone.
    kept = _run(checkpoint, monkeypatch, "--config.optim.decay_steps=100",
                "--config.train_steps=48")
    assert (kept.train_steps, _decay_end(kept.optim)) == (48, 100)
    tiny = _run(checkpoint, monkeypatch, "--config.train_steps=1")
    assert (tiny.optim.warmup_steps, tiny.optim.decay_steps, tiny.eval_every) == (0, 1, 1)


def test_it_fine_tunes_on_chat_rows_and_validates_on_their_held_out_rows_alone(
        checkpoint, monkeypatch):
    run = _run(checkpoint, monkeypatch)
    data = run.task.data
    assert (data.format, data.wikitext, data.train_articles) == ("chat", "", 0)
    assert data.valid_articles > 0 and run.task.init_from == checkpoint
    assert run.optim.peak_lr < 3e-3  # below the quickstart's from-scratch peak
