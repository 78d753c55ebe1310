"""ELECTRA-style pretraining of the MoE encoder (the paper's second experiment).

``pretrain(config, workdir)`` is the whole run: text, vocabulary, packing, the generator +
discriminator (:mod:`sparsemixer_jax.electra`), the training loop with gradient accumulation,
validation on held-out text, checkpoints (resumed automatically) and ``results.json``.
``load_discriminator(workdir)`` gives the pretrained discriminator to fine-tune.

The loop keeps the translation loop's guarantees and reuses its pieces
(:mod:`sparsemixer_jax.train`): ``metrics.jsonl`` / TensorBoard, the progress bar, the config
check on resumption, the non-finite stop. Exact resumption: params, optimizer state, step and
data position are checkpointed; the keys of step ``s`` come from ``(seed, s)``; a batch's
masking from ``(seed, epoch, index)``; the learning rate from the step only (linear decay to
``optim.decay_steps``, not to ``train_steps``, so a run can be extended without changing its past).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from sparsemixer_jax import routing, sharding, train
from sparsemixer_jax.checkpoint import RunCheckpoints
from sparsemixer_jax.data import text
from sparsemixer_jax.data.tokenizer import Tokenizer
from sparsemixer_jax.electra import Electra, LossSettings, electra_loss, generator_config
from sparsemixer_jax.encoder import Encoder

logger = logging.getLogger(__name__)

TrainingDiverged = train.TrainingDiverged


# ------------------------------------------------------------------------------- config checks


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first field that makes no sense, before anything loads."""
    for section in ("data", "model", "router", "optim", "mesh"):
        if section not in config:
            raise ValueError(f"config has no `{section}` section (schema: configs/electra_base.py)")
    d, m, r, o = config.data, config.model, config.router, config.optim
    positive = {
        "data.vocab_size": d.vocab_size,
        "data.batch_size": d.batch_size,
        "model.num_layers": m.num_layers,
        "model.emb_dim": m.emb_dim,
        "model.mlp_dim": m.mlp_dim,
        "model.num_heads": m.num_heads,
        "model.moe_every": m.moe_every,
        "train_steps": config.train_steps,
        "eval_every": config.eval_every,
        "checkpoint_every": config.checkpoint_every,
        "log_every": config.log_every,
        "optim.peak_lr": o.peak_lr,
        "optim.decay_steps": o.decay_steps,
    }
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"config.{name} must be > 0, got {value}")
    if d.seq_len < 8:
        raise ValueError(f"config.data.seq_len must be >= 8, got {d.seq_len}")
    if d.vocab_size <= text.FIRST_WORD_ID:
        raise ValueError(f"config.data.vocab_size must exceed {text.FIRST_WORD_ID} special ids")
    micro = int(d.micro_batch_size) or int(d.batch_size)
    if micro < 0 or d.batch_size % micro:
        raise ValueError(
            f"config.data.micro_batch_size={d.micro_batch_size} must divide "
            f"config.data.batch_size={d.batch_size} (0 = no accumulation)"
        )
    for name in ("mask_prob", "mask_token_prob", "pair_prob"):
        if not 0.0 <= d[name] <= 1.0:
            raise ValueError(f"config.data.{name} must lie in [0, 1], got {d[name]}")
    if not d.mask_prob > 0:
        raise ValueError("config.data.mask_prob must be > 0: nothing would be replaced")
    if m.emb_dim % m.num_heads:
        raise ValueError(
            f"config.model.emb_dim={m.emb_dim} is not divisible by num_heads={m.num_heads}"
        )
    if m.num_experts < 0:
        raise ValueError(f"config.model.num_experts must be >= 0 (0 = dense), got {m.num_experts}")
    if r.name not in routing.ROUTERS:
        raise ValueError(f"config.router.name={r.name!r}; choose one of {sorted(routing.ROUTERS)}")
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0.0 <= m[name] < 1.0:
            raise ValueError(f"config.model.{name} must lie in [0, 1), got {m[name]}")
    if m.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"config.model.compute_dtype must be float32 or bfloat16, got {m.compute_dtype!r}"
        )
    if o.warmup_steps < 0 or o.warmup_steps >= o.decay_steps:
        raise ValueError(
            f"config.optim.warmup_steps={o.warmup_steps} must lie in [0, decay_steps="
            f"{o.decay_steps})"
        )
    if o.disc_weight < 0:
        raise ValueError(f"config.optim.disc_weight must be >= 0, got {o.disc_weight}")
    g = generator_config(config).model  # validates config.generator's fields
    if g.emb_dim % g.num_heads:
        raise ValueError(f"config.generator.num_heads={g.num_heads} does not divide emb_dim")
    if not g.num_layers > 0:
        raise ValueError(f"config.generator.num_layers must be > 0, got {g.num_layers}")


