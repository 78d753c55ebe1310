"""Running a convergence study: one config per arm and seed, training (one after another or in
subprocesses), the compact files a finished run keeps, packing, and writing the summary.

Every run is ``sparsemixer_jax.tasks.train_task(config, workdir)`` (the config's own task:
translation, pretraining, language modelling) on a config file with the arm's fields and the
seed set (arm names and target arms:
:mod:`lab.studies.arms`). Runs are ordered seed by seed (all arms of seed 0, then
seed 1, ...) so that a study cut short still compares the arms on the same seeds.

Several runs on one accelerator: ``parallel = K`` trains K runs at once, each in its own
process (``python -m experiments.compare --run-one ARM SEED ...``, output in the run's
``train.log``) with ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set to ``0.9 / K`` unless already set.
Otherwise runs go one after another in this process (runs of one model structure share their
compilations).

A study spread over several fresh machines: a finished run leaves ``results.json`` and the
compact ``curves.json`` (curves and router diagnostics), which is all the summary needs;
``delete_checkpoints`` removes its checkpoints (and ``metrics.jsonl``/TensorBoard with
``compact``) once it is done. :func:`pack` writes the small files of every finished or diverged
run into one archive; unpacking it into the root on the next machine (``tar xzf FILE -C ROOT``)
makes those runs count as done. Rerunning skips finished and diverged runs and resumes
unfinished ones from their last checkpoint, where it is still there. ``stop_launching_after``
(minutes) starts no new run after that time (runs under way finish).

A run whose loss became non-finite gets ``diverged.json`` and is not retried; the tables count
it per arm.
"""

from __future__ import annotations

import dataclasses
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

from lab.studies.arms import DIVERGED, parse_arm, run_dir, run_state
from lab.studies.curves import CURVES, write_curves
from lab.studies.figures import plot_convergence, plot_router
from lab.studies.summary import markdown, summarize

logger = logging.getLogger(__name__)

ARM_FIELDS = ("router.name", "model.num_experts", "seed")  # set per run by the study itself
# What a finished run keeps, and what --pack archives (a scored chat fine-tuning run also has
# its label accuracies, lab.studies.chat_sft).
SMALL_FILES = ("results.json", CURVES, "config.json", DIVERGED, "label_accuracy.json")


@dataclasses.dataclass
class StudyOptions:
    """What a study trains and where it writes (``python -m experiments.compare``'s options).

    ``config``: the config file every run starts from; ``root``: one workdir per run under it;
    ``steps``: ``train_steps`` (None: the config's); ``override``: ``FIELD=VALUE`` for every
    run; ``stop_launching_after``: minutes. The outputs of the summary (JSON, markdown, loss
    curves, router diagnostics) go under ``root`` unless given.
    """

    config: str
    root: str
    arms: list[str]
    seeds: list[int]
    steps: int | None = None
    override: list[str] = dataclasses.field(default_factory=list)
    parallel: int = 1
    stop_launching_after: float | None = None
    delete_checkpoints: bool = False
    compact: bool = False
    out_json: str | None = None
    out_md: str | None = None
    plot: str | None = None
    plot_router: str | None = None
    versus: str | None = None

    def __post_init__(self) -> None:
        for field, name in (("out_json", "compare.json"), ("out_md", "compare.md"),
                            ("plot", "convergence.png"), ("plot_router", "router.png")):
            if getattr(self, field) is None:
                setattr(self, field, os.path.join(self.root, name))

def _set_field(config, key: str, value) -> None:
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    current = node[leaf]
    if isinstance(value, str):  # from the command line: the field's own type
        value = (value.lower() in ("1", "true", "yes")) if isinstance(current, bool) \
            else type(current)(value)
    elif isinstance(current, bool) and not isinstance(value, bool):  # an arm's _norm1
        if value not in (0, 1):
            raise ValueError(f"{key} is a switch: 0 or 1, got {value!r}")
        value = bool(value)
    node[leaf] = value


