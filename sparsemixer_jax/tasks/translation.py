"""Translation: the Switch Transformer trained on a language pair, then beam search and BLEU.

``train_and_evaluate(config, workdir)`` is the whole experiment: data, model, the training loop
of :mod:`sparsemixer_jax.training` (accumulation, validation, checkpoints, resumption), and at
the end beam search and BLEU on the test split for the last and the best checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from sparsemixer_jax.data.batching import restore_order
from sparsemixer_jax.data.sources import DataConfig, check_text_files, read_split
from sparsemixer_jax.data.tokenizer import Tokenizer, get_tokenizer
from sparsemixer_jax.data.translation import load_datasets
from sparsemixer_jax.metrics import bleu
from sparsemixer_jax.models import decode
from sparsemixer_jax.models.decode import DecodeConfig
from sparsemixer_jax.models.encoder_decoder import Transformer, TransformerConfig
from sparsemixer_jax.moe.dispatch import resolve_dispatch
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import cast, check_fraction
from sparsemixer_jax.tasks import check_sections, run_config
from sparsemixer_jax.token_ids import PAD_ID
from sparsemixer_jax.training import Run, TaskData, train
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.checkpoint import CheckpointError
from sparsemixer_jax.training.hosts import (
    BatchPlacer,
    is_main_process,
    wait_for_all_processes,
)
from sparsemixer_jax.training.loop import build_model
from sparsemixer_jax.training.state import TrainState, restore_checkpoint

logger = logging.getLogger(__name__)


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


def accumulation_steps(tokens_per_update: int, max_tokens: int) -> int:
    """Micro-batches per update so that an update sees about ``optim.tokens_per_update`` tokens
    with ``data.max_tokens`` per micro-batch."""
    return max(1, math.ceil(tokens_per_update / max_tokens)) if tokens_per_update > 0 else 1


def translate_batches(
    model: Transformer,
    batches: list[dict[str, np.ndarray]],
    tokenizer: Tokenizer,
    num_sentences: int,
    decode_config: DecodeConfig,
    place: BatchPlacer,
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
            beam_size=decode_config.beam_size,
            alpha=decode_config.length_penalty,
            max_extra_len=decode_config.max_extra_len,
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


@dataclasses.dataclass(frozen=True)
class TranslationTask:
    """The translation task (:class:`sparsemixer_jax.training.Task`): label-smoothed cross
    entropy plus the routers' auxiliary losses, the WMT-style data, the Transformer, test BLEU.

    Holds the run's typed config sections (hashable: a static argument of the compiled steps);
    :meth:`from_config` builds and checks them once, and the task hands them down to the model
    and the data. ``router`` gives the auxiliary losses' weights; ``model``, ``data`` and
    ``decode`` may be None for a task that only computes the loss.
    """

    label_smoothing: float
    router: RouterConfig
    model: TransformerConfig | None = None
    data: DataConfig | None = None
    decode: DecodeConfig | None = None
    tokens_per_update: int = 0

    batch_keys = ("inputs", "targets")
    progress_keys = ("loss",)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> TranslationTask:
        """Every section of a translation config, each checked, and the rules between them
        (:func:`sparsemixer_jax.training.config.validate`): a ValueError naming the first bad
        field."""
        check_sections(config)
        model = TransformerConfig.from_config(config.model)
        router = RouterConfig.from_config(config.router)
        data = DataConfig.from_config(config)
        decode = DecodeConfig.from_config(config.decode)
        label_smoothing = cast(float, config.optim.label_smoothing, "config.optim.label_smoothing")
        check_fraction("config.optim.", label_smoothing=label_smoothing)
        per_update = cast(int, config.optim.tokens_per_update, "config.optim.tokens_per_update")
        if per_update < 0:
            raise ValueError(f"config.optim.tokens_per_update must be >= 0 (0 = no "
                             f"accumulation), got {per_update}")
        config_schema.validate(config, router)
        return cls(label_smoothing, router, model, data, decode, per_update)

    # -- in the compiled steps

    def loss(self, model: Transformer, batch, key):
        """Objective of one micro-batch summed over its target tokens, and metric sums."""
        dropout_key, router_key = jax.random.split(key)
        nnx.reseed(model, dropout=dropout_key, router=router_key)
        logits, aux = model(batch["inputs"], batch["targets"], deterministic=False)
        smoothed, nll, tokens = token_losses(logits, batch["targets"], self.label_smoothing)
        # The auxiliary losses are means over the micro-batch. "per_token" weights them by its
        # tokens, so the update's objective is mean cross entropy + weight * loss. "per_batch"
        # adds them once per micro-batch to the token-summed cross entropy, as the reference
        # (fairseq) does: their weight per token is weight / tokens per micro-batch.
        router = self.router
        aux_loss = (router.balance_weight * aux["balance_loss"]
                    + router.z_loss_weight * aux["z_loss"])
        aux_scale = tokens if router.balance_normalization == "per_token" else 1.0
        metrics = {
            "smoothed": smoothed,
            "nll": nll,
            "tokens": tokens,
            "balance_loss": aux["balance_loss"] * tokens,
            "z_loss": aux["z_loss"] * tokens,
            "moe": jax.tree.map(lambda v: v * tokens, aux["moe"]),
        }
        return smoothed + aux_loss * aux_scale, metrics

    def summarize(self, m):
        """Token-weighted means of the update; the gradient is divided by its tokens."""
        tokens = jnp.maximum(m["tokens"], 1.0)
        return tokens, {
            "loss": m["smoothed"] / tokens,
            "nll": m["nll"] / tokens,
            "balance_loss": m["balance_loss"] / tokens,
            "z_loss": m["z_loss"] / tokens,
            "tokens": m["tokens"],
            "moe": jax.tree.map(lambda v: v / tokens, m["moe"]),
        }

    def evaluate(self, model: Transformer, batch, key):
        """``[smoothed, nll, tokens]`` sums of the deterministic forward on one batch."""
        del key  # the deterministic forward draws nothing
        logits, _ = model(batch["inputs"], batch["targets"], deterministic=True)
        return jnp.stack(token_losses(logits, batch["targets"], self.label_smoothing))

    def for_platform(self, platform: str) -> TranslationTask:
        """This task with ``dispatch="auto"`` resolved for ``platform`` (a JAX platform name),
        not for the machine that traces it: the compile command's programs for a target."""
        if self.model is None:
            return self
        moe = dataclasses.replace(self.model.moe,
                                  dispatch=resolve_dispatch(self.model.moe.dispatch, platform))
        return dataclasses.replace(self, model=dataclasses.replace(self.model, moe=moe))

    # -- on the host

    def load_data(self, workdir: str, batch_multiple: int) -> TaskData:
        raw_train = None
        if jax.process_count() > 1:
            # Process 0 trains the vocabulary; then every host loads its data at the same time.
            if is_main_process():
                raw_train = read_split(self.data, "train")
                get_tokenizer(self.data, workdir, raw_train)
            wait_for_all_processes("vocabulary ready")
        data = load_datasets(self.data, workdir, batch_multiple=batch_multiple,
                             raw_train=raw_train)
        del raw_train
        wait_for_all_processes("data ready")
        return TaskData(train=data.train, valid=data.valid, vocab_size=data.tokenizer.vocab_size,
                        stats=data.stats, extra=data, micro_batches=accumulation_steps(
                            self.tokens_per_update, self.data.max_tokens))

    def build_model(self, run, vocab_size: int, mesh) -> Transformer:
        return build_model(functools.partial(Transformer, self.model, self.router, vocab_size),
                           mesh, seed=run.seed, rules=run.mesh.rules)

    def validation_metrics(self, sums) -> dict[str, float]:
        smoothed, nll, tokens = (float(x) for x in sums)
        tokens = max(tokens, 1.0)
        return {"valid_loss": smoothed / tokens, "valid_nll": nll / tokens,
                "valid_ppl": float(np.exp(min(nll / tokens, 50.0)))}

    def finish(self, run: Run) -> dict[str, Any]:
        """Beam search on the test split with the last and the best checkpoint; BLEU of each."""
        config = run.config
        if not self.decode.test_bleu:
            return {}
        data = run.data.extra

        def translate(state: TrainState) -> list[str]:
            return translate_batches(run.steps.model(state), data.test, data.tokenizer,
                                     len(data.test_sources), self.decode, run.place)

        hyps = {"last": translate(run.state)}
        if run.best_step == config.train_steps:  # the best is the last: decode once
            hyps["best"] = hyps["last"]
        elif run.best_step > 0:
            try:
                best = restore_checkpoint(run.workdir, run.state, "best")
                if best is None or best.step != run.best_step:
                    raise CheckpointError(f"best/{run.best_step} is not the newest readable "
                                          "best checkpoint")
            except CheckpointError as e:  # the run's result stands; only its best BLEU is missing
                logger.warning("no test BLEU of the best checkpoint: %s", e)
            else:
                hyps["best"] = translate(best.state)
        results = {}
        for name, texts in hyps.items():
            suffix = "" if name == "last" else "_best"
            results[f"bleu{suffix}"] = bleu.sacre_bleu(texts, data.test_references)
            results[f"tokenized_bleu{suffix}"] = bleu.tokenized_bleu(
                texts, data.test_references, lang=self.data.tgt)
            if is_main_process():
                with open(os.path.join(run.workdir, f"translations_{name}.txt"), "w") as f:
                    f.writelines(h + "\n" for h in texts)
        return results


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains the translation model of the experiment config ``config`` in ``workdir``
    (resuming), then test BLEU.

    Returns the results also written to ``{workdir}/results.json``.
    """
    run = run_config(config, TranslationTask.from_config(config))  # before anything is written
    check_text_files(config)  # before the workdir is written or the vocabulary trained
    return train(run, workdir)
