"""Fine-tuning a pretrained encoder on GLUE tasks, with the paper's best-of-grid search.

``run_tasks(config, pretrained_dir, tasks, workdir)`` is the experiment (schema:
``configs/glue.py``): for every task and every point of ``config.grid`` (peak learning rate,
epochs, batch size, weight decay, warm-up proportion; the paper's Appendix table "fine-tune"),
fine-tune a copy of the pretrained discriminator with a classification (or, for STS-B,
regression) head on its ``[CLS]`` state, evaluate on the dev split(s) after every epoch, and
report per task the best dev score over the grid with the hyper-parameters and epoch that gave it.
A grid point's score is its best epoch's (the paper's "max epochs"); the score metric is the one
of the paper's Table 2 (``glue.TaskSpec.score_metric``).

The pretrained model is the run's final (``last``) checkpoint by default, as the paper fine-tunes
the model after its 125k updates; ``checkpoint="best"`` takes the lowest validation loss instead.

Every finished grid point is written at once to ``{workdir}/{task}/points/{point}.json`` with the
step and content digest of the checkpoint it started from; a rerun skips the points already there
if they were made with the same settings and from the same checkpoint content, and refuses (one
line naming both checkpoints) when they were not, so a search never mixes two pretrained models.
A killed search resumes where it stopped. No fine-tuning checkpoints are kept: a point is short
and is redone.

Why fine-tuning has its own epoch loop rather than :func:`sparsemixer_jax.training.train`: a
search is many short in-memory runs (96 points per task), scored on dev after every epoch, with
no checkpoints. Its compiled step takes the learning rate and weight decay as traced values, so
one compilation per batch shape serves every grid point; it shares the optimizer's weight-decay
rule (:func:`sparsemixer_jax.training.optim.weight_decay_mask`) and the pretrained encoder
(:func:`sparsemixer_jax.tasks.pretraining.load_discriminator`) with the other tasks.

The optimizer is AdamW (Adam with decoupled weight decay, not on biases and LayerNorm scales)
after clipping the global gradient norm, on the paper's schedule: linear warm-up over the
point's warm-up share of the steps, then linear decay to 0 at the last step
(:func:`sparsemixer_jax.training.optim.linear_schedule`, so the first update already has a
nonzero rate); the loss adds the MoE balance (and z-) loss with the pretraining's weights.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import time
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from sparsemixer_jax.data import glue
from sparsemixer_jax.metrics import glue_metrics
from sparsemixer_jax.models.encoder import EncoderConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import cast, check_fraction, read_fields
from sparsemixer_jax.tasks.pretraining import load_pretrained
from sparsemixer_jax.training.optim import linear_schedule, weight_decay_mask
from sparsemixer_jax.training.state import TrainState
from sparsemixer_jax.training.workdir_lock import hold_workdir

logger = logging.getLogger(__name__)

# Fields of a grid-point result that must match for a rerun to reuse it.
_SETTINGS_FIELDS = ("pretrained", "checkpoint", "glue_dir", "max_len", "head_dropout", "seed",
                    "train_limit", "dev_limit", "optim", "skip_bad_rows")
# The value a point written before a settings field existed had.
_SETTINGS_DEFAULTS = {"skip_bad_rows": False}
# What the points' pretrained model was: a rerun from other content refuses to mix them.
_SOURCE_FIELDS = ("checkpoint_step", "checkpoint_digest")


# -------------------------------------------------------------------------------- the grid


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One fine-tuning setting of the search space."""

    learning_rate: float
    epochs: int
    batch_size: int
    weight_decay: float
    warmup: float  # share of the training steps spent warming up

    @property
    def name(self) -> str:
        return (f"lr{self.learning_rate:g}_ep{self.epochs}_bs{self.batch_size}"
                f"_wd{self.weight_decay:g}_wu{self.warmup:g}")


def grid_points(grid: Any) -> list[GridPoint]:
    """Every combination of ``grid``'s lists (``config.grid``), in a fixed order (learning rate
    outermost)."""
    hints = typing.get_type_hints(GridPoint)
    values = []
    for f in dataclasses.fields(GridPoint):
        options = [cast(hints[f.name], v, f"config.grid.{f.name}") for v in grid[f.name]]
        if not options:
            raise ValueError(f"config.grid.{f.name} is empty")
        values.append(options)
    points = [GridPoint(*combination) for combination in itertools.product(*values)]
    for p in points:
        if not (p.learning_rate > 0 and p.epochs > 0 and p.batch_size > 0
                and p.weight_decay >= 0 and 0 <= p.warmup < 1):
            raise ValueError(f"config.grid gives an invalid point {p}")
    return points


