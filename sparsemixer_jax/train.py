"""Training and evaluation of the Switch Transformer on a translation task.

``train_and_evaluate(config, workdir)`` is the whole experiment: data, model, optimizer, the
training loop with gradient accumulation, validation, checkpoints (resumed automatically), and
at the end beam search and BLEU on the test split for the last and the best checkpoint.

Exact resumption: the parameters, the optimizer state, the step and the data position are
checkpointed; the random keys of step ``s`` are derived from ``(seed, s)``; the learning rate
depends on the step only. A run stopped at step ``k`` and resumed to ``2k`` therefore ends with
the parameters of an uninterrupted ``2k``-step run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from sparsemixer_jax import bleu, decode, routing, runtime, sharding
from sparsemixer_jax.checkpoint import CheckpointError, Restored, RunCheckpoints, has_checkpoint
from sparsemixer_jax.data.batching import restore_order
from sparsemixer_jax.data.sources import read_split
from sparsemixer_jax.data.tokenizer import Tokenizer, get_tokenizer
from sparsemixer_jax.data.translation import load_datasets
from sparsemixer_jax.models import PAD_ID, Transformer, check_attention_impl

logger = logging.getLogger(__name__)

# Fields that may change between a run and its resumption; anything else must match.
# Config fields (or whole sections) a resumed run may change: schedules of the loop, decoding, and
# settings that change speed or float rounding but not what is trained.
RESUMABLE_CHANGES = (
    "train_steps",
    "eval_every",
    "checkpoint_every",
    "log_every",
    "decode",
    "model.attention_impl",
    "runtime.deterministic",
    "runtime.matmul_precision",
    "runtime.triton_ragged_dot",
)
# Fields added after runs were saved without them, with the value that reproduces the old behaviour:
# a saved config that lacks one is read as having this value.
ADDED_FIELD_DEFAULTS = {
    "router.top_k": 1,
    "router.balance_normalization": "per_token",
    "runtime.rng_impl": "threefry2x32",
}


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became non-finite; the update was not applied."""


class ResumeError(ValueError):
    """The workdir cannot be resumed with this config; the message names what and how to fix it."""