# ------------------------------------------------------------------------------------- data


class PretrainData(NamedTuple):
    tokenizer: Tokenizer
    train: text.PretrainBatches
    valid: list[dict[str, np.ndarray]]
    stats: dict[str, Any]


def _packed(config, tokenizer: Tokenizer, path: str) -> tuple[np.ndarray, np.ndarray, dict]:
    documents = text.read_documents(path)
    paragraphs = [p for doc in documents for p in doc]
    tokens, segments = text.tokenize_and_pack(
        tokenizer, paragraphs, int(config.data.seq_len), pair_prob=float(config.data.pair_prob),
        seed=int(config.seed),
    )
    stats = {"documents": len(documents), "paragraphs": len(paragraphs),
             "sequences": len(tokens), "fill": float(np.mean(tokens != text.PAD_ID))}
    return tokens, segments, stats


def load_data(config: ml_collections.ConfigDict, workdir: str) -> PretrainData:
    """Reads, tokenizes (training the vocabulary if needed), packs; the batch streams."""
    d = config.data
    documents = text.read_documents(d.train)
    paragraphs = [p for doc in documents for p in doc]
    if jax.process_count() > 1 and jax.process_index() != 0:
        train._wait_for_all_processes("vocabulary ready")
    tokenizer = text.get_text_tokenizer(config, workdir, paragraphs)
    if jax.process_count() > 1 and jax.process_index() == 0:
        train._wait_for_all_processes("vocabulary ready")
    tokens, segments = text.tokenize_and_pack(
        tokenizer, paragraphs, int(d.seq_len), pair_prob=float(d.pair_prob),
        seed=int(config.seed),
    )
    stats = {"train": {"documents": len(documents), "paragraphs": len(paragraphs),
                       "sequences": len(tokens),
                       "fill": float(np.mean(tokens != text.PAD_ID))}}
    micro = int(d.micro_batch_size) or int(d.batch_size)
    mask = {"mask_prob": float(d.mask_prob), "mask_token_prob": float(d.mask_token_prob)}
    processes = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    batches = text.PretrainBatches(tokens, segments, micro, seed=int(config.seed), **mask,
                                   **processes)
    v_tokens, v_segments, stats["valid"] = _packed(config, tokenizer, d.valid)
    if int(d.valid_sequences) > 0:
        v_tokens, v_segments = v_tokens[: d.valid_sequences], v_segments[: d.valid_sequences]
    stats["valid"]["evaluated_sequences"] = len(v_tokens)
    valid = text.eval_batches(v_tokens, v_segments, micro, seed=int(config.seed), **mask,
                              **processes)
    return PretrainData(tokenizer, batches, valid, stats)


class BatchPlacer:
    """This host's numpy batch as global arrays sharded over the mesh's data axis."""

    KEYS = ("tokens", "segments", "inputs", "selected")

    def __init__(self, mesh: jax.sharding.Mesh | None):
        self.sharding = None if mesh is None else sharding.batch_sharding(mesh)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.sharding is None:
            return {k: jnp.asarray(batch[k]) for k in self.KEYS}
        return {k: jax.make_array_from_process_local_data(self.sharding, batch[k])
                for k in self.KEYS}


# ------------------------------------------------------------------------ model and optimizer


def build_model(
    config: ml_collections.ConfigDict, vocab_size: int, mesh: jax.sharding.Mesh | None = None
) -> Electra:
    """The generator + discriminator of ``config``, initialised from ``config.seed``."""
    seed = int(config.seed)
    model = Electra(config, vocab_size, mesh=mesh,
                    rngs=nnx.Rngs(params=seed, dropout=seed + 1, router=seed + 2))
    if mesh is not None:
        sharding.shard_state(model, mesh)
    return model


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """``config.optim`` as a hashable value (a static argument of the compiled update)."""

    peak_lr: float
    warmup_steps: int
    decay_steps: int
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_norm: float

    @classmethod
    def from_config(cls, optim: ml_collections.ConfigDict) -> OptimSettings:
        cast = {"int": int, "float": float}
        return cls(**{f.name: cast[f.type](optim[f.name]) for f in dataclasses.fields(cls)})