@dataclasses.dataclass(frozen=True)
class FinetuneOptim:
    """``config.optim`` of a fine-tuning search: AdamW's betas and epsilon, and the gradient
    clipping norm (0 = none); the rate and decay are the grid's."""

    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class FinetuningConfig:
    """A fine-tuning config (schema: ``configs/glue.py``) as a typed value, checked by
    :meth:`from_config` before anything loads."""

    glue_dir: str
    max_len: int
    length_step: int
    eval_batch_size: int
    head_dropout: float
    seed: int
    optim: FinetuneOptim
    grid: tuple[GridPoint, ...]
    train_limit: int = 0
    dev_limit: int = 0

    @classmethod
    def from_config(cls, config: Any, where: str = "config.") -> FinetuningConfig:
        """ValueError naming the first field that makes no sense."""
        c = cls(optim=FinetuneOptim(**read_fields(FinetuneOptim, config.optim, where + "optim.")),
                grid=tuple(grid_points(config.grid)),
                **read_fields(cls, config, where, skip=("optim", "grid")))
        for name in ("max_len", "eval_batch_size", "length_step"):
            if not getattr(c, name) > 0:
                raise ValueError(f"{where}{name} must be > 0, got {getattr(c, name)}")
        for name in ("train_limit", "dev_limit"):
            if getattr(c, name) < 0:
                raise ValueError(f"{where}{name} must be >= 0 (0 = all), got "
                                 f"{getattr(c, name)}")
        if not 0 <= c.head_dropout < 1:
            raise ValueError(f"{where}head_dropout must be in [0, 1), got {c.head_dropout}")
        check_fraction(where + "optim.", b1=c.optim.b1, b2=c.optim.b2)
        return c

    @classmethod
    def of(cls, config: Any) -> FinetuningConfig:
        return config if isinstance(config, cls) else cls.from_config(config)


def check_config(config: Any) -> None:
    """Raises ``ValueError`` naming the first field that makes no sense, before anything loads
    (:meth:`FinetuningConfig.from_config`)."""
    FinetuningConfig.from_config(config)


# ------------------------------------------------------------------------------- the model


