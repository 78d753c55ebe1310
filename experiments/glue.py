"""Fine-tune a pretrained (ELECTRA-style) discriminator on GLUE tasks with the paper's grid search.

    python -m experiments.glue --config configs/glue.py --pretrained runs/electra_n4 --glue_task rte
    python -m experiments.glue --config configs/glue.py --pretrained runs/electra_n4 --glue_task all
    python -m experiments.glue --config configs/glue_smoke.py --pretrained runs/electra_smoke \
        --glue_task rte,mrpc --workdir runs/electra_smoke/glue_smoke

``--glue_task`` takes GLUE task names (any case; ``sst2`` or ``SST-2``), comma-separated, or
``all`` for every task in ``config.glue_dir``; ``--task``, its earlier name, is still read (a
GLUE task is not ``config.task``, the kind of run). Results go to ``--workdir`` (default
``{pretrained}/glue``): ``{task}/points/*.json`` per grid point as it finishes,
``{task}/results.json`` (the best point), ``results.json`` (every task there). The final
(``last``) pretraining checkpoint is fine-tuned unless ``--checkpoint best``. Rerunning the
command skips finished grid points made from the same checkpoint and refuses to mix in another.
``--skip-bad-rows`` leaves malformed GLUE rows out (counted per file) instead of stopping at the
first. Tables: ``python -m experiments.glue_table``.
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from ml_collections import config_flags

from sparsemixer_jax.training import cli

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("pretrained", None, "Workdir of a pretraining run (experiments.pretrain).")
flags.DEFINE_list("glue_task", None, "GLUE task name(s), comma-separated, or 'all'.")
flags.DEFINE_alias("task", "glue_task")  # the flag's earlier name
flags.DEFINE_string("workdir", None, "Where results go; default {pretrained}/glue.")
flags.DEFINE_enum("checkpoint", "last", ["last", "best"],
                  "Which pretraining checkpoint: the final model (the paper's) or the lowest "
                  "validation loss.")
flags.DEFINE_bool("skip_bad_rows", False,
                  "Leave malformed GLUE rows out (counted and reported per file) instead of "
                  "stopping at the first one (file:line).")
flags.mark_flags_as_required(["config", "pretrained", "glue_task"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.enable_compilation_cache()
    from lab.studies.glue_table import summary_table
    from sparsemixer_jax.tasks import finetuning

    cli.quiet_libraries()
    fl = flags.FLAGS
    workdir = fl.workdir or os.path.join(fl.pretrained, "glue")
    # A bad --pretrained, --glue_task or a refused rerun: one "error:" line, exit code 2.
    summary = cli.train_or_exit(
        lambda config, out: finetuning.run_tasks(config, fl.pretrained, fl.glue_task, out,
                                                 checkpoint=fl.checkpoint,
                                                 skip_bad_rows=fl.skip_bad_rows),
        fl.config, workdir)
    print(summary_table(summary))
    print(f"results: {os.path.join(workdir, 'results.json')}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main, flags_parser=cli.parse_flags)
