"""Convergence study: Switch, SparseMixer, their ablations and the dense baseline, several seeds.

    python -m experiments.compare --root /tmp/compare --experts 4 --seeds 0 1 2 \
        --out-json docs/compare.json --out-md docs/compare.md --plot docs/convergence.png

Every run is ``sparsemixer_jax.train.train_and_evaluate(config, workdir)`` on
``configs/multi30k_compare.py`` (override with ``--config``) with the arm's fields and the seed
set (arm names and target arms: :mod:`experiments.study`). The arms are ``--arms`` if given,
else those of ``--study`` (``main`` by default: Switch and SparseMixer for each of
``--experts``, and dense). Runs are ordered seed by seed (all arms of seed 0, then seed 1, ...)
so that a study cut short still compares the arms on the same seeds.

Several runs on one accelerator: ``--parallel K`` trains K runs at once, each in its own
process (``python -m experiments.compare --run-one ARM SEED ...``, output in the run's
``train.log``) with ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set to ``0.9 / K`` unless already set.
Without it, runs go one after another in this process (runs of one model structure share their
compilations).

A study over several stints on fresh machines: a finished run leaves ``results.json`` and the
compact ``curves.json`` (curves and router diagnostics), which is all the summary needs;
``--delete-checkpoints`` removes its checkpoints (and ``metrics.jsonl``/TensorBoard with
``--compact``) once it is done. ``--pack FILE.tar.gz`` writes the small files of every
finished or diverged run into one archive; unpacking it into the root of the next stint
(``tar xzf FILE -C ROOT``) makes those runs count as done. Rerunning skips finished and diverged
runs and resumes unfinished ones from their last checkpoint, where it is still there.
``--stop-launching-after MIN`` starts no new run after MIN minutes (runs under way finish).

A run whose loss became non-finite gets ``diverged.json`` and is not retried; the tables count
it per arm. ``--summarize-only`` writes the tables (JSON, markdown), the loss curves and the
router-diagnostics figure (``--plot-router``) without training; they go to ``--root`` unless
``--out-json``, ``--out-md``, ``--plot`` say otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from typing import Any

from experiments.plot import CURVES, write_curves
from experiments.study import (  # noqa: F401  (re-exported: the study's public names)
    DIVERGED,
    STUDIES,
    arm_names,
    arm_settings,
    loss_at,
    markdown,
    parse_arm,
    plot,
    plot_router,
    read_results,
    run_dir,
    run_state,
    study_arms,
    summarize,
    target_arm,
    updates_to_reach,
)

logger = logging.getLogger(__name__)

ARM_FIELDS = ("router.name", "model.num_experts", "seed")  # set per run by the study itself
SMALL_FILES = ("results.json", CURVES, "config.json", DIVERGED)  # what a finished run keeps


def _set_field(config, key: str, value) -> None:
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    if isinstance(value, str):  # from the command line: the field's own type
        current = node[leaf]
        value = (value.lower() in ("1", "true", "yes")) if isinstance(current, bool) \
            else type(current)(value)
    node[leaf] = value


def make_config(config_path: str, arm: str, seed: int, steps: int | None,
                overrides: Sequence[str] = ()) -> Any:
    """The config of one run: ``config_path``'s ``get_config()`` with the arm's fields, the seed,
    the budget and ``overrides`` (``FIELD=VALUE``, the syntax of ``--config.FIELD=VALUE``)."""
    arm_fields = parse_arm(arm)
    for item in overrides:
        key = item.split("=", 1)[0]
        if key in ARM_FIELDS or key in arm_fields:
            raise ValueError(
                f"--override {item}: {key} is set per run by the study (by the arm name or "
                "--seeds); use an arm modifier, --experts or --seeds"
            )
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_config", config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for key, value in arm_fields.items():
        _set_field(config, key, value)
    config.seed = seed
    if steps is not None:
        config.train_steps = steps
    for item in overrides:
        key, value = item.split("=", 1)
        _set_field(config, key, value)
    return config


# ------------------------------------------------------------------------------- running


def finish_run(workdir: str, delete_checkpoints: bool = False, compact: bool = False) -> None:
    """After a run ends (finished or diverged): write ``curves.json``; optionally delete what
    only a resumed run would need."""
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        write_curves(workdir)
    if delete_checkpoints or compact:
        shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    if compact:
        shutil.rmtree(os.path.join(workdir, "tensorboard"), ignore_errors=True)
        for name in ("metrics.jsonl", "spm.model", "spm.vocab"):
            if os.path.exists(os.path.join(workdir, name)):
                os.remove(os.path.join(workdir, name))


def train_one(args: argparse.Namespace, arm: str, seed: int) -> str:
    """Trains (or resumes) one run in this process; returns its final state."""
    from sparsemixer_jax.tasks import translation
    from sparsemixer_jax.training import TrainingDiverged

    workdir = run_dir(args.root, arm, seed)
    config = make_config(args.config, arm, seed, args.steps, args.override)
    logger.info("%s: training (%s)", workdir, "resuming" if os.path.isdir(workdir) else "fresh")
    started = time.time()
    try:
        translation.train_and_evaluate(config, workdir)
    except TrainingDiverged as err:  # the study goes on without this run
        logger.error("%s diverged: %s", workdir, err)
        with open(os.path.join(workdir, DIVERGED), "w") as f:
            json.dump({"error": str(err)}, f)
    finish_run(workdir, args.delete_checkpoints, args.compact)
    logger.info("%s: %.0f s", workdir, time.time() - started)
    return run_state(workdir)


def pending(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(arm, seed) of every run not finished or diverged, seed by seed."""
    todo = []
    for seed in args.seeds:
        for arm in args.arms:
            state = run_state(run_dir(args.root, arm, seed))
            if state in ("finished", "diverged"):
                logger.info("%s: %s, skipped", run_dir(args.root, arm, seed), state)
            else:
                todo.append((arm, seed))
    return todo