class Classifier(nnx.Module):
    """An encoder with ELECTRA's classification head on the ``[CLS]`` (first) position:
    dropout, dense + GELU, dropout, dense to ``num_outputs`` (classes, or 1 for regression).

    The head computes in float32 whatever the encoder's compute dtype.
    """

    def __init__(self, encoder: nnx.Module, num_outputs: int, *, dropout: float,
                 rngs: nnx.Rngs):
        self.encoder = encoder
        width = int(encoder.emb_dim)
        init = nnx.initializers.normal(stddev=0.02)  # BERT / ELECTRA's initialiser
        self.dense = nnx.Linear(width, width, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(width, num_outputs, kernel_init=init, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tokens: jax.Array, segments: jax.Array, *, deterministic: bool
                 ) -> tuple[jax.Array, dict[str, Any]]:
        """``tokens``, ``segments`` int ``[B, L]`` -> float32 ``[B, num_outputs]``, encoder aux."""
        hidden, aux = self.encoder(tokens, segments=segments, deterministic=deterministic)
        x = self.dropout(hidden[:, 0].astype(jnp.float32), deterministic=deterministic)
        x = self.dropout(jax.nn.gelu(self.dense(x)), deterministic=deterministic)
        return self.out(x), aux


# ----------------------------------------------------------------------------- compiled steps


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What the compiled steps depend on besides shapes (hashable: a static argument)."""

    regression: bool
    balance_weight: float
    z_loss_weight: float
    b1: float
    b2: float
    eps: float
    clip_norm: float


def _optimizer(settings: StepSettings, learning_rate, weight_decay) -> optax.GradientTransformation:
    """Clipping then AdamW; ``learning_rate`` and ``weight_decay`` may be traced scalars, so one
    compilation serves every grid point of a batch shape."""
    adamw = optax.adamw(learning_rate, b1=settings.b1, b2=settings.b2, eps=settings.eps,
                        weight_decay=weight_decay, mask=weight_decay_mask)
    if settings.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(settings.clip_norm), adamw)
    return adamw


def example_losses(outputs: jax.Array, labels: jax.Array, regression: bool) -> jax.Array:
    """Cross entropy of ``outputs [B, K]`` against class ids ``[B]``, or the squared error of
    ``outputs[:, 0]`` against float targets ``[B]`` (regression); float32 ``[B]``."""
    if regression:
        return jnp.square(outputs[:, 0] - labels)
    return optax.softmax_cross_entropy_with_integer_labels(outputs, labels)


def _loss(graphdef, settings: StepSettings, params, stats, rest, batch, key):
    rest = jax.tree.map(lambda x: x, rest)  # reseed a copy, not the caller's RNG state
    model = nnx.merge(graphdef, nnx.State(params), nnx.State(stats), rest)
    dropout_key, router_key = jax.random.split(key)
    nnx.reseed(model, dropout=dropout_key, router=router_key)
    outputs, aux = model(batch["tokens"], batch["segments"], deterministic=False)
    weights = batch["weights"]
    task_loss = jnp.sum(example_losses(outputs, batch["labels"], settings.regression) * weights)
    task_loss = task_loss / jnp.maximum(jnp.sum(weights), 1.0)
    loss = (task_loss + settings.balance_weight * aux["balance_loss"]
            + settings.z_loss_weight * aux["z_loss"])
    metrics = {"loss": task_loss, "balance_loss": aux["balance_loss"]}
    # Layer state the forward updated (Default MoE's default vectors keep adapting).
    return loss, (metrics, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def finetuning_step(graphdef: nnx.GraphDef, settings: StepSettings, state: TrainState,
                    rest: Any, batch: dict[str, jax.Array], key: jax.Array,
                    learning_rate: jax.Array, weight_decay: jax.Array
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One compiled fine-tuning update of a grid point: ``(next state, metrics)`` (``state`` is
    donated; ``rest`` is the model's RNG streams, reseeded from ``key``)."""
    grads, (metrics, layer_state) = jax.grad(_loss, argnums=2, has_aux=True)(
        graphdef, settings, state.params, state.layer_state, rest, batch, key)
    updates, opt_state = _optimizer(settings, learning_rate, weight_decay).update(
        grads, state.opt_state, state.params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      layer_state=layer_state, opt_state=opt_state), metrics


@functools.partial(jax.jit, static_argnums=(0,))
def _predict(graphdef, state: TrainState, rest, batch):
    model = nnx.merge(graphdef, nnx.State(state.params), nnx.State(state.layer_state), rest)
    outputs, _ = model(batch["tokens"], batch["segments"], deterministic=True)
    return outputs


def finetuning_schedule(peak: float, total_steps: int, warmup: float) -> optax.Schedule:
    """The rate of update ``count`` (optax counts from 0): linear warm-up to ``peak`` over
    ``round(warmup * total_steps)`` updates, then linear decay to 0 at ``total_steps``.

    The pretraining schedule (:func:`sparsemixer_jax.training.optim.linear_schedule`): update
    ``count + 1`` gets ``peak * (count + 1) / warmup_steps`` while warming up, so the first
    update moves the weights (optax's own linear schedules would give it a rate of 0).
    """
    warmup_steps = round(warmup * total_steps)
    return linear_schedule(peak, warmup_steps, total_steps)


# --------------------------------------------------------------------------- one grid point


@dataclasses.dataclass
class GlueData:
    """One GLUE task's encoded data: its spec, the train split and the dev split(s)."""

    spec: glue.TaskSpec
    train: glue.Encoded
    dev: dict[str, glue.Encoded]
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # file -> bad rows left out


def predict(graphdef: nnx.GraphDef, state: TrainState, rest: Any, data: glue.Encoded,
            batch_size: int, length_step: int, regression: bool) -> np.ndarray:
    """Class ids (or scores, for regression) of every row of ``data``, in order: int ``[N]``
    (float ``[N]`` for regression)."""
    out = []
    for batch in glue.batches(data, batch_size, length_step=length_step):
        outputs = np.asarray(_predict(graphdef, state, rest, batch))
        outputs = outputs[:, 0] if regression else outputs.argmax(-1)
        out.append(outputs[batch["weights"] > 0])
    return np.concatenate(out)


def evaluate_dev(graphdef: nnx.GraphDef, state: TrainState, rest: Any, task: GlueData,
                 config: FinetuningConfig) -> dict[str, dict[str, float]]:
    """``{dev split: {metric: value}}`` of the task's standard metrics."""
    results = {}
    for split, data in task.dev.items():
        predictions = predict(graphdef, state, rest, data, config.eval_batch_size,
                              config.length_step, task.spec.is_regression)
        results[split] = glue_metrics.compute(task.spec.metrics, predictions, data.labels)
    return results


def task_score(spec: glue.TaskSpec, dev: dict[str, dict[str, float]]) -> float:
    """The paper's Table 2 number: ``score_metric``, averaged over dev splits (MNLI m/mm)."""
    return float(np.mean([dev[split][spec.score_metric] for split in spec.dev_splits]))


def finetune_point(encoder_graphdef, encoder_state, task: GlueData, point: GridPoint,
                   config: FinetuningConfig, settings: StepSettings) -> dict[str, Any]:
    """Fine-tunes a fresh copy of the encoder with a new head at ``point``; dev after each epoch.

    Returns ``{"epochs": [{"epoch", "train_loss", "balance_loss", "dev", "score"}], "best_epoch",
    "score", "dev", "steps", "seconds"}`` (``dev`` and ``score`` of the best epoch).
    """
    start = time.time()
    seed = config.seed
    encoder = nnx.merge(encoder_graphdef, encoder_state)
    model = Classifier(encoder, task.spec.num_outputs, dropout=config.head_dropout,
                       rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    graphdef, params, layer_state, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    # Copies: the steps donate the state, and the encoder's arrays serve every grid point.
    params, layer_state = (jax.tree.map(jnp.copy, nnx.to_pure_dict(tree))
                           for tree in (params, layer_state))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, layer_state=layer_state,
                       opt_state=_optimizer(settings, 0.0, 0.0).init(params))
    # The whole state committed to the encoder's device: the encoder's arrays come from the
    # checkpoint committed, the head's and the optimizer's new ones do not, and the step's
    # outputs are all committed, so a mixed state would compile the step again after one update.
    (device,) = jax.tree.leaves(encoder_state)[0].devices()
    state = jax.device_put(state, device)
    steps_per_epoch = math.ceil(len(task.train) / point.batch_size)
    total = steps_per_epoch * point.epochs
    schedule = finetuning_schedule(point.learning_rate, total, point.warmup)
    step = 0
    history = []
    for epoch in range(1, point.epochs + 1):
        epoch_metrics = []  # kept on the device: no host sync per step
        # Shuffles and dropout depend on (seed, epoch, step) only: a rerun redoes the same point.
        rng = np.random.default_rng([seed, epoch])
        for batch in glue.batches(task.train, point.batch_size, length_step=config.length_step,
                                  rng=rng):
            key = jax.random.fold_in(jax.random.key(seed), step)
            state, metrics = finetuning_step(
                graphdef, settings, state, rest, batch, key,
                jnp.float32(schedule(step)), jnp.float32(point.weight_decay))
            epoch_metrics.append(metrics)
            step += 1
        means = {k: float(np.mean(v)) for k, v in
                 jax.device_get(jax.tree.map(lambda *x: jnp.stack(x), *epoch_metrics)).items()}
        train_loss = means["loss"]
        if not np.isfinite(train_loss):
            logger.warning("%s %s: training loss is %s at epoch %d; stopping this point",
                           task.spec.name, point.name, train_loss, epoch)
            history.append({"epoch": epoch, "train_loss": train_loss, "dev": None,
                            "score": float("nan")})
            break
        dev = evaluate_dev(graphdef, state, rest, task, config)
        history.append({"epoch": epoch, "train_loss": train_loss,
                        "balance_loss": means["balance_loss"],
                        "grad_norm": means["grad_norm"],
                        "dev": dev, "score": task_score(task.spec, dev)})
        logger.info("%s %s epoch %d: train loss %.4f, dev %s", task.spec.name, point.name, epoch,
                    train_loss, dev)
    scored = [h for h in history if np.isfinite(h["score"])]
    best = max(scored, key=lambda h: h["score"]) if scored else history[-1]
    return {"epochs": history, "best_epoch": best["epoch"], "score": best["score"],
            "dev": best["dev"], "steps": step, "seconds": round(time.time() - start, 1)}


# ------------------------------------------------------------------------------ the search


def _write_json(path: str, record: Any) -> None:
    """Atomically: a reader (or a resumed run) sees the old file or the new one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, allow_nan=True)
    os.replace(tmp, path)


def settings_record(config: Any, pretrained_dir: str, checkpoint: str, *,
                    step: int | None = None, digest: str | None = None,
                    skip_bad_rows: bool = False) -> dict[str, Any]:
    """What a grid point's result depends on besides its hyper-parameters: the settings (with
    whether malformed GLUE rows were skipped), and the ``step`` and content ``digest`` of the
    pretrained checkpoint it started from."""
    config = FinetuningConfig.of(config)
    return {
        "pretrained": os.path.abspath(pretrained_dir),
        "checkpoint": checkpoint,
        "checkpoint_step": step,
        "checkpoint_digest": digest,
        "glue_dir": os.path.abspath(glue_dir(config)),
        "max_len": config.max_len,
        "head_dropout": config.head_dropout,
        "seed": config.seed,
        "train_limit": config.train_limit,
        "dev_limit": config.dev_limit,
        "optim": dataclasses.asdict(config.optim),
        "skip_bad_rows": bool(skip_bad_rows),
    }


def _load_point(path: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """A finished point's record, or None if there is none; ``ValueError`` if it was made with
    other settings (the search would mix two experiments)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    theirs = record["settings"]
    if any(theirs.get(f) != settings[f] for f in _SOURCE_FIELDS):
        def name(s: dict[str, Any]) -> str:
            digest = s.get("checkpoint_digest")
            return (f"{s.get('checkpoint')} checkpoint step {s.get('checkpoint_step')} "
                    f"(sha256 {digest[:12] if digest else 'not recorded'})")

        raise ValueError(
            f"{path} was fine-tuned from the {name(theirs)}, this run loads the {name(settings)}: "
            "the search would mix two pretrained models; use another --workdir, or delete that "
            "task's points/"
        )
    for field in _SETTINGS_FIELDS:
        if theirs.get(field, _SETTINGS_DEFAULTS.get(field)) != settings[field]:
            raise ValueError(
                f"{path} was fine-tuned with {field}={theirs.get(field)!r}, this run "
                f"has {settings[field]!r}: use another --workdir, or delete that task's points/"
            )
    return record


