"""Train and evaluate a Switch / Switch+SparseMixer Transformer on a translation task.

    python -m experiments.wmt --config configs/wmt_n4.py --workdir runs/wmt_n4
    python -m experiments.wmt --config configs/quickstart.py --config.router.name=switch \
        --workdir runs/quickstart_switch

Rerunning the same command on the same workdir resumes from its last checkpoint. Compiled steps
are cached in ``~/.cache/sparsemixer_jax/xla`` (set ``JAX_COMPILATION_CACHE_DIR`` to move it).

Several processes (a TPU pod, GPU hosts under SLURM or Open MPI, or any launcher that sets
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``): the same command on
every host calls ``jax.distributed.initialize()`` first; process 0 writes logs and results.
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
    import jax

    from sparsemixer_jax.tasks import translation

    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    cli.run_training(translation.train_and_evaluate, config, workdir,
                     ("steps", "valid_loss", "best_valid_loss", "bleu", "bleu_best",
                      "tokenized_bleu", "tokens_per_second"))
    hint = cli.try_it_hint(config, workdir) if jax.process_index() == 0 else None
    if hint:
        print(hint)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main, flags_parser=cli.parse_flags)
