"""ELECTRA-style pretraining of a (Switch / Switch+SparseMixer / dense) encoder.

    python -m experiments.pretrain --config configs/electra_smoke.py --workdir runs/electra_smoke
    python -m experiments.pretrain --config configs/electra_n4.py --workdir runs/electra_n4
    python -m experiments.pretrain --config configs/electra_small.py \
        --config.router.name=switch --workdir runs/electra_small_switch

Rerunning the same command on the same workdir resumes from its last checkpoint. Multi-process
launches work as for experiments/wmt.py.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags

# Importing the translation experiment also defines the --config and --workdir flags (a config
# file, required; a directory, required): this entry point takes the same two.
from experiments.wmt import enable_compilation_cache, initialize_distributed


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    initialize_distributed()
    import jax

    enable_compilation_cache()

    from sparsemixer_jax import pretrain

    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
    if jax.process_index() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        results = pretrain.pretrain(flags.FLAGS.config, flags.FLAGS.workdir)
    except pretrain.TrainingDiverged as err:
        print(f"training stopped: {err}", file=sys.stderr)
        sys.exit(1)
    if jax.process_index() == 0:
        keys = ("steps", "valid_loss", "valid_mlm_loss", "valid_mlm_accuracy", "valid_disc_loss",
                "valid_disc_accuracy", "best_valid_loss", "tokens_per_second")
        print("results:", {k: results.get(k) for k in keys})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main)