def _child_argv(args: argparse.Namespace, arm: str, seed: int) -> list[str]:
    argv = [sys.executable, "-m", "experiments.compare", "--run-one", arm, str(seed),
            "--config", args.config, "--root", args.root]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    for item in args.override:
        argv += ["--override", item]
    if args.delete_checkpoints:
        argv.append("--delete-checkpoints")
    if args.compact:
        argv.append("--compact")
    return argv


def run_pool(jobs: Sequence[tuple[str, list[str]]], parallel: int, env: dict[str, str],
             stop_after_s: float | None = None, poll_s: float = 5.0) -> dict[str, int]:
    """Runs ``jobs`` (``(log_path, argv)``) as subprocesses, at most ``parallel`` at a time, with
    ``env`` added to the environment; starts none after ``stop_after_s``. Returns the exit code
    of each started job by log path."""
    queue, running, codes = list(jobs), {}, {}
    started = time.monotonic()
    while queue or running:
        too_late = stop_after_s is not None and time.monotonic() - started > stop_after_s
        while queue and len(running) < parallel and not too_late:
            log_path, argv = queue.pop(0)
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            log = open(log_path, "a")  # noqa: SIM115 (closed when the process ends)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **env})
            running[log_path] = (proc, log)
            logger.info("started %s (pid %d)", log_path, proc.pid)
        if too_late and queue:
            logger.info("stop-launching time reached: %d run(s) left for a later stint",
                        len(queue))
            queue.clear()
        for log_path, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                codes[log_path] = proc.returncode
                del running[log_path]
                logger.info("%s: exit code %d", log_path, proc.returncode)
        if running:
            time.sleep(poll_s)
    return codes


def run_all(args: argparse.Namespace) -> None:
    """Trains every pending run, sequentially in this process or ``--parallel`` at a time."""
    todo = pending(args)
    stop_after_s = None if args.stop_launching_after is None else 60 * args.stop_launching_after
    if args.parallel <= 1:
        started = time.monotonic()
        for arm, seed in todo:
            if stop_after_s is not None and time.monotonic() - started > stop_after_s:
                logger.info("stop-launching time reached: runs left for a later stint")
                break
            train_one(args, arm, seed)
            summarize_and_write(args)  # a study cut short still has its tables
        return
    env = {} if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ else {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / args.parallel:.3f}"}
    jobs = [(os.path.join(run_dir(args.root, arm, seed), "train.log"),
             _child_argv(args, arm, seed)) for arm, seed in todo]
    codes = run_pool(jobs, args.parallel, env, stop_after_s)
    failed = [path for path, code in codes.items() if code != 0]
    if failed:
        logger.error("runs that failed (see their train.log): %s", failed)


def pack(root: str, arms: Sequence[str], seeds: Sequence[int], out: str) -> list[str]:
    """Writes the small files of every finished or diverged run into the tar.gz ``out``
    (paths relative to ``root``); returns the run directories packed."""
    packed = []
    with tarfile.open(out, "w:gz") as tar:
        for seed in seeds:
            for arm in arms:
                workdir = run_dir(root, arm, seed)
                if run_state(workdir) not in ("finished", "diverged"):
                    continue
                if not os.path.exists(os.path.join(workdir, CURVES)):
                    finish_run(workdir)  # runs finished by an older driver
                for name in SMALL_FILES:
                    path = os.path.join(workdir, name)
                    if os.path.exists(path):
                        tar.add(path, arcname=os.path.relpath(path, root))
                packed.append(os.path.basename(workdir))
    return packed


# ---------------------------------------------------------------------------------- summary


def summarize_and_write(args: argparse.Namespace) -> dict[str, Any]:
    summary = summarize(args.root, args.arms, args.seeds)
    table = markdown(summary)
    print(table, flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(table)
    if args.plot:
        plot(args.root, summary, args.plot)
    if args.plot_router:
        plot_router(args.root, summary, args.plot_router)
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/multi30k_compare.py")
    parser.add_argument("--root", default="/tmp/compare", help="one workdir per run under it")
    parser.add_argument("--experts", type=int, nargs="+", default=[4])
    parser.add_argument("--study", nargs="+", default=["main"], choices=sorted(STUDIES),
                        help="named groups of arms (experiments.study.STUDIES)")
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
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    try:
        arms = args.arms or study_arms(args.study, args.experts, dense=not args.no_dense)
        for arm in arms:
            parse_arm(arm)
    except ValueError as err:
        parser.error(str(err))
    args.arms = arms
    for field, name in (("out_json", "compare.json"), ("out_md", "compare.md"),
                        ("plot", "convergence.png"), ("plot_router", "router.png")):
        if getattr(args, field) is None:
            setattr(args, field, os.path.join(args.root, name))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
    if args.run_one:
        from experiments.cli import enable_compilation_cache

        enable_compilation_cache()
        arm, seed = args.run_one
        train_one(args, arm, int(seed))
        return
    if not args.summarize_only:
        from experiments.cli import enable_compilation_cache

        enable_compilation_cache()
        run_all(args)
    os.makedirs(args.root, exist_ok=True)
    summarize_and_write(args)
    if args.pack:
        packed = pack(args.root, args.arms, args.seeds, args.pack)
        logger.info("packed %d run(s) into %s", len(packed), args.pack)


if __name__ == "__main__":
    main()