def learning_rate_schedule(optim: OptimSettings):
    """Linear warm-up to ``peak_lr`` over ``warmup_steps`` updates, then linear decay to 0 at
    ``decay_steps`` (BERT / ELECTRA). Written by hand rather than with optax's linear schedules
    because optax counts from 0, which would make the first update's learning rate 0."""
    peak, warmup, decay = optim.peak_lr, optim.warmup_steps, optim.decay_steps

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # the update being computed, from 1
        warm = peak * step / max(warmup, 1)
        decayed = peak * jnp.maximum(decay - step, 0.0) / (decay - warmup)
        return jnp.where(step <= warmup, warm, decayed)

    return schedule


def weight_decay_mask(params: Any) -> Any:
    """True for the weights that decay: matrices and embedding tables (kernels, stacked experts),
    not biases, LayerNorm scales, SparseMixer's omega, nor MoE expert biases ``bi``/``bo``
    (``[E, F]``: matrices by shape, biases by role), as BERT / ELECTRA. Fine-tuning uses it too."""

    def decays(path, leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1])) if path else ""
        return leaf.ndim >= 2 and "bias" not in name and name not in ("bi", "bo")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optim: OptimSettings) -> optax.GradientTransformation:
    parts = []
    if optim.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_norm))
    parts.append(optax.adamw(learning_rate=learning_rate_schedule(optim), b1=optim.b1,
                             b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                             mask=weight_decay_mask))
    return optax.chain(*parts)


# --------------------------------------------------------------------------- compiled steps


