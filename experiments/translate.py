"""Translate stdin with a trained run: one source sentence per line in, one translation out.

    echo "A man is riding a bike." | python -m experiments.translate --workdir runs/multi30k_n4

Uses the run's saved config, vocabulary and its best checkpoint (``--checkpoint last`` for the
last one); beam size and length penalty default to the run's ``config.decode``.
"""

from __future__ import annotations

import sys

from absl import app, flags

from sparsemixer_jax.training import cli

flags.DEFINE_string("workdir", None, "A workdir written by experiments.wmt.")
flags.DEFINE_enum("checkpoint", "best", ["best", "last"], "Which checkpoint to use.")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the run's decode.beam_size).",
                     lower_bound=1)
flags.DEFINE_float("length_penalty", None, "GNMT alpha (default: the run's decode.length_penalty).")
flags.DEFINE_integer("batch_size", 64, "Sentences per beam-search batch.", lower_bound=1)
flags.mark_flag_as_required("workdir")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from sparsemixer_jax.tasks.translate import split_lines, translate_lines
    from sparsemixer_jax.training.checkpoint import CheckpointError

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
