"""ELECTRA-style pretraining of the MoE encoder (the paper's second experiment).

``pretrain(config, workdir)`` is the whole run: text, vocabulary, packing, the generator +
discriminator (:mod:`sparsemixer_jax.models.electra`) trained by the loop of
:mod:`sparsemixer_jax.training`, validation on held-out text, checkpoints and ``results.json``.
``load_discriminator(workdir)`` gives the pretrained discriminator to fine-tune.

Exact resumption as for every task; in addition a batch's masking comes from
``(seed, epoch, index)``, and the learning rate decays linearly to ``optim.decay_steps``, not to
``train_steps``, so a run can be extended without changing its past.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from sparsemixer_jax.data import text
from sparsemixer_jax.data.tokenizer import Tokenizer
from sparsemixer_jax.initializers import uses_admin
from sparsemixer_jax.models.electra import Electra, GeneratorConfig, LossSettings, electra_loss
from sparsemixer_jax.models.encoder import Encoder, EncoderConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import cast
from sparsemixer_jax.tasks import check_sections, run_config
from sparsemixer_jax.token_ids import PAD_ID
from sparsemixer_jax.training import Run, TaskData, train
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.checkpoint import (
    checkpoint_digest,
    checkpoints_root,
    list_checkpoints,
)
from sparsemixer_jax.training.hosts import is_main_process, wait_for_all_processes
from sparsemixer_jax.training.loop import build_model, build_steps
from sparsemixer_jax.training.state import restore_checkpoint
from sparsemixer_jax.training.steps import count_params

logger = logging.getLogger(__name__)

_EVAL_SUMS = ("mlm_nll", "mlm_correct", "mlm_count", "disc_nll", "disc_correct", "disc_count",
              "replaced", "replaced_correct")


def _packed(data: text.TextDataConfig, tokenizer: Tokenizer,
            paragraphs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``paragraphs`` packed as the data section ``data`` says."""
    return text.tokenize_and_pack(tokenizer, paragraphs, data.seq_len, pair_prob=data.pair_prob,
                                  seed=data.seed)


def _stats(documents, paragraphs, tokens) -> dict[str, Any]:
    return {"documents": len(documents), "paragraphs": len(paragraphs),
            "sequences": len(tokens), "fill": float(np.mean(tokens != PAD_ID))}


PACKED_DIR = "packed"  # {workdir}/packed: the packing cache