# ------------------------------------------------------------------------------- config checks


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first field that makes no sense, before anything compiles."""
    m, r, o = config.model, config.router, config.optim
    positive = {
        "model.encoder_layers": m.encoder_layers,
        "model.decoder_layers": m.decoder_layers,
        "model.emb_dim": m.emb_dim,
        "model.mlp_dim": m.mlp_dim,
        "model.num_heads": m.num_heads,
        "model.moe_every": m.moe_every,
        "train_steps": config.train_steps,
        "eval_every": config.eval_every,
        "checkpoint_every": config.checkpoint_every,
        "log_every": config.log_every,
        "decode.beam_size": config.decode.beam_size,
        "optim.peak_lr": o.peak_lr,
    }
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"config.{name} must be > 0, got {value}")
    if m.emb_dim % m.num_heads:
        raise ValueError(
            f"config.model.emb_dim={m.emb_dim} is not divisible by num_heads={m.num_heads}"
        )
    if m.num_experts < 0:
        raise ValueError(f"config.model.num_experts must be >= 0 (0 = dense), got {m.num_experts}")
    if r.name not in routing.ROUTERS:
        raise ValueError(f"config.router.name={r.name!r}; choose one of {sorted(routing.ROUTERS)}")
    if r.get("balance_normalization", "per_token") not in ("per_token", "per_batch"):
        raise ValueError(f"config.router.balance_normalization={r.balance_normalization!r}; "
                         "choose 'per_token' or 'per_batch'")
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0.0 <= m[name] < 1.0:
            raise ValueError(f"config.model.{name} must lie in [0, 1), got {m[name]}")
    if not 0.0 <= o.label_smoothing < 1.0:
        raise ValueError(
            f"config.optim.label_smoothing must lie in [0, 1), got {o.label_smoothing}"
        )
    if o.warmup_steps < 0 or o.init_lr < 0:
        raise ValueError("config.optim.warmup_steps and init_lr must be >= 0")
    if m.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"config.model.compute_dtype must be float32 or bfloat16, got {m.compute_dtype!r}"
        )
    try:
        check_attention_impl(m.get("attention_impl", "einsum"), m.attention_dropout)
    except ValueError as err:
        raise ValueError(f"config.model.attention_impl: {err}") from None
    if m.get("attention_impl") == "cudnn" and m.compute_dtype != "bfloat16":
        raise ValueError("config.model.attention_impl='cudnn' needs compute_dtype='bfloat16' "
                         f"(cuDNN's fused attention takes 16-bit inputs), got {m.compute_dtype!r}")
    if "runtime" in config:
        runtime.check_runtime_config(config.runtime)


# ------------------------------------------------------------------------- optimizer and loss


def learning_rate_schedule(optim: Any) -> Callable[[jax.Array], jax.Array]:
    """fairseq's ``inverse_sqrt``: linear warmup from ``init_lr`` to ``peak_lr`` over
    ``warmup_steps``, then ``peak_lr * sqrt(warmup_steps / step)``. Independent of the total
    number of steps, so a run can be extended without changing its past."""
    peak, init, warmup = float(optim.peak_lr), float(optim.init_lr), int(optim.warmup_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        if warmup == 0:
            return jnp.full_like(step, peak) / jnp.sqrt(jnp.maximum(step, 1.0))
        warm = init + (peak - init) * step / warmup
        decay = peak * jnp.sqrt(warmup / jnp.maximum(step, 1.0))
        return jnp.where(step < warmup, warm, decay)

    return schedule


def make_optimizer(optim: Any) -> optax.GradientTransformation:
    """Adam(b1, b2, eps) on the inverse-sqrt schedule; optional clipping and decoupled decay."""
    parts = []
    if optim.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(float(optim.clip_norm)))
    parts.append(
        optax.adamw(
            learning_rate=learning_rate_schedule(optim),
            b1=float(optim.b1),
            b2=float(optim.b2),
            eps=float(optim.eps),
            weight_decay=float(optim.weight_decay),
        )
    )
    return optax.chain(*parts)


def token_losses(
    logits: jax.Array, targets: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sums over non-padding target tokens.

    Args:
      logits: float32 ``[B, T, V]``; targets: int ``[B, T]`` (0 = padding).

    Returns:
      ``(smoothed, nll, tokens)``: label-smoothed cross entropy (uniform smoothing over the
      vocabulary, as fairseq's ``label_smoothed_cross_entropy``), plain negative log-likelihood,
      and the number of target tokens; float32 scalars.
    """
    weights = (targets != PAD_ID).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    smooth = -jnp.mean(log_probs, axis=-1)
    smoothed = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return jnp.sum(smoothed * weights), jnp.sum(nll * weights), jnp.sum(weights)


# ------------------------------------------------------------------------------ model and mesh


def make_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh | None:
    """The ``(data, expert)`` mesh of ``config.mesh``, or None for a single device.

    ``mesh.data = -1`` takes every device the expert axis leaves. A single process may ask for
    fewer devices than it has (the first ones are used); several processes must use them all.
    """
    available = jax.device_count()
    expert = int(config.mesh.expert)
    data = int(config.mesh.data)
    if expert < 1 or (data < 1 and data != -1):
        raise ValueError(
            f"config.mesh: expert must be >= 1 and data >= 1 or -1, got {config.mesh.to_dict()}"
        )
    if data == -1:
        if available % expert:
            raise ValueError(f"config.mesh.expert={expert} does not divide the {available} devices")
        data = available // expert
    wanted = data * expert
    if wanted > available or (wanted < available and jax.process_count() > 1):
        raise ValueError(
            f"config.mesh asks for data={data} x expert={expert} = {wanted} devices but "
            f"{available} are visible"
        )
    if config.model.num_experts and int(config.model.num_experts) % expert:
        raise ValueError(
            f"config.model.num_experts={config.model.num_experts} is not divisible by "
            f"config.mesh.expert={expert}"
        )
    if wanted == 1:
        return None
    return sharding.make_mesh(data, expert, jax.devices()[:wanted])


