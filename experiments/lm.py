"""Decoder-only MoE language models: from scratch, or fine-tuning a Hugging Face checkpoint.

    python -m experiments.lm --config configs/lm_quickstart.py --workdir runs/lm_quickstart
    python -m experiments.lm --config configs/lm_quickstart.py \
        --config.init_from=path/to/hf_checkpoint --workdir runs/lm_finetune
    python -m experiments.lm --config configs/lm_sft.py \
        --config.init_from=path/to/hf_checkpoint --config.data.train=FILE.jsonl \
        --config.train_steps=1000 --workdir runs/sft
    python -m experiments.lm_export --workdir runs/lm_quickstart --out runs/lm_quickstart_hf

Rerunning the same command on the same workdir resumes from its last checkpoint. docs/lm.md
describes the data, the metrics and the checkpoints.
"""

from __future__ import annotations

import functools
import logging

from absl import app, flags
from ml_collections import config_flags

from sparsemixer_jax.training import cli

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from sparsemixer_jax.tasks import language_model

    # The fields set on the command line: a fine-tuning run refuses those it would ignore.
    given = tuple(config_flags.get_override_values(flags.FLAGS["config"]))
    results = cli.run_training(
        functools.partial(language_model.train_lm, given=given), flags.FLAGS.config,
        flags.FLAGS.workdir,
        ("steps", "valid_ppl", "unigram_ppl", "valid_bits_per_byte", "wikitext_valid_ppl",
         "wikitext_test_ppl", "tokens_per_second"))
    for sample in results.get("samples", ()):
        print("sample:", sample)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main, flags_parser=cli.parse_flags)