def packed_split(data: text.TextDataConfig, workdir: str, split: str, path: str,
                 tokenizer: Tokenizer, documents: list[list[str]] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(tokens, segments, stats)`` of the text at ``path``, packed with ``tokenizer``.

    Cached in ``{workdir}/packed/{split}-{key}.npz``, keyed by the text files' contents, the
    vocabulary and the packing settings (:func:`sparsemixer_jax.data.text.packing_key`): a
    resumed run reads the arrays back instead of tokenizing the corpus again (minutes for the
    Wikipedia sample), and a changed setting, text or vocabulary packs anew. ``documents`` are
    the already-read documents of ``path``, if the caller has them. ``data`` is the run's
    data section.
    """
    key = text.packing_key(text.text_files(path), tokenizer.path, seq_len=data.seq_len,
                           pair_prob=data.pair_prob, seed=data.seed)
    cache = os.path.join(workdir, PACKED_DIR)
    cached = text.load_packed(cache, split, key)
    if cached is not None:
        arrays, stats = cached
        tokens, segments = arrays["tokens"], arrays["segments"]
        stats = {k: v for k, v in stats.items() if k != "key"}
        logger.info("%s: %d packed sequences read from the cache (%s)", split, len(tokens), cache)
        return tokens, segments, stats
    if documents is None:
        documents = text.read_documents(path)
    paragraphs = [p for doc in documents for p in doc]
    tokens, segments = _packed(data, tokenizer, paragraphs)
    if not len(tokens):
        raise ValueError(f"pretraining text {path!r} packs into no sequence: it holds no "
                         "token the vocabulary knows")
    stats = _stats(documents, paragraphs, tokens)
    if is_main_process():
        text.save_packed(cache, split, key, {"tokens": tokens, "segments": segments}, stats)
    return tokens, segments, stats


@dataclasses.dataclass(frozen=True)
class PretrainingTask:
    """The pretraining task (:class:`sparsemixer_jax.training.Task`): generator MLM loss +
    ``disc_weight`` x discriminator loss + auxiliary losses, packed text, the generator +
    discriminator, and the discriminator's size at the end.

    Holds the run's typed config sections (hashable: a static argument of the compiled steps);
    :meth:`from_config` builds and checks them once, and the task hands them down to the model
    and the data.
    """

    settings: LossSettings
    model: EncoderConfig
    router: RouterConfig
    generator: EncoderConfig  # the generator's encoder: config.model with config.generator
    data: text.TextDataConfig

    batch_keys = ("tokens", "segments", "inputs", "selected")
    progress_keys = ("loss", "mlm_loss", "disc_loss")

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> PretrainingTask:
        """Every section of a pretraining config, each checked, and the rules between them
        (:func:`sparsemixer_jax.training.config.validate`): a ValueError naming the first bad
        field."""
        check_sections(config)
        # The discriminator's own fields first: a bad model.* is reported as such, not through
        # the generator that inherits it.
        model = EncoderConfig.from_config(config.model)
        router = RouterConfig.from_config(config.router)
        data = text.TextDataConfig.from_config(config)
        generator = GeneratorConfig.from_config(config.generator).encoder(model)
        disc_weight = cast(float, config.optim.disc_weight, "config.optim.disc_weight")
        if disc_weight < 0:
            raise ValueError(f"config.optim.disc_weight must be >= 0, got {disc_weight}")
        config_schema.validate(config, router)
        settings = LossSettings(disc_weight=disc_weight, balance_weight=router.balance_weight,
                                z_loss_weight=router.z_loss_weight, mask_prob=data.mask_prob)
        return cls(settings, model, router, generator, data)

    # -- in the compiled steps

    def loss(self, model: Electra, batch, key):
        dropout_key, router_key, sample_key = jax.random.split(key, 3)
        nnx.reseed(model, dropout=dropout_key, router=router_key)
        loss, metrics = electra_loss(model, batch, sample_key, self.settings)
        del metrics["corrupted"]
        metrics["loss"] = loss
        metrics["micro_batches"] = jnp.ones((), jnp.float32)
        return loss, metrics

    def summarize(self, m):
        """Per-update metrics: token-weighted rates, losses averaged over micro-batches (the
        gradient too)."""
        n = m["micro_batches"]
        safe = lambda x: jnp.maximum(x, 1.0)
        return n, {
            "loss": m["loss"] / n,
            "mlm_loss": m["mlm_nll"] / safe(m["mlm_count"]),
            "mlm_accuracy": m["mlm_correct"] / safe(m["mlm_count"]),
            "disc_loss": m["disc_nll"] / safe(m["disc_count"]),
            "disc_accuracy": m["disc_correct"] / safe(m["disc_count"]),
            "replaced_fraction": m["replaced"] / safe(m["disc_count"]),
            "replaced_recall": m["replaced_correct"] / safe(m["replaced"]),
            "balance_loss": m["balance_loss"] / n,
            "z_loss": m["z_loss"] / n,
            "tokens": m["disc_count"],
            "moe": jax.tree.map(lambda v: v / n, m["moe"]),
        }

    def evaluate(self, model: Electra, batch, key):
        """Metric sums of the deterministic forward (replacements still sampled, from ``key``)."""
        _, metrics = electra_loss(model, batch, key, self.settings, deterministic=True)
        return {k: metrics[k] for k in _EVAL_SUMS}

    # -- on the host

    def load_data(self, workdir: str, batch_multiple: int) -> TaskData:
        """Reads, tokenizes (training the vocabulary if needed) and packs; the batch streams."""
        del batch_multiple  # data.batch_size is checked against the mesh by the MoE layer
        d = self.data
        documents = None  # the training text is read only to train a vocabulary or to pack
        if not os.path.exists(os.path.join(workdir, "spm.model")):
            documents = text.read_documents(d.train)
        if not is_main_process():  # process 0 trains the vocabulary, the others then read it
            wait_for_all_processes("vocabulary ready")
        tokenizer = text.get_text_tokenizer(
            d, workdir, [p for doc in documents or () for p in doc])
        if is_main_process():
            wait_for_all_processes("vocabulary ready")
        tokens, segments, train_stats = packed_split(d, workdir, "train", d.train, tokenizer,
                                                     documents)
        stats = {"train": train_stats}
        micro = d.micro
        mask = {"mask_prob": d.mask_prob, "mask_token_prob": d.mask_token_prob}
        processes = {"process_index": jax.process_index(), "process_count": jax.process_count()}
        batches = text.PretrainBatches(tokens, segments, micro, seed=d.seed, **mask,
                                       **processes)
        v_tokens, v_segments, stats["valid"] = packed_split(d, workdir, "valid", d.valid,
                                                            tokenizer)
        if d.valid_sequences > 0:
            v_tokens, v_segments = v_tokens[: d.valid_sequences], v_segments[: d.valid_sequences]
        stats["valid"]["evaluated_sequences"] = len(v_tokens)
        valid = text.eval_batches(v_tokens, v_segments, micro, seed=d.seed, **mask,
                                  **processes)
        return TaskData(train=batches, valid=valid, vocab_size=tokenizer.vocab_size, stats=stats,
                        micro_batches=d.batch_size // micro, extra=tokenizer,
                        init_model=_admin_profiling(batches) if uses_admin(self.model.init)
                        else None)

    def build_model(self, run, vocab_size: int, mesh) -> Electra:
        return build_model(functools.partial(Electra, self.model, self.router, self.generator,
                                             vocab_size),
                           mesh, seed=run.seed, rules=run.mesh.rules)

    def validation_metrics(self, total) -> dict[str, float]:
        safe = lambda x: max(float(x), 1.0)
        mlm = float(total["mlm_nll"]) / safe(total["mlm_count"])
        disc = float(total["disc_nll"]) / safe(total["disc_count"])
        return {
            "valid_loss": mlm + self.settings.disc_weight * disc,
            "valid_mlm_loss": mlm,
            "valid_mlm_accuracy": float(total["mlm_correct"]) / safe(total["mlm_count"]),
            "valid_disc_loss": disc,
            "valid_disc_accuracy": float(total["disc_correct"]) / safe(total["disc_count"]),
            "valid_replaced_fraction": float(total["replaced"]) / safe(total["disc_count"]),
            "valid_replaced_recall": float(total["replaced_correct"]) / safe(total["replaced"]),
        }

    def finish(self, run: Run) -> dict[str, Any]:
        discriminator = run.steps.model(run.state).discriminator
        return {"num_params_discriminator": count_params(nnx.state(discriminator, nnx.Param))}


def _admin_profiling(batches: text.PretrainBatches):
    """Admin's profiling pass on the first training micro-batch, as its reference code takes
    it; the stream is left where it was. With several processes each holds its own rows of the
    micro-batch (host ``p`` the ``p``-th block): they are gathered, so that every host profiles
    the whole micro-batch and sets the same scales, those of one process."""
    first = batches.peek()
    if jax.process_count() > 1:  # every host profiles the whole micro-batch
        from jax.experimental import multihost_utils

        first = {key: np.asarray(multihost_utils.process_allgather(np.asarray(value),
                                                                    tiled=True))
                 for key, value in first.items()}

    def init_model(model: Electra) -> None:
        scales = model.set_admin_scales(first)
        logger.info("Admin residual scales: %s", {name: [round(s, 4) for s in values]
                                                  for name, values in scales.items()})

    return init_model


def pretrain(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Pretrains (resuming from ``workdir`` if it holds a checkpoint); writes results.json.

    Raises :class:`sparsemixer_jax.training.TrainingDiverged` if the loss or gradient becomes
    non-finite.
    """
    run = run_config(config, PretrainingTask.from_config(config))  # before anything is written
    text.check_pretraining_text(run.task.data)  # before the workdir or vocabulary is written
    return train(run, workdir)


@dataclasses.dataclass
class Pretrained:
    """A pretrained discriminator and where it came from.

    ``step`` and ``digest`` (:func:`sparsemixer_jax.training.checkpoint.checkpoint_digest`) name the
    checkpoint's content, so fine-tuning results can say what they started from."""

    encoder: Encoder
    tokenizer: Tokenizer
    config: ml_collections.ConfigDict
    checkpoint: str  # "last" or "best"
    step: int
    digest: str


def load_pretrained(
    workdir: str, checkpoint: str = "last", *, mesh: jax.sharding.Mesh | None = None
) -> Pretrained:
    """The pretrained discriminator of ``workdir`` with its vocabulary, config and checkpoint.

    ``checkpoint`` is ``"last"`` (the final model, the default: what the paper fine-tunes) or
    ``"best"`` (lowest validation loss): the newest readable one of that kind
    (:func:`~sparsemixer_jax.training.state.restore_checkpoint`; an unreadable newer one is
    named in a warning and skipped). The encoder's RNG streams are those of a fresh model:
    reseed them (``nnx.reseed``) for fine-tuning. Raises ``FileNotFoundError`` (one line) if
    ``workdir`` is not a pretraining workdir or holds no such checkpoint, and
    :class:`~sparsemixer_jax.training.checkpoint.CheckpointError` if none of them is readable.
    """
    if checkpoint not in ("best", "last"):
        raise ValueError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"pretrained directory {workdir} does not exist")
    config_path = os.path.join(workdir, "config.json")
    vocab_path = os.path.join(workdir, "spm.model")
    for path in (config_path, vocab_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: is {workdir} a pretraining workdir "
                                    "(experiments.pretrain)?")
    with open(config_path) as f:
        config = config_schema.with_defaults(json.load(f))
    if config_schema.task_of(config) != "pretraining":
        raise ValueError(f"{workdir} holds a {config_schema.task_of(config)} run, not a "
                         "pretraining run (experiments.pretrain)")
    kind_dir = os.path.join(checkpoints_root(workdir), checkpoint)
    if not list_checkpoints(workdir, checkpoint):  # before building the model
        raise FileNotFoundError(f"{kind_dir} holds no checkpoint: has the pretraining run saved "
                                "one yet?")
    tokenizer = Tokenizer(vocab_path)
    text.check_special_pieces(tokenizer)
    built = build_steps(run_config(config, PretrainingTask.from_config(config)),
                        tokenizer.vocab_size, mesh)
    restored = restore_checkpoint(workdir, built.abstract_state(), checkpoint)
    if restored is None:  # removed since it was listed
        raise FileNotFoundError(f"{kind_dir} holds no checkpoint")
    model = built.model(restored.state)
    return Pretrained(model.discriminator, tokenizer, config, checkpoint, restored.step,
                      checkpoint_digest(restored.directory))


def load_discriminator(
    workdir: str, checkpoint: str = "last", *, mesh: jax.sharding.Mesh | None = None
) -> tuple[Encoder, Tokenizer, ml_collections.ConfigDict]:
    """``(encoder, tokenizer, config)`` of :func:`load_pretrained` (default: the last
    checkpoint)."""
    p = load_pretrained(workdir, checkpoint, mesh=mesh)
    return p.encoder, p.tokenizer, p.config
