"""ELECTRA-style pretraining of a (Switch / Switch+SparseMixer / dense) encoder.

    python -m experiments.pretrain --config configs/electra_smoke.py --workdir runs/electra_smoke
    python -m experiments.pretrain --config configs/electra.py:n4 --workdir runs/electra_n4
    python -m experiments.pretrain --config configs/electra_small.py \
        --config.router.name=switch --workdir runs/electra_small_switch

Rerunning the same command on the same workdir resumes from its last checkpoint. Multi-process
launches work as for experiments/wmt.py.
"""

from __future__ import annotations

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
    from sparsemixer_jax.tasks import pretraining

    cli.run_training(pretraining.pretrain, flags.FLAGS.config, flags.FLAGS.workdir,
                     ("steps", "valid_loss", "valid_mlm_loss", "valid_mlm_accuracy",
                      "valid_disc_loss", "valid_disc_accuracy", "best_valid_loss",
                      "tokens_per_second"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main, flags_parser=cli.parse_flags)
