"""Convergence study: Switch, SparseMixer, their ablations, DenseMixer, Default MoE and the dense
baseline, several seeds.

    python -m experiments.compare --root /tmp/compare --experts 4 --seeds 0 1 2 \
        --out-json docs/compare.json --out-md docs/compare.md --plot docs/convergence.png

Every run trains ``configs/multi30k_compare.py`` (override with ``--config``) with the arm's
fields and the seed set. The arms are ``--arms`` if given, else those of ``--study`` (``main``
by default: Switch and SparseMixer for each of ``--experts``, and dense); arm names and target
arms: :mod:`lab.studies.arms`. ``--parallel K`` trains K runs at once in
subprocesses; ``--delete-checkpoints``/``--compact``, ``--pack FILE.tar.gz`` and
``--stop-launching-after MIN`` serve a study spread over several machines
(:mod:`lab.studies.runner`). Rerunning skips finished and diverged runs and resumes
unfinished ones. ``--summarize-only`` writes the tables (JSON, markdown), the loss curves and the
router-diagnostics figure (``--plot-router``) without training; they go to ``--root`` unless
``--out-json``, ``--out-md``, ``--plot`` say otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from lab.studies.arms import STUDIES, parse_arm, study_arms
from lab.studies.runner import (
    StudyOptions,
    pack,
    run_all,
    summarize_and_write,
    train_one,
)

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/multi30k_compare.py")
    parser.add_argument("--root", default="/tmp/compare", help="one workdir per run under it")
    parser.add_argument("--experts", type=int, nargs="+", default=[4])
    parser.add_argument("--study", nargs="+", default=["main"], choices=sorted(STUDIES),
                        help="named groups of arms (lab.studies.arms.STUDIES)")
    parser.add_argument("--arms", nargs="+", help="explicit arm names (instead of --study)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="train_steps (default: config)")
    parser.add_argument("--no-dense", action="store_true", help="leave out the dense arm")
    parser.add_argument("--override", action="append", default=[],
                        help="FIELD=VALUE applied to every run's config, e.g. model.emb_dim=64")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (subprocesses)")
    parser.add_argument("--stop-launching-after", type=float, metavar="MIN",
                        help="start no run after this many minutes")
    parser.add_argument("--delete-checkpoints", action="store_true",
                        help="delete a run's checkpoints once it is done")
    parser.add_argument("--compact", action="store_true",
                        help="keep only the small files of a finished run (implies "
                             "--delete-checkpoints)")
    parser.add_argument("--pack", metavar="FILE.tar.gz",
                        help="after training, pack the small files of the finished runs")
    parser.add_argument("--run-one", nargs=2, metavar=("ARM", "SEED"),
                        help="train one run in this process (what --parallel launches)")
    parser.add_argument("--out-json", help="summary JSON (default: ROOT/compare.json)")
    parser.add_argument("--out-md", help="markdown tables (default: ROOT/compare.md)")
    parser.add_argument("--plot", help="curves PNG (default: ROOT/convergence.png)")
    parser.add_argument("--plot-router", help="router diagnostics PNG (default: ROOT/router.png)")
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--versus", metavar="ARM",
                        help="compare every arm with this one (paired by seed) instead of its "
                             "Switch arm; it must be one of the arms")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    try:
        arms = args.arms or study_arms(args.study, args.experts, dense=not args.no_dense)
        for arm in arms:
            parse_arm(arm)
    except ValueError as err:
        parser.error(str(err))
    if args.versus is not None and args.versus not in arms:
        parser.error(f"--versus {args.versus} is not one of the arms {arms}")
    args.arms = arms
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    options = StudyOptions(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(StudyOptions)})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
    if args.run_one or not args.summarize_only:
        from sparsemixer_jax.training.cli import enable_compilation_cache

        enable_compilation_cache()
    if args.run_one:
        arm, seed = args.run_one
        train_one(options, arm, int(seed))
        return
    if not args.summarize_only:
        run_all(options)
    os.makedirs(options.root, exist_ok=True)
    summarize_and_write(options)
    if args.pack:
        packed = pack(options.root, options.arms, options.seeds, args.pack)
        logger.info("packed %d run(s) into %s", len(packed), args.pack)


if __name__ == "__main__":
    main()