def glue_dir(config: Any) -> str:
    from sparsemixer_jax.data.sources import resolve_data_dir

    return resolve_data_dir(config.glue_dir)


def load_task_data(config: Any, name: str, tokenizer, *, skip_bad_rows: bool = False
                   ) -> GlueData:
    config = FinetuningConfig.of(config)
    """Reads and encodes a task, keeping the first ``train_limit`` / ``dev_limit`` rows if set;
    ``skip_bad_rows`` leaves malformed rows out (counted per file in ``GlueData.skipped``)."""
    task = glue.load_task(glue_dir(config), name, skip_bad_rows=skip_bad_rows)
    regression = task.spec.is_regression
    train_limit, dev_limit = config.train_limit, config.dev_limit
    train = task.train[:train_limit] if train_limit else task.train
    return GlueData(
        task.spec,
        glue.encode(train, tokenizer, config.max_len, regression=regression),
        {split: glue.encode(rows[:dev_limit] if dev_limit else rows, tokenizer,
                            config.max_len, regression=regression)
         for split, rows in task.dev.items()},
        task.skipped,
    )


def run_task(config: Any, task: GlueData, encoder: nnx.Module, pretrain_config: Any,
             workdir: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The grid search on one task; writes each point, then ``{workdir}/{task}/results.json``."""
    config = FinetuningConfig.of(config)
    router = RouterConfig.from_config(pretrain_config.router)
    task_dir = os.path.join(workdir, task.spec.name)
    encoder_graphdef, encoder_state = nnx.split(encoder)
    step_settings = StepSettings(
        regression=task.spec.is_regression,
        balance_weight=router.balance_weight,
        z_loss_weight=router.z_loss_weight,
        b1=config.optim.b1, b2=config.optim.b2, eps=config.optim.eps,
        clip_norm=config.optim.clip_norm,
    )
    points = config.grid
    records = []
    for i, point in enumerate(points, start=1):
        path = os.path.join(task_dir, "points", point.name + ".json")
        record = _load_point(path, settings)
        if record is None:
            logger.info("%s: grid point %d/%d %s", task.spec.name, i, len(points), point.name)
            result = finetune_point(encoder_graphdef, encoder_state, task, point, config,
                                    step_settings)
            record = {"point": dataclasses.asdict(point), "name": point.name,
                      "settings": settings, **result}
            _write_json(path, record)
        else:
            logger.info("%s: grid point %s done before, skipped", task.spec.name, point.name)
        records.append(record)
    scored = [r for r in records if np.isfinite(r["score"])]
    if not scored:
        raise RuntimeError(
            f"{task.spec.name}: no grid point has a finite dev score (a diverged loss, or "
            f"constant predictions under a correlation metric); see {task_dir}/points"
        )
    best = max(scored, key=lambda r: r["score"])
    summary = {
        "task": task.spec.name,
        "score_metric": task.spec.score_metric,
        "score": best["score"],
        "dev": best["dev"],
        "best": {"point": best["point"], "epoch": best["best_epoch"]},
        "train_examples": len(task.train),
        "dev_examples": {split: len(d) for split, d in task.dev.items()},
        "skipped_rows": task.skipped,
        "grid_size": len(points),
        "points": [{"name": r["name"], "score": r["score"], "best_epoch": r["best_epoch"],
                    "seconds": r["seconds"]} for r in records],
        "settings": settings,
    }
    _write_json(os.path.join(task_dir, "results.json"), summary)
    return summary


def resolve_tasks(config: Any, tasks: Sequence[str]) -> list[str]:
    """Task names from ``--task`` values: names, or ``all`` for every task the GLUE directory
    has (the missing ones are logged with where they were looked for)."""
    names: list[str] = []
    for t in tasks:
        if t.lower() == "all":
            present = glue.available_tasks(glue_dir(config))
            missing = [n for n in glue.TASKS if n not in present]
            if missing:
                logger.warning("GLUE tasks not in %s, skipped: %s", glue_dir(config),
                               ", ".join(missing))
            if not present:
                raise FileNotFoundError(f"no GLUE task in {glue_dir(config)}")
            names += present
        else:
            names.append(glue.task_spec(t).name)
    return list(dict.fromkeys(names))


def run_tasks(config: ml_collections.ConfigDict, pretrained_dir: str, tasks: Sequence[str],
              workdir: str, *, checkpoint: str = "last", skip_bad_rows: bool = False
              ) -> dict[str, Any]:
    """Fine-tunes the discriminator pretrained in ``pretrained_dir`` (its ``checkpoint``:
    ``"last"``, the final model, or ``"best"``) on each task; writes every task's results and
    ``{workdir}/results.json`` (all tasks with results in ``workdir``). ``skip_bad_rows``
    leaves malformed GLUE rows out (counted per file in each task's ``skipped_rows``) instead of
    stopping at the first.

    Raises ``ValueError`` / ``FileNotFoundError`` with a one-line message for an unknown task, a
    missing split, a directory without a pretraining checkpoint, or finished points of
    ``workdir`` that started from another checkpoint.
    """
    config = FinetuningConfig.of(config)  # checks it before anything loads
    names = resolve_tasks(config, tasks)
    for name in names:  # fail on a missing file before any fine-tuning
        for split in ("train", *glue.TASKS[name].dev_splits):
            glue.split_path(glue_dir(config), glue.TASKS[name], split)
    pretrained = load_pretrained(pretrained_dir, checkpoint)
    positions = EncoderConfig.from_config(pretrained.config.model).absolute_positions
    if positions and config.max_len > positions:
        raise ValueError(f"config.max_len={config.max_len} exceeds the {positions} learned "
                         f"positions of the model in {pretrained_dir}")
    settings = settings_record(config, pretrained_dir, checkpoint, step=pretrained.step,
                               digest=pretrained.digest, skip_bad_rows=skip_bad_rows)
    for name in names:  # refuse to mix checkpoints before any fine-tuning
        for point in config.grid:
            _load_point(os.path.join(workdir, name, "points", point.name + ".json"), settings)
    logger.info("fine-tuning the %s checkpoint of %s (step %d, sha256 %s)", checkpoint,
                pretrained_dir, pretrained.step, pretrained.digest[:12])
    with hold_workdir(workdir):  # one search per workdir: a second one is refused
        for name in names:
            task = load_task_data(config, name, pretrained.tokenizer, skip_bad_rows=skip_bad_rows)
            run_task(config, task, pretrained.encoder, pretrained.config, workdir, settings)
        summary = collect_results(workdir)
        _write_json(os.path.join(workdir, "results.json"), summary)
    return summary


def collect_results(workdir: str) -> dict[str, Any]:
    """``{"tasks": {task: its results.json}}`` for every task with results in ``workdir``."""
    tasks = {}
    for name in glue.TASKS:
        path = os.path.join(workdir, name, "results.json")
        if os.path.exists(path):
            with open(path) as f:
                tasks[name] = json.load(f)
    return {"workdir": os.path.abspath(workdir), "tasks": tasks}