def _loss(graphdef, settings: LossSettings, params, rest, batch, key):
    rest = jax.tree.map(lambda x: x, rest)  # reseeding below must not touch the caller's streams
    model = nnx.merge(graphdef, nnx.State(params), rest)
    dropout_key, router_key, sample_key = jax.random.split(key, 3)
    nnx.reseed(model, dropout=dropout_key, router=router_key)
    loss, metrics = electra_loss(model, batch, sample_key, settings)
    del metrics["corrupted"]
    metrics["loss"] = loss
    return loss, metrics


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_accumulator(graphdef, settings, params, rest, batch):
    shapes = jax.eval_shape(
        lambda p, r, b: _loss(graphdef, settings, p, r, b, jax.random.key(0))[1],
        params, rest, batch,
    )
    return {"grads": jax.tree.map(jnp.zeros_like, params),
            "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)}


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _accumulate(graphdef, settings, params, rest, acc, batch, key):
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(
        graphdef, settings, params, rest, batch, key
    )
    return jax.tree.map(jnp.add, acc, {"grads": grads, "metrics": metrics})


def _summary(m: dict[str, Any], micro_batches) -> dict[str, Any]:
    """Per-update metrics from summed micro-batch metrics: token-weighted rates, mean losses."""
    safe = lambda x: jnp.maximum(x, 1.0)
    return {
        "loss": m["loss"] / micro_batches,
        "mlm_loss": m["mlm_nll"] / safe(m["mlm_count"]),
        "mlm_accuracy": m["mlm_correct"] / safe(m["mlm_count"]),
        "disc_loss": m["disc_nll"] / safe(m["disc_count"]),
        "disc_accuracy": m["disc_correct"] / safe(m["disc_count"]),
        "replaced_fraction": m["replaced"] / safe(m["disc_count"]),
        "replaced_recall": m["replaced_correct"] / safe(m["replaced"]),
        "balance_loss": m["balance_loss"] / micro_batches,
        "z_loss": m["z_loss"] / micro_batches,
        "tokens": m["disc_count"],
        "moe": jax.tree.map(lambda v: v / micro_batches, m["moe"]),
    }


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _update(optim: OptimSettings, micro_batches: int, params, opt_state, acc):
    """One optimizer update from summed micro-batch gradients; skipped if anything is
    non-finite."""
    grads = jax.tree.map(lambda g: g / micro_batches, acc["grads"])
    out = _summary(acc["metrics"], micro_batches)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(out["loss"])
    updates, new_opt_state = make_optimizer(optim).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, opt_state, {**out, "grad_norm": grad_norm, "finite": finite}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(graphdef, settings: LossSettings, params, rest, batch, key):
    """Summed metrics of the deterministic forward on one batch (the replacements are still
    sampled, from a fixed key)."""
    model = nnx.merge(graphdef, nnx.State(params), rest)
    _, metrics = electra_loss(model, batch, key, settings, deterministic=True)
    keep = ("mlm_nll", "mlm_correct", "mlm_count", "disc_nll", "disc_correct", "disc_count",
            "replaced", "replaced_correct")
    return {k: metrics[k] for k in keep}


@functools.partial(jax.jit, static_argnums=(0,))
def _init_optimizer(optim: OptimSettings, params):
    return make_optimizer(optim).init(params)


class Steps:
    """The compiled steps bound to one model (parameters travel as a pure pytree)."""

    def __init__(self, model: Electra, config: ml_collections.ConfigDict):
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = nnx.to_pure_dict(params)
        self.optim = OptimSettings.from_config(config.optim)
        self.schedule = learning_rate_schedule(self.optim)
        self.loss = LossSettings(
            disc_weight=float(config.optim.disc_weight),
            balance_weight=float(config.router.balance_weight),
            z_loss_weight=float(config.router.z_loss_weight),
            mask_prob=float(config.data.mask_prob),
        )
        self.eval_key = jax.random.key(int(config.seed) + 5)

    def init_opt(self, params):
        return _init_optimizer(self.optim, params)

    def zeros(self, params, batch):
        return _zero_accumulator(self.graphdef, self.loss, params, self.rest, batch)

    def accumulate(self, params, acc, batch, key):
        return _accumulate(self.graphdef, self.loss, params, self.rest, acc, batch, key)

    def update(self, params, opt_state, acc, micro_batches: int):
        return _update(self.optim, micro_batches, params, opt_state, acc)

    def evaluate(self, params, batch):
        return _evaluate(self.graphdef, self.loss, params, self.rest, batch, self.eval_key)

    def model(self, params) -> Electra:
        return nnx.merge(self.graphdef, nnx.State(params), self.rest)


def evaluate(steps: Steps, params, batches, place: BatchPlacer, disc_weight: float) -> dict:
    """Validation metrics over ``batches`` (token-weighted over the whole set)."""
    total = None
    for batch in batches:
        sums = jax.device_get(steps.evaluate(params, place(batch)))
        total = sums if total is None else jax.tree.map(np.add, total, sums)
    safe = lambda x: max(float(x), 1.0)
    mlm = float(total["mlm_nll"]) / safe(total["mlm_count"])
    disc = float(total["disc_nll"]) / safe(total["disc_count"])
    return {
        "valid_loss": mlm + disc_weight * disc,
        "valid_mlm_loss": mlm,
        "valid_mlm_accuracy": float(total["mlm_correct"]) / safe(total["mlm_count"]),
        "valid_disc_loss": disc,
        "valid_disc_accuracy": float(total["disc_correct"]) / safe(total["disc_count"]),
        "valid_replaced_fraction": float(total["replaced"]) / safe(total["disc_count"]),
        "valid_replaced_recall": float(total["replaced_correct"]) / safe(total["replaced"]),
    }


# --------------------------------------------------------------------------------- the loop


def pretrain(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Pretrains (resuming from ``workdir`` if it holds a checkpoint); writes results.json.

    Raises :class:`TrainingDiverged` if the loss or gradient becomes non-finite.
    """
    check_config(config)
    os.makedirs(workdir, exist_ok=True)
    train._check_resume_config(workdir, config)
    is_main = jax.process_index() == 0
    if is_main:
        train._write_atomically(os.path.join(workdir, "config.json"), config.to_json(indent=1))

    mesh = train.make_mesh(config)
    data = load_data(config, workdir)
    model = build_model(config, data.tokenizer.vocab_size, mesh)
    steps = Steps(model, config)
    del model
    place = BatchPlacer(mesh)
    params = steps.params
    opt_state = steps.init_opt(params)
    micro = int(config.data.micro_batch_size) or int(config.data.batch_size)
    accum = int(config.data.batch_size) // micro
    logger.info("model: %s parameters; %d micro-batches of %d sequences per update; data %s",
                f"{train.count_params(params):,}", accum, micro, data.stats)

    checkpoints = RunCheckpoints(workdir)
    start_step, best_loss, best_step = 0, math.inf, -1
    restored = train.resume_from_newest_intact(
        checkpoints, {"params": params, "opt_state": opt_state}, workdir, int(config.train_steps)
    )
    if restored is not None:
        params, opt_state = restored.state["params"], restored.state["opt_state"]
        start_step = restored.step
        meta = restored.meta
        best_loss, best_step = float(meta["best_valid_loss"]), int(meta["best_step"])
        data.train.restore(meta["data"])
    log = train.MetricLog(workdir, start_step)
    key = jax.random.key(int(config.seed) + 3)
    train_steps = int(config.train_steps)
    progress = train._progress(train_steps, start_step)
    disc_weight = float(config.optim.disc_weight)

    def meta_for(step: int) -> dict:
        return {"step": step, "data": data.train.state(), "best_valid_loss": best_loss,
                "best_step": best_step}

    train_time, train_tokens, step_rates = 0.0, 0.0, []
    pending = None  # the last step's metrics, read one step late so the host never waits idle
    valid: dict[str, float] = {}

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
                f"checkpoint was written after step {checkpoints.last.latest_step()} (in "
                f"{workdir}/checkpoints/last). Lower optim.peak_lr, set optim.clip_norm, or use "
                "float32 compute."
            )
        train_tokens += float(metrics["tokens"])
        entry = {"step": step, "lr": float(steps.schedule(step - 1)),
                 "grad_norm": float(metrics["grad_norm"]),
                 "tokens_per_s": float(metrics["tokens"]) / max(elapsed, 1e-9)}
        entry.update({k: float(v) for k, v in metrics.items()
                      if k not in ("moe", "finite", "grad_norm")})
        step_rates.append(entry["tokens_per_s"])
        if moe_due and metrics["moe"]:
            entry["moe"] = train._to_python(metrics["moe"])
        log.write(entry)
        if progress is not None:
            progress.set_postfix(loss=f"{entry['loss']:.3f}", mlm=f"{entry['mlm_loss']:.3f}",
                                 disc=f"{entry['disc_loss']:.3f}", refresh=False)

    try:
        for step in range(start_step + 1, train_steps + 1):
            started = time.perf_counter()
            micro_batches = [next(data.train) for _ in range(accum)]
            step_key = jax.random.fold_in(key, step)
            acc = None
            for j, batch in enumerate(micro_batches):
                placed = place(batch)
                if acc is None:
                    acc = steps.zeros(params, placed)
                acc = steps.accumulate(params, acc, placed, jax.random.fold_in(step_key, j))
            params, opt_state, metrics = steps.update(params, opt_state, acc, accum)
            if pending is not None:
                finish_step(pending)
            pending = (step, metrics, started, step % int(config.log_every) == 0)
            train_time += time.perf_counter() - started
            if progress is not None:
                progress.update(1)

            is_last = step == train_steps
            if step % int(config.eval_every) == 0 or is_last:
                finish_step(pending)
                pending = None
                valid = evaluate(steps, params, data.valid, place, disc_weight)
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

    if not valid:  # resumed a finished run: evaluate what is there
        valid = evaluate(steps, params, data.valid, place, disc_weight)
    results = {
        "steps": train_steps,
        **valid,
        "best_valid_loss": best_loss,
        "best_step": best_step,
        "tokens_per_second": train_tokens / train_time if train_time > 0 else None,
        "tokens_per_second_median_step": float(np.median(step_rates)) if step_rates else None,
        "train_time_s": train_time,
        "num_params": train.count_params(params),
        "num_params_discriminator": train.count_params(
            nnx.state(steps.model(params).discriminator, nnx.Param)),
        "data_stats": data.stats,
        "config": json.loads(config.to_json()),
    }
    if is_main:
        train._write_atomically(os.path.join(workdir, "results.json"),
                                json.dumps(results, indent=1))
    log.close()
    checkpoints.close()
    return results


# ------------------------------------------------------------------------ after pretraining


def load_discriminator(
    workdir: str, checkpoint: str = "best", *, mesh: jax.sharding.Mesh | None = None
) -> tuple[Encoder, Tokenizer, ml_collections.ConfigDict]:
    """The pretrained discriminator of ``workdir``, its vocabulary and the run's config.

    ``checkpoint`` is ``"best"`` (lowest validation loss) or ``"last"``. The encoder's RNG
    streams are those of a fresh model: reseed them (``nnx.reseed``) for fine-tuning.
    """
    if checkpoint not in ("best", "last"):
        raise ValueError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    config_path = os.path.join(workdir, "config.json")
    vocab_path = os.path.join(workdir, "spm.model")
    for path in (config_path, vocab_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: is {workdir} a pretraining workdir?")
    with open(config_path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = Tokenizer(vocab_path)
    text.check_special_pieces(tokenizer)
    model = build_model(config, tokenizer.vocab_size, mesh)
    steps = Steps(model, config)
    template = {"params": steps.params,
                "opt_state": jax.eval_shape(lambda p: make_optimizer(steps.optim).init(p),
                                            steps.params)}
    checkpoints = RunCheckpoints(workdir)
    try:
        step = checkpoints.manager(checkpoint).latest_step()
        if step is None:
            raise FileNotFoundError(f"{workdir}/checkpoints/{checkpoint} holds no checkpoint")
        restored = checkpoints.restore_checked(checkpoint, step, template)
    finally:
        checkpoints.close()
    return steps.model(restored.state["params"]).discriminator, tokenizer, config