def make_config(config_path: str, arm: str, seed: int, steps: int | None,
                overrides: Sequence[str] = ()) -> Any:
    """The config of one run: ``config_path``'s ``get_config()`` with the arm's fields, the seed,
    the budget and ``overrides`` (``FIELD=VALUE``, the syntax of ``--config.FIELD=VALUE``).
    ``path.py:variant`` calls ``get_config("variant")``, as ``--config`` does."""
    arm_fields = parse_arm(arm)
    for item in overrides:
        key = item.split("=", 1)[0]
        if key in ARM_FIELDS or key in arm_fields:
            raise ValueError(
                f"--override {item}: {key} is set per run by the study (by the arm name or "
                "--seeds); use an arm modifier, --experts or --seeds"
            )
    import importlib.util

    path, _, variant = config_path.partition(":")
    spec = importlib.util.spec_from_file_location("compare_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant) if variant else module.get_config()
    for key, value in arm_fields.items():
        _set_field(config, key, value)
    config.seed = seed
    if steps is not None:
        config.train_steps = steps
    for item in overrides:
        key, value = item.split("=", 1)
        _set_field(config, key, value)
    return config


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


def train_one(options: StudyOptions, arm: str, seed: int) -> str:
    """Trains (or resumes) one run in this process; returns its final state."""
    from sparsemixer_jax.tasks import train_task
    from sparsemixer_jax.training import TrainingDiverged

    workdir = run_dir(options.root, arm, seed)
    config = make_config(options.config, arm, seed, options.steps, options.override)
    logger.info("%s: training (%s)", workdir, "resuming" if os.path.isdir(workdir) else "fresh")
    started = time.time()
    try:
        train_task(config, workdir)
    except TrainingDiverged as err:  # the study goes on without this run
        logger.error("%s diverged: %s", workdir, err)
        with open(os.path.join(workdir, DIVERGED), "w") as f:
            json.dump({"error": str(err)}, f)
    finish_run(workdir, options.delete_checkpoints, options.compact)
    logger.info("%s: %.0f s", workdir, time.time() - started)
    return run_state(workdir)


def pending(options: StudyOptions) -> list[tuple[str, int]]:
    """(arm, seed) of every run not finished or diverged, seed by seed."""
    todo = []
    for seed in options.seeds:
        for arm in options.arms:
            state = run_state(run_dir(options.root, arm, seed))
            if state in ("finished", "diverged"):
                logger.info("%s: %s, skipped", run_dir(options.root, arm, seed), state)
            else:
                todo.append((arm, seed))
    return todo


def child_argv(options: StudyOptions, arm: str, seed: int) -> list[str]:
    argv = [sys.executable, "-m", "experiments.compare", "--run-one", arm, str(seed),
            "--config", options.config, "--root", options.root]
    if options.steps is not None:
        argv += ["--steps", str(options.steps)]
    for item in options.override:
        argv += ["--override", item]
    if options.delete_checkpoints:
        argv.append("--delete-checkpoints")
    if options.compact:
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
            logger.info("stop-launching time reached: %d run(s) left for a later rerun",
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


def run_all(options: StudyOptions) -> None:
    """Trains every pending run, sequentially in this process or ``parallel`` at a time."""
    todo = pending(options)
    minutes = options.stop_launching_after
    stop_after_s = None if minutes is None else 60 * minutes
    if options.parallel <= 1:
        started = time.monotonic()
        for arm, seed in todo:
            if stop_after_s is not None and time.monotonic() - started > stop_after_s:
                logger.info("stop-launching time reached: runs left for a later rerun")
                break
            train_one(options, arm, seed)
            summarize_and_write(options)  # a study cut short still has its tables
        return
    env = {} if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ else {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / options.parallel:.3f}"}
    jobs = [(os.path.join(run_dir(options.root, arm, seed), "train.log"),
             child_argv(options, arm, seed)) for arm, seed in todo]
    codes = run_pool(jobs, options.parallel, env, stop_after_s)
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


def summarize_and_write(options: StudyOptions) -> dict[str, Any]:
    summary = summarize(options.root, options.arms, options.seeds, versus=options.versus)
    table = markdown(summary)
    print(table, flush=True)
    if options.out_json:
        with open(options.out_json, "w") as f:
            json.dump(summary, f, indent=1)
    if options.out_md:
        with open(options.out_md, "w") as f:
            f.write(table)
    if options.plot:
        plot_convergence(options.root, summary, options.plot)
    if options.plot_router:
        plot_router(options.root, summary, options.plot_router)
    return summary
