"""The training loop every task runs: ``train(run, workdir)``.

A task (:class:`Task`) says what its loss, evaluation, data, model and final results are; the loop
owns everything else, read from the run's sections
(:class:`~sparsemixer_jax.training.run_config.RunConfig`): the resumption check, the mesh,
gradient accumulation, validation every ``eval_every`` steps, ``best`` and ``last`` checkpoints
(resumed automatically from the newest intact one), ``metrics.jsonl`` and TensorBoard, the
progress line, the stop on a non-finite loss, several hosts, and ``results.json``. Read top to
bottom, :func:`train` is the whole run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.training import runtime
from sparsemixer_jax.training.checkpoint import RunCheckpoints
from sparsemixer_jax.training.hosts import BatchPlacer, is_main_process, write_atomically
from sparsemixer_jax.training.logs import MetricLog, Progress, StepMetrics
from sparsemixer_jax.training.preemption import StopSignals
from sparsemixer_jax.training.resume import check_resume_config, resume_from_newest_intact
from sparsemixer_jax.training.routing_watch import CollapseRule, RoutingWatch
from sparsemixer_jax.training.run_config import RunConfig
from sparsemixer_jax.training.state import TrainState
from sparsemixer_jax.training.steps import Steps, count_params
from sparsemixer_jax.training.workdir_lock import hold_workdir

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became non-finite; the update was not applied."""


class TrainingStream(Protocol):
    """The training batches: an endless iterator whose position can be saved and restored."""

    def __next__(self) -> dict[str, np.ndarray]: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class TaskData:
    """What a task's data gives the loop: ``train`` (this host's rows of every micro-batch),
    ``valid`` (a list of batches), the vocabulary size, statistics for ``results.json``, the
    micro-batches per update (gradient accumulation), anything else the task keeps for
    itself (``extra``: e.g. the test split), and ``init_model``: a data-dependent step of the
    model's initialisation (Admin's profiling pass), run on the fresh model before the steps
    are built; a resumed run's checkpoint then replaces what it set."""

    train: TrainingStream
    valid: list[dict[str, np.ndarray]]
    vocab_size: int
    stats: dict[str, Any]
    micro_batches: int = 1
    extra: Any = None
    init_model: Callable[[nnx.Module], Any] | None = None


@dataclasses.dataclass
class Run:
    """A trained run as the task's :meth:`Task.finish` sees it: ``config`` its sections,
    ``state`` the train state after the last step."""

    config: RunConfig
    workdir: str
    steps: Steps
    state: TrainState
    checkpoints: RunCheckpoints
    best_step: int
    data: TaskData
    place: BatchPlacer