def build_model(
    config: ml_collections.ConfigDict, vocab_size: int, mesh: jax.sharding.Mesh | None
) -> Transformer:
    """The Transformer of ``config``, initialised from ``config.seed``, placed on ``mesh``."""
    seed = int(config.seed)
    rngs = nnx.Rngs(params=seed, dropout=seed + 1, router=seed + 2)
    model = Transformer(config, vocab_size, mesh=mesh, rngs=rngs)
    if mesh is not None:
        sharding.shard_state(model, mesh)
    return model


def count_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# --------------------------------------------------------------------------- compiled steps


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss hyperparameters (hashable: a static argument of the compiled steps)."""

    label_smoothing: float
    balance_weight: float
    z_loss_weight: float
    balance_normalization: str = "per_token"


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """``config.optim`` as a hashable value (a static argument of the compiled update)."""

    peak_lr: float
    init_lr: float
    warmup_steps: int
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_norm: float

    @classmethod
    def from_config(cls, optim: ml_collections.ConfigDict) -> OptimSettings:
        cast = {"int": int, "float": float}  # field types are strings (postponed annotations)
        return cls(**{f.name: cast[f.type](optim[f.name]) for f in dataclasses.fields(cls)})


# The compiled steps are module-level functions of (static) model structure and settings, so
# every run in a process with the same structure and shapes reuses one compilation.


def _loss(graphdef, settings: LossSettings, params, rest, batch, key):
    """Training objective of one micro-batch (summed over its tokens) and its metrics."""
    # A fresh copy of the RNG-stream variables at this trace level, so reseeding them under
    # jax.grad does not mutate the caller's.
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, nnx.State(params), rest)
    dropout_key, router_key = jax.random.split(key)
    nnx.reseed(model, dropout=dropout_key, router=router_key)
    logits, aux = model(batch["inputs"], batch["targets"], deterministic=False)
    smoothed, nll, tokens = token_losses(logits, batch["targets"], settings.label_smoothing)
    # The auxiliary losses are means over the micro-batch. "per_token" weights them by its tokens,
    # so the update's objective is mean cross entropy + weight * loss. "per_batch" adds them once
    # per micro-batch to the token-summed cross entropy, as the reference (fairseq) does, so their
    # weight per token is weight / tokens per micro-batch (about 0.01 / 8192 in the paper's runs).
    aux_loss = (
        settings.balance_weight * aux["balance_loss"] + settings.z_loss_weight * aux["z_loss"]
    )
    aux_scale = tokens if settings.balance_normalization == "per_token" else 1.0
    metrics = {
        "smoothed": smoothed,
        "nll": nll,
        "tokens": tokens,
        "balance_loss": aux["balance_loss"] * tokens,
        "z_loss": aux["z_loss"] * tokens,
        "moe": jax.tree.map(lambda v: v * tokens, aux["moe"]),
    }
    return smoothed + aux_loss * aux_scale, metrics


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_accumulator(graphdef, settings, params, rest, batch):
    shapes = jax.eval_shape(
        lambda p, r, b: _loss(graphdef, settings, p, r, b, jax.random.key(0))[1],
        params, rest, batch,
    )
    return {
        "grads": jax.tree.map(jnp.zeros_like, params),
        "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
    }


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _accumulate(graphdef, settings, params, rest, acc, batch, key):
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(
        graphdef, settings, params, rest, batch, key
    )
    return jax.tree.map(jnp.add, acc, {"grads": grads, "metrics": metrics})


def _apply_update(optim: OptimSettings, params, opt_state, acc):
    """One optimizer update from accumulated gradient sums; skipped if anything is non-finite."""
    m = acc["metrics"]
    tokens = jnp.maximum(m["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, acc["grads"])
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(m["smoothed"])
    updates, new_opt_state = make_optimizer(optim).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep_if_finite(new, old):
        return jnp.where(finite, new, old)

    params = jax.tree.map(keep_if_finite, new_params, params)
    opt_state = jax.tree.map(keep_if_finite, new_opt_state, opt_state)
    out = {
        "loss": m["smoothed"] / tokens,
        "nll": m["nll"] / tokens,
        "balance_loss": m["balance_loss"] / tokens,
        "z_loss": m["z_loss"] / tokens,
        "grad_norm": grad_norm,
        "tokens": m["tokens"],
        "finite": finite,
        "moe": jax.tree.map(lambda v: v / tokens, m["moe"]),
    }
    return params, opt_state, out


_update = functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 2))(_apply_update)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 5))
def _train_step(graphdef, settings, optim: OptimSettings, params, rest, opt_state, batch, key):
    """A whole update from one micro-batch in one compiled call: gradient, then optimizer.

    The same arithmetic as ``_accumulate`` on a zero accumulator followed by ``_update``, without
    materialising the accumulator, with one dispatch instead of three, and with XLA free to fuse
    the gradient's last ops into the optimizer's. Parameters and optimizer state are donated.
    """
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(
        graphdef, settings, params, rest, batch, key
    )
    return _apply_update(optim, params, opt_state, {"grads": grads, "metrics": metrics})


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(graphdef, settings: LossSettings, params, rest, batch):
    """``[smoothed, nll, tokens]`` sums of the deterministic forward on one batch."""
    model = nnx.merge(graphdef, nnx.State(params), rest)
    logits, _ = model(batch["inputs"], batch["targets"], deterministic=True)
    return jnp.stack(token_losses(logits, batch["targets"], settings.label_smoothing))


@functools.partial(jax.jit, static_argnums=(0,))
def _init_optimizer(optim: OptimSettings, params):
    return make_optimizer(optim).init(params)


class Steps:
    """The compiled steps bound to one model: gradient accumulation, update, evaluation.

    Parameters travel as a pure pytree (nested dict of arrays) so that optax and orbax see plain
    arrays; the rest of the model state (RNG streams) is reseeded from an explicit key per
    micro-batch, which is what makes resumption exact.
    """

    def __init__(self, model: Transformer, config: ml_collections.ConfigDict):
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = nnx.to_pure_dict(params)
        self.optim = OptimSettings.from_config(config.optim)
        self.schedule = learning_rate_schedule(self.optim)
        self.loss = LossSettings(
            label_smoothing=float(config.optim.label_smoothing),
            balance_weight=float(config.router.balance_weight),
            z_loss_weight=float(config.router.z_loss_weight),
            balance_normalization=str(config.router.get("balance_normalization", "per_token")),
        )

    def init_opt(self, params):
        return _init_optimizer(self.optim, params)

    def zeros(self, params, batch):
        return _zero_accumulator(self.graphdef, self.loss, params, self.rest, batch)

    def accumulate(self, params, acc, batch, key):
        return _accumulate(self.graphdef, self.loss, params, self.rest, acc, batch, key)

    def update(self, params, opt_state, acc):
        return _update(self.optim, params, opt_state, acc)

    def train_step(self, params, opt_state, micro_batches, step_key):
        """One update from ``micro_batches`` (device batches); micro-batch ``j`` draws its
        randomness from ``fold_in(step_key, j)``. Returns ``(params, opt_state, metrics)``.

        One micro-batch: a single compiled call (:func:`_train_step`). Several: zero, accumulate
        each, update (three kinds of calls). Both donate ``params`` and ``opt_state``.
        """
        if len(micro_batches) == 1:
            return _train_step(self.graphdef, self.loss, self.optim, params, self.rest,
                               opt_state, micro_batches[0], jax.random.fold_in(step_key, 0))
        acc = self.zeros(params, micro_batches[0])
        for j, batch in enumerate(micro_batches):
            acc = self.accumulate(params, acc, batch, jax.random.fold_in(step_key, j))
        return self.update(params, opt_state, acc)

    def evaluate(self, params, batch):
        return _evaluate(self.graphdef, self.loss, params, self.rest, batch)

    def model(self, params: Any) -> Transformer:
        """A Transformer module holding ``params`` (for decoding)."""
        return nnx.merge(self.graphdef, nnx.State(params), self.rest)


# ----------------------------------------------------------------------------- data on devices


class DevicePlacer:
    """Turns this host's numpy batch into a global array sharded over the mesh's data axis."""

    def __init__(self, mesh: jax.sharding.Mesh | None):
        self.sharding = None if mesh is None else sharding.batch_sharding(mesh)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        arrays = {k: batch[k] for k in ("inputs", "targets")}
        if self.sharding is None:
            return {k: jnp.asarray(v) for k, v in arrays.items()}
        return {
            k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in arrays.items()
        }


def accumulation_steps(config: ml_collections.ConfigDict) -> int:
    """Micro-batches per update so that an update sees about ``optim.tokens_per_update`` tokens."""
    per_update = int(config.optim.tokens_per_update)
    return max(1, math.ceil(per_update / int(config.data.max_tokens))) if per_update > 0 else 1


def evaluate_loss(steps: Steps, params, batches, place: DevicePlacer) -> dict[str, float]:
    """Token-averaged label-smoothed loss and NLL over ``batches`` (deterministic forward)."""
    total = np.zeros(3)
    for batch in batches:
        total += np.asarray(jax.device_get(steps.evaluate(params, place(batch))))
    smoothed, nll, tokens = total
    tokens = max(tokens, 1.0)
    return {
        "valid_loss": float(smoothed / tokens),
        "valid_nll": float(nll / tokens),
        "valid_ppl": float(np.exp(min(nll / tokens, 50.0))),
    }


def translate_batches(
    model: Transformer,
    batches: list[dict[str, np.ndarray]],
    tokenizer: Tokenizer,
    num_sentences: int,
    decode_config: ml_collections.ConfigDict,
    place: DevicePlacer,
) -> list[str]:
    """Beam search over eval ``batches``; detokenized hypotheses in file order."""
    from jax.experimental import multihost_utils

    rows, outputs = [], []
    for batch in batches:
        inputs = place(batch)["inputs"]
        seqs, _ = decode.beam_search_model(
            model,
            inputs,
            eos_id=tokenizer.eos_id,
            beam_size=int(decode_config.beam_size),
            alpha=float(decode_config.length_penalty),
            max_extra_len=int(decode_config.max_extra_len),
        )
        best = seqs[:, 0]
        index = batch["index"]
        if jax.process_count() > 1:
            # Both as global arrays placed alike, so their rows line up whatever the device order.
            index = jax.make_array_from_process_local_data(place.sharding, index)
            best = multihost_utils.process_allgather(best, tiled=True)
            index = multihost_utils.process_allgather(index, tiled=True)
        rows.append({"index": np.asarray(index)})
        outputs.append([tokenizer.decode(row.tolist()) for row in np.asarray(best)])
    return restore_order(rows, outputs, num_sentences)


# ---------------------------------------------------------------------------------- logging


class MetricLog:
    """``metrics.jsonl`` and TensorBoard, written by process 0 only."""

    def __init__(self, workdir: str, resume_step: int):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.writer = None
        if not self.active:
            return
        if os.path.exists(self.path):
            # Drop records a killed run wrote after its last checkpoint: they will be redone.
            kept = []
            with open(self.path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by the kill
                        continue
                    if record["step"] <= resume_step:  # (a kill can also cut just the "\n")
                        kept.append(line if line.endswith("\n") else line + "\n")
            _write_atomically(self.path, "".join(kept))
        try:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is always written
            logger.warning("tensorboardX not installed: no TensorBoard logs")

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _to_python(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x).tolist(), jax.device_get(tree))


# --------------------------------------------------------------------------------- the loop


def _test_bleu(config, workdir, steps, params, opt_state, checkpoints, best_step, data, place):
    """Beam search on the test split with the last and the best checkpoint; BLEU of each."""
    hyps = {"last": translate_batches(steps.model(params), data.test, data.tokenizer,
                                      len(data.test_sources), config.decode, place)}
    if best_step == int(config.train_steps):  # the best is the last: decode once
        hyps["best"] = hyps["last"]
    elif best_step > 0:
        template = {"params": params, "opt_state": opt_state}
        try:
            best_state = checkpoints.restore_checked("best", best_step, template).state
        except CheckpointError as e:  # the run's result stands; only its best BLEU is missing
            logger.warning("no test BLEU of the best checkpoint: %s", e)
        else:
            hyps["best"] = translate_batches(steps.model(best_state["params"]), data.test,
                                             data.tokenizer, len(data.test_sources),
                                             config.decode, place)
    results = {}
    for name, texts in hyps.items():
        suffix = "" if name == "last" else "_best"
        results[f"bleu{suffix}"] = bleu.sacre_bleu(texts, data.test_references)
        results[f"tokenized_bleu{suffix}"] = bleu.tokenized_bleu(
            texts, data.test_references, lang=config.data.tgt
        )
        if jax.process_index() == 0:
            with open(os.path.join(workdir, f"translations_{name}.txt"), "w") as f:
                f.writelines(h + "\n" for h in texts)
    return results


def resume_from_newest_intact(
    checkpoints: RunCheckpoints, template: dict, workdir: str, train_steps: int
) -> Restored | None:
    """The newest intact checkpoint (``last`` or ``best``) to resume from, or None for a new run.

    Raises :class:`ResumeError` (one line) when checkpoints exist but none can be read, or when
    the run is already past ``train_steps``. A ``best`` checkpoint resumed from is copied to
    ``last``: its full training state is nowhere else once later best checkpoints replace it.
    Shared by the translation and the pretraining loops.
    """
    try:
        restored = checkpoints.restore_newest_intact(template)
    except CheckpointError as e:
        checkpoints.close()
        raise ResumeError(str(e)) from None
    if restored is None:
        return None
    if restored.step > train_steps:
        checkpoints.close()
        raise ResumeError(
            f"config.train_steps={train_steps} but {workdir} holds a checkpoint of step "
            f"{restored.step}: set config.train_steps >= {restored.step}, or use a fresh --workdir"
        )
    if restored.kind == "best" and restored.step not in checkpoints.last.all_steps():
        checkpoints.save_last(restored.step, restored.state, restored.meta)
    logger.info("resumed from %s (step %d)", restored.directory, restored.step)
    return restored


def _check_resume_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Refuses to resume a workdir whose saved config differs in anything but RESUMABLE_CHANGES.

    A workdir without a checkpoint (a run stopped by a config or data error) starts afresh with
    the new config; its cached vocabulary is dropped if the data settings changed.
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    current = json.loads(config.to_json())
    if not has_checkpoint(workdir):
        vocabulary = os.path.join(workdir, "spm.model")
        stale = saved.get("data") != current.get("data") or saved.get("seed") != current.get("seed")
        if stale and jax.process_index() == 0 and os.path.exists(vocabulary):
            logger.info("data settings changed, nothing trained yet: retraining %s", vocabulary)
            os.remove(vocabulary)
        return
    changed = [
        f"config.{name} (saved {before!r}, now {after!r})"
        for name, (before, after) in _config_differences(saved, current).items()
        if name not in RESUMABLE_CHANGES and name.split(".")[0] not in RESUMABLE_CHANGES
    ]
    if changed:
        raise ResumeError(
            f"workdir {workdir} holds a run with a different {'; '.join(changed)}: "
            "restore the saved setting, or use a fresh --workdir"
        )


def _config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (saved, current)}`` of every leaf that differs; mesh sizes are compared
    as resolved on this machine (``mesh.data = -1`` and the device count it stands for agree)."""
    missing = object()
    saved, current = _resolved_mesh(saved), _resolved_mesh(current)
    flat_saved, flat_current = (
        {k.replace("/", "."): v for k, v in _flatten(c).items()} for c in (saved, current)
    )
    out = {}
    for name in sorted(set(flat_saved) | set(flat_current)):
        before = flat_saved.get(name, ADDED_FIELD_DEFAULTS.get(name, missing))
        after = flat_current.get(name, missing)
        if before != after:
            out[name] = tuple(None if v is missing else v for v in (before, after))
    return out


