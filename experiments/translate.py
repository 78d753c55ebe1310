"""Translate stdin with a trained run: one source sentence per line in, one translation out.

    echo "A man is riding a bike." | python -m experiments.translate --workdir runs/multi30k_n4

Uses the run's saved config, vocabulary and its best checkpoint (``--checkpoint last`` for the
last one); beam size and length penalty default to the run's ``config.decode``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from absl import app, flags

from experiments import cli

flags.DEFINE_string("workdir", None, "A workdir written by experiments.wmt.")
flags.DEFINE_enum("checkpoint", "best", ["best", "last"], "Which checkpoint to use.")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the run's decode.beam_size).",
                     lower_bound=1)
flags.DEFINE_float("length_penalty", None, "GNMT alpha (default: the run's decode.length_penalty).")
flags.DEFINE_integer("batch_size", 64, "Sentences per beam-search batch.", lower_bound=1)
flags.mark_flag_as_required("workdir")


def translate_lines(workdir: str, lines: list[str], *, checkpoint: str = "best",
                    beam_size: int | None = None, length_penalty: float | None = None,
                    batch_size: int = 64) -> list[str]:
    """Translations of ``lines`` (in order) with the run in ``workdir``."""
    import numpy as np

    from sparsemixer_jax import config as config_schema
    from sparsemixer_jax import decode
    from sparsemixer_jax.checkpoint import CheckpointError, RunCheckpoints
    from sparsemixer_jax.data.tokenizer import Tokenizer
    from sparsemixer_jax.tasks import translation

    if batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    if beam_size is not None and beam_size < 1:
        raise ValueError(f"--beam_size must be >= 1, got {beam_size}")
    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(
            f"{config_path} not found: is {workdir} a workdir of experiments.wmt?"
        )
    vocabulary = os.path.join(workdir, "spm.model")
    if not os.path.exists(vocabulary):
        raise FileNotFoundError(
            f"{vocabulary} not found: the run in {workdir} stopped before it trained its "
            "vocabulary; run experiments.wmt on this workdir first"
        )
    checkpoints = RunCheckpoints(workdir)
    steps_on_disk = sorted(checkpoints.manager(checkpoint).all_steps(), reverse=True)
    if not steps_on_disk:
        checkpoints.close()
        other = "last" if checkpoint == "best" else "best"
        raise FileNotFoundError(
            f"no {checkpoint} checkpoint in {os.path.join(checkpoints.root, checkpoint)}: "
            f"try --checkpoint {other}, or train first (python -m experiments.wmt --workdir "
            f"{workdir} ...)"
        )
    with open(config_path) as f:
        config = config_schema.with_defaults(json.load(f))
    if config_schema.task_of(config) != "translation":
        raise ValueError(f"{workdir} holds a {config_schema.task_of(config)} run, not a "
                         "translation run (experiments.wmt)")
    tokenizer = Tokenizer(vocabulary)
    task = translation.TranslationTask()
    steps = translation.make_steps(task.build_model(config, tokenizer.vocab_size, None), config)
    template = {"params": steps.params, "opt_state": steps.init_opt(steps.params)}
    restored, failures = None, []
    for step in steps_on_disk:  # newest first; an unreadable one is named and skipped
        try:
            restored = checkpoints.restore_checked(checkpoint, step, template)
            break
        except CheckpointError as e:
            failures.append(str(e))
            logging.warning("unreadable checkpoint, trying an older one: %s", e)
    checkpoints.close()
    if restored is None:
        raise CheckpointError(f"no readable {checkpoint} checkpoint: {'; '.join(failures)}")
    model = steps.model(restored.state["params"])

    encoded = [[*tokenizer.encode(line.strip()), tokenizer.eos_id] for line in lines]
    order = sorted(range(len(lines)), key=lambda i: len(encoded[i]))  # similar lengths together
    outputs = [""] * len(lines)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        # Pad the length to a multiple of 16 and the batch to batch_size: few compilations.
        length = -(-max(len(encoded[i]) for i in rows) // 16) * 16
        inputs = np.zeros((batch_size, length), np.int32)
        for r, i in enumerate(rows):
            inputs[r, : len(encoded[i])] = encoded[i]
        seqs, _ = decode.beam_search_model(
            model, inputs, eos_id=tokenizer.eos_id,
            beam_size=int(config.decode.beam_size) if beam_size is None else beam_size,
            alpha=config.decode.length_penalty if length_penalty is None else length_penalty,
            max_extra_len=int(config.decode.max_extra_len),
        )
        best = np.asarray(seqs[:, 0])
        for r, i in enumerate(rows):
            outputs[i] = tokenizer.decode(best[r].tolist())
    return outputs


def split_lines(data: bytes) -> list[str]:
    """UTF-8 input split at ``\n`` (a ``\r\n`` ending counts as one) and nowhere else.

    ``str.splitlines()`` would also split at a stray ``\r``, ``\x0c`` or U+2028 inside a
    sentence and shift every later translation against its source.
    """
    text = data.decode("utf-8")
    if not text:
        return []
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from sparsemixer_jax.checkpoint import CheckpointError

    cli.quiet_libraries()
    f = flags.FLAGS
    lines = split_lines(sys.stdin.buffer.read())
    try:
        translations = translate_lines(
            f.workdir, lines, checkpoint=f.checkpoint, beam_size=f.beam_size,
            length_penalty=f.length_penalty, batch_size=f.batch_size,
        )
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        if f.verbosity >= 1:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for line in translations:
        print(line)


if __name__ == "__main__":
    app.run(main)