class Task(Protocol):
    """A task: what the compiled steps compute and what the loop needs around them.

    One hashable object (a frozen dataclass: a static argument of the compiled steps) holding
    the task's own typed sections, built by the task's ``from_config``. ``batch_keys`` are the
    fields of a batch placed on devices; ``progress_keys`` the update metrics shown on the
    progress line.
    """

    batch_keys: tuple[str, ...]
    progress_keys: tuple[str, ...]

    # -- in the compiled steps (traced)

    def loss(self, model: nnx.Module, batch: dict[str, jax.Array],
             key: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        """``(loss, metric sums)`` of one micro-batch in training mode. The loss is what the
        gradient is taken of; the metric sums add up over micro-batches. Reseeds the model's
        RNG streams from ``key`` (``nnx.reseed``), so a step's randomness is the key's alone."""

    def summarize(self, metric_sums: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        """``(divisor, metrics)`` of an update: what the summed gradient is divided by (its
        tokens, or its micro-batches) and the update's metrics, which hold ``"loss"`` (a
        non-finite one skips the update) and ``"tokens"``, and may hold ``"moe"`` (per-layer
        router metrics, logged every ``log_every`` steps)."""

    def evaluate(self, model: nnx.Module, batch: dict[str, jax.Array], key: jax.Array) -> Any:
        """The deterministic forward's metric sums on one validation batch."""

    # -- on the host

    def load_data(self, workdir: str, batch_multiple: int) -> TaskData:
        """Reads and batches the data (training the vocabulary on first use); micro-batches
        have a multiple of ``batch_multiple`` rows."""

    def build_model(self, run: RunConfig, vocab_size: int,
                    mesh: jax.sharding.Mesh | None) -> nnx.Module:
        """The model, initialised from ``run.seed`` and placed on ``mesh`` by ``run.mesh``'s
        rules (:func:`build_model`)."""

    def validation_metrics(self, sums: Any) -> dict[str, float]:
        """``valid_*`` metrics from :meth:`evaluate`'s sums over the whole set; must hold
        ``valid_loss`` (the ``best`` checkpoint is the lowest)."""

    # Optional: a task whose ``tracks_routing`` is True and that has ``routing_choices(model,
    # batch) -> (choices, token_mask)`` (each MoE layer's chosen experts per token
    # ``[B, T, k]``, sorted, from the deterministic forward of a model that reports them) gets
    # the routing diagnostics of sparsemixer_jax.training.routing_watch at each evaluation,
    # under "routing" in metrics.jsonl and results.json, with the config's collapse rule.

    def finish(self, run: Run) -> dict[str, Any]:
        """Results computed once at the end (e.g. test BLEU), merged into ``results.json``."""


def build_model(make: Callable[..., nnx.Module], mesh: jax.sharding.Mesh | None, *, seed: int,
                rules: Any = None) -> nnx.Module:
    """``make(mesh=mesh, rngs=...)`` (a model class with its sections and vocabulary size
    bound, e.g. ``functools.partial(Transformer, model, router, vocab_size)``) seeded from
    ``seed``, its parameters placed on ``mesh`` by the logical-axis ``rules`` (a mesh section's;
    None for the defaults), the rest replicated."""
    rngs = nnx.Rngs(params=seed, dropout=seed + 1, router=seed + 2)
    model = make(mesh=mesh, rngs=rngs)
    if mesh is not None:
        sharding.shard_state(model, mesh, rules)
    return model


def build_steps(run: RunConfig, vocab_size: int, mesh: jax.sharding.Mesh | None = None,
                init_model: Callable[[nnx.Module], Any] | None = None) -> Steps:
    """A fresh model of ``run.task`` (seeded from ``run.seed``, placed on ``mesh``, then
    ``init_model`` applied to it) with its compiled training and evaluation steps."""
    model = run.task.build_model(run, vocab_size, mesh)
    if init_model is not None:
        init_model(model)
    return Steps(model, run.task, run.optim, sharding.mesh_partitioner(run.mesh, mesh))


def evaluate(steps: Steps, state: TrainState, batches: list, place: BatchPlacer,
             task: Task, key: jax.Array) -> dict[str, float]:
    """The task's validation metrics over ``batches`` (sums accumulated in float64)."""
    total = None
    for batch in batches:
        sums = jax.tree.map(lambda x: np.asarray(x, np.float64),
                            jax.device_get(steps.evaluate(state, place(batch), key)))
        total = sums if total is None else jax.tree.map(np.add, total, sums)
    return task.validation_metrics(total)


def _routing_watch(task: Task, steps: Steps, state: TrainState, batches: list,
                   place: BatchPlacer, rule: CollapseRule) -> RoutingWatch | None:
    """The routing diagnostics of a task that asks for them (``tracks_routing``) on a model
    with MoE layers; None otherwise."""
    if not getattr(task, "tracks_routing", False) or not steps.num_routed_experts(state):
        return None
    return RoutingWatch(steps, state, batches, place, rule)


def _finished_results(workdir: str, train_steps: int) -> dict[str, Any] | None:
    """The results of a run that already reached ``train_steps``, if it wrote them."""
    path = os.path.join(workdir, "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        results = json.load(f)
    return results if results.get("steps") == train_steps else None


def train(run: RunConfig, workdir: str) -> dict[str, Any]:
    """Trains ``run.task`` (resuming from ``workdir`` if it holds a checkpoint), evaluates, and
    writes ``{workdir}/results.json``, which it also returns.

    Rerunning a finished run returns its results as they were. ``run`` is built by the task's
    door (:func:`sparsemixer_jax.tasks.run_config`), which raised ValueError for a bad config
    before anything was written.
    Raises :class:`~sparsemixer_jax.training.resume.ResumeError` for
    a workdir that cannot be resumed, :class:`TrainingDiverged` if the loss becomes non-finite,
    :class:`~sparsemixer_jax.training.workdir_lock.WorkdirError` for a workdir that is a file or
    that another run holds (one run per workdir), and
    :class:`~sparsemixer_jax.training.preemption.Stopped` after SIGTERM or SIGINT (the step in
    flight is finished and checkpointed; rerunning resumes there), and
    :class:`~sparsemixer_jax.training.checkpoint.DiskFull` at a checkpoint save that ran out of
    space
    (one line naming the workdir and the space a checkpoint needs).
    """
    runtime.configure(run.runtime)  # before any key is made (the entry points: earlier still)
    with hold_workdir(workdir):
        return _train_in(run, workdir)


def _train_in(run: RunConfig, workdir: str) -> dict[str, Any]:
    """:func:`train` in a workdir this run holds: the data, model and steps; then the steps
    from the newest intact checkpoint (a finished run returns its results) and the results."""
    check_resume_config(workdir, run)
    if is_main_process():  # atomically: the other processes may be reading it just now
        write_atomically(os.path.join(workdir, "config.json"), run.record)

    mesh = sharding.device_mesh(run.mesh)
    data = run.task.load_data(workdir, 1 if mesh is None else mesh.size)
    steps = build_steps(run, data.vocab_size, mesh, data.init_model)
    place = BatchPlacer(mesh, run.task.batch_keys)
    state = steps.init_state()
    # The starting model's routing of the validation set (read before an update donates it).
    watch = _routing_watch(run.task, steps, state, data.valid, place, run.collapse)
    logger.info("model: %s parameters; %d micro-batches per update; mesh %s; data %s",
                f"{count_params(state.params):,}", data.micro_batches,
                None if mesh is None else dict(mesh.shape), data.stats)

    restored, checkpoints = resume_from_newest_intact(state, workdir, run.train_steps)
    training = _Training(run, workdir, steps, data, place, checkpoints, watch)
    start_step, earlier = 0, {}
    if restored is not None:
        if restored.step == run.train_steps:
            finished = _finished_results(workdir, run.train_steps)
            if finished is not None:
                checkpoints.close()
                logger.info("%s already finished %d steps: results.json kept", workdir,
                            run.train_steps)
                return finished
        state, start_step, earlier = restored.state, restored.step, restored.meta
        training.best_loss = float(earlier["best_valid_loss"])
        training.best_step = int(earlier["best_step"])
        data.train.restore(earlier["data"])
    state, valid, step_metrics = training.run_steps(state, start_step, earlier)
    return training.finish(state, valid, step_metrics)


@dataclasses.dataclass
class _Training:
    """A run being trained: its sections and built pieces, and the best validation so far."""

    run: RunConfig
    workdir: str
    steps: Steps
    data: TaskData
    place: BatchPlacer
    checkpoints: RunCheckpoints
    watch: RoutingWatch | None
    best_loss: float = math.inf
    best_step: int = -1

    def run_steps(self, state: TrainState, start_step: int, earlier: dict[str, Any]
                  ) -> tuple[TrainState, dict[str, Any], StepMetrics]:
        """Steps ``start_step + 1 .. train_steps``: one update each, validation and checkpoints
        on their intervals. ``earlier``: the resumed checkpoint's meta (its time and tokens
        count on). Returns the last state, the last validation (empty if none ran) and the
        step metrics."""
        run, task, steps = self.run, self.run.task, self.steps
        log = MetricLog(self.workdir, start_step)
        if self.watch is not None:
            self.watch.continue_from(log.records())  # a collapse streak goes on across resuming
        key = jax.random.key(run.seed + 3)
        progress = Progress(run.train_steps, start_step)
        # Time and tokens of the steps before the checkpoint resumed from: results cover the
        # whole run.
        step_metrics = StepMetrics(log, progress, steps.schedule, task.progress_keys,
                                   self.diverged,
                                   tokens=float(earlier.get("train_tokens", 0.0)),
                                   seconds=float(earlier.get("train_time_s", 0.0)))
        seen_shapes = set()  # batch shapes the step functions were compiled for
        valid: dict[str, Any] = {}
        stop = StopSignals()
        try:
            for step in range(start_step + 1, run.train_steps + 1):
                started = time.perf_counter()
                micro = [next(self.data.train) for _ in range(self.data.micro_batches)]
                new_shapes = {tuple(b[k].shape for k in task.batch_keys) for b in micro}
                new_shapes -= seen_shapes
                seen_shapes |= new_shapes
                state, metrics = steps.train_step(state, [self.place(batch) for batch in micro],
                                                  jax.random.fold_in(key, step))
                step_metrics.add(step, metrics, started, with_moe=step % run.log_every == 0)
                progress.advance(compiled=bool(new_shapes))

                is_last = step == run.train_steps
                if step % run.eval_every == 0 or is_last:
                    step_metrics.flush()
                    valid = self.validate(step, state)
                    log.write({"step": step, **valid})
                    if valid["valid_loss"] < self.best_loss:
                        self.best_loss, self.best_step = valid["valid_loss"], step
                        self.checkpoints.save_best(step, state, self.meta(step, step_metrics))
                stopping = stop.requested(step)  # SIGTERM or SIGINT: checkpoint it and stop
                if step % run.checkpoint_every == 0 or is_last or stopping:
                    step_metrics.flush()
                    self.checkpoints.save_last(step, state, self.meta(step, step_metrics))
                self.checkpoints.poll()  # a background save out of space stops the run here
                if stopping:
                    raise stop.stopped(step)
            step_metrics.flush()
        finally:
            stop.close()
            self.checkpoints.wait()
            log.close()  # a run stopped here may end without Python's exit work
            progress.close()
        return state, valid, step_metrics

    def validate(self, step: int, state: TrainState) -> dict[str, Any]:
        """The task's validation metrics at ``step``, with the routing diagnostics if watched."""
        eval_key = jax.random.key(self.run.seed + 5)
        valid = evaluate(self.steps, state, self.data.valid, self.place, self.run.task, eval_key)
        logger.info("step %d: %s", step, valid)
        if self.watch is not None:
            valid["routing"] = self.watch.evaluate(step, self.steps, state)
        return valid

    def meta(self, step: int, step_metrics: StepMetrics) -> dict[str, Any]:
        """What a checkpoint of ``step`` keeps beside the train state."""
        return {"step": step, "data": self.data.train.state(), "best_valid_loss": self.best_loss,
                "best_step": self.best_step, "train_time_s": step_metrics.seconds,
                "train_tokens": step_metrics.tokens}

    def diverged(self, step: int, loss: float, grad_norm: float) -> None:
        raise TrainingDiverged(
            f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite; the update was "
            f"not applied and no checkpoint was written after step "
            f"{self.checkpoints.last.latest_step()} (the last good one, in "
            f"{self.workdir}/checkpoints/last). Lower optim.peak_lr, set optim.clip_norm, or use "
            "float32 compute."
        )

    def finish(self, state: TrainState, valid: dict[str, Any],
               step_metrics: StepMetrics) -> dict[str, Any]:
        """``results.json`` with the task's own final results (written and returned)."""
        run = self.run
        if not valid:  # resumed a finished run that wrote no results: evaluate what is there
            valid = self.validate(run.train_steps, state)
        results = {
            "steps": run.train_steps,
            **valid,
            "best_valid_loss": self.best_loss,
            "best_step": self.best_step,
            **step_metrics.results(),
            "num_params": count_params(state.params),
            "data_stats": self.data.stats,
        }
        results.update(run.task.finish(Run(run, self.workdir, self.steps, state,
                                           self.checkpoints, self.best_step, self.data,
                                           self.place)))
        results["config"] = json.loads(run.record)
        if is_main_process():
            write_atomically(os.path.join(self.workdir, "results.json"),
                             json.dumps(results, indent=1))
        self.checkpoints.close()
        return results