def _resolved_mesh(config: dict) -> dict:
    mesh = config.get("mesh")
    if not isinstance(mesh, dict) or mesh.get("data") != -1:
        return config
    expert = int(mesh.get("expert", 1)) or 1
    return {**config, "mesh": {**mesh, "data": jax.device_count() // expert}}


def _write_atomically(path: str, text: str) -> None:
    """A reader sees the old file or the new one, never a half-written one."""
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w") as f:
        f.write(text)
    os.replace(tmp_path, path)


def _wait_for_all_processes(name: str, timeout_s: int = 4 * 3600) -> None:
    """Barrier across processes, then the first collective while they are in step.

    ``multihost_utils.sync_global_devices`` alone is a collective, and on CPU hosts its first use
    sets up gloo with a 30 s deadline: too short for process 0 training a vocabulary while the
    others wait. The coordination service's barrier waits as long as needed.
    """
    from jax._src import distributed  # the coordination-service client; no public wrapper yet
    from jax.experimental import multihost_utils

    distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)
    multihost_utils.sync_global_devices(name)


def _progress(total: int, initial: int):
    """A tqdm bar of training steps on process 0 (None elsewhere); see :func:`_advance`."""
    if jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=2.0)


def _advance(progress, compiled: bool) -> None:
    """One step done. A step that compiled (the first of each batch shape: tens of seconds on a
    CPU) is counted but not timed, so the rate and the ETA are those of the steps to come; tqdm's
    smoothed rate would otherwise carry the stall for many updates (an opening ETA of an hour for
    a run of a minute)."""
    if progress is None:
        return
    if compiled:
        progress.unpause()  # restarts the clock: the time since the last refresh is dropped
    progress.update(1)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (resuming from ``workdir`` if it holds a checkpoint), evaluates, writes results.

    Returns the results dict that is also written to ``{workdir}/results.json``.
    Raises :class:`TrainingDiverged` if the loss becomes non-finite.
    """
    check_config(config)
    runtime.configure(config)  # before any key is made (experiments.wmt calls it before JAX starts)
    os.makedirs(workdir, exist_ok=True)
    _check_resume_config(workdir, config)
    is_main = jax.process_index() == 0
    if is_main:  # atomically: the other processes may be reading it in _check_resume_config
        _write_atomically(os.path.join(workdir, "config.json"), config.to_json(indent=1))

    mesh = make_mesh(config)
    data_parallel = 1 if mesh is None else mesh.size  # the batch is split over every device
    raw_train = None
    if jax.process_count() > 1:
        # Process 0 trains the vocabulary; then every host loads its data at the same time.
        if is_main:
            raw_train = read_split(config, "train")
            get_tokenizer(config, workdir, raw_train)
        _wait_for_all_processes("vocabulary ready")
    data = load_datasets(config, workdir, batch_multiple=data_parallel,
                                        raw_train=raw_train)
    del raw_train
    if jax.process_count() > 1:
        _wait_for_all_processes("data ready")

    model = build_model(config, data.tokenizer.vocab_size, mesh)
    steps = Steps(model, config)
    del model
    place = DevicePlacer(mesh)
    params = steps.params
    opt_state = steps.init_opt(params)
    accum = accumulation_steps(config)
    logger.info(
        "model: %s parameters; %d micro-batches of <= %d tokens per update; mesh %s",
        f"{count_params(params):,}", accum, config.data.max_tokens,
        None if mesh is None else dict(mesh.shape),
    )

    checkpoints = RunCheckpoints(workdir)
    start_step, best_loss, best_step = 0, math.inf, -1
    restored = resume_from_newest_intact(
        checkpoints, {"params": params, "opt_state": opt_state}, workdir, int(config.train_steps)
    )
    if restored is not None:
        params, opt_state = restored.state["params"], restored.state["opt_state"]
        start_step = restored.step
        meta = restored.meta
        best_loss, best_step = float(meta["best_valid_loss"]), int(meta["best_step"])
        data.train.restore(meta["data"])
    log = MetricLog(workdir, start_step)
    key = jax.random.key(int(config.seed) + 3)
    train_steps = int(config.train_steps)
    train_iter: Iterator = data.train
    progress = _progress(train_steps, start_step)

    def meta_for(step: int) -> dict:
        return {"step": step, "data": data.train.state(), "best_valid_loss": best_loss,
                "best_step": best_step}

    train_time, train_tokens = 0.0, 0.0
    step_rates = []  # tokens/s of each step: their median leaves out the compilation stalls
    pending = None  # metrics of the last step, read one step late so the host never waits idle
    seen_shapes = set()  # batch shapes the step functions were compiled for
    valid = {}

    def finish_step(record) -> None:
        nonlocal train_tokens
        step, metrics, started, moe_due = record
        metrics = jax.device_get(metrics)
        elapsed = time.perf_counter() - started
        if not bool(metrics["finite"]):
            log.write({"step": step, "error": "non-finite loss or gradient",
                       "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])})
            raise TrainingDiverged(
                f"step {step}: loss {float(metrics['loss'])} / gradient norm "
                f"{float(metrics['grad_norm'])} is not finite; the update was not applied and no "
                f"checkpoint was written after step {checkpoints.last.latest_step()} "
                f"(the last good one, in {workdir}/checkpoints/last). Lower optim.peak_lr, set "
                "optim.clip_norm, or use float32 compute."
            )
        train_tokens += float(metrics["tokens"])
        entry = {"step": step, "loss": float(metrics["loss"]), "nll": float(metrics["nll"]),
                 "lr": float(steps.schedule(step - 1)), "grad_norm": float(metrics["grad_norm"]),
                 "tokens": float(metrics["tokens"]), "balance_loss": float(metrics["balance_loss"]),
                 "z_loss": float(metrics["z_loss"]),
                 "tokens_per_s": float(metrics["tokens"]) / max(elapsed, 1e-9)}
        step_rates.append(entry["tokens_per_s"])
        if moe_due and metrics["moe"]:
            entry["moe"] = _to_python(metrics["moe"])
        log.write(entry)
        if progress is not None:
            progress.set_postfix(
                loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.2e}", refresh=False
            )

    try:
        for step in range(start_step + 1, train_steps + 1):
            started = time.perf_counter()
            micro = [next(train_iter) for _ in range(accum)]
            new_shapes = {b["inputs"].shape + b["targets"].shape for b in micro} - seen_shapes
            seen_shapes |= new_shapes
            params, opt_state, metrics = steps.train_step(
                params, opt_state, [place(batch) for batch in micro], jax.random.fold_in(key, step))
            if pending is not None:
                finish_step(pending)
            pending = (step, metrics, started, step % int(config.log_every) == 0)
            train_time += time.perf_counter() - started
            _advance(progress, compiled=bool(new_shapes))

            is_last = step == train_steps
            if step % int(config.eval_every) == 0 or is_last:
                finish_step(pending)
                pending = None
                valid = evaluate_loss(steps, params, data.valid, place)
                log.write({"step": step, **valid})
                if valid["valid_loss"] < best_loss:
                    best_loss, best_step = valid["valid_loss"], step
                    checkpoints.save_best(step, {"params": params, "opt_state": opt_state},
                                          meta_for(step))
                logger.info("step %d: %s", step, valid)
            if step % int(config.checkpoint_every) == 0 or is_last:
                if pending is not None:
                    finish_step(pending)
                    pending = None
                checkpoints.save_last(step, {"params": params, "opt_state": opt_state},
                                      meta_for(step))
        if pending is not None:
            finish_step(pending)
    finally:
        checkpoints.wait()
        if progress is not None:
            progress.close()

    if not valid:  # resumed a finished run: nothing trained, evaluate what is there
        valid = evaluate_loss(steps, params, data.valid, place)
    results = {
        "steps": train_steps,
        "valid_loss": valid["valid_loss"],
        "valid_nll": valid["valid_nll"],
        "best_valid_loss": best_loss,
        "best_step": best_step,
        "tokens_per_second": train_tokens / train_time if train_time > 0 else None,
        "tokens_per_second_median_step": float(np.median(step_rates)) if step_rates else None,
        "train_time_s": train_time,
        "num_params": count_params(params),
        "data_stats": data.stats,
    }
    if config.decode.test_bleu:
        results.update(_test_bleu(config, workdir, steps, params, opt_state, checkpoints,
                                  best_step, data, place))
    results["config"] = json.loads(config.to_json())
    if is_main:
        _write_atomically(os.path.join(workdir, "results.json"), json.dumps(results, indent=1))
    log.close()
    checkpoints.close()
    return results
