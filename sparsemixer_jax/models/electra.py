"""ELECTRA-style pretraining (Clark et al., 2020): a generator and a discriminator.

The generator (a shallow :class:`~sparsemixer_jax.models.encoder.Encoder` with an MLM head)
predicts the selected tokens of a masked sequence; a replacement for every selected position is
sampled from its softmax (no gradient flows through the sample); the discriminator (the deep
encoder that GLUE fine-tunes) reads the corrupted sequence and predicts, per token, whether it
was replaced. A sampled token equal to the original counts as "original", so the labels are
exactly ``corrupted != original``. The embedding block (token, segment and, with
``model.absolute_positions``, position tables and their LayerNorm) is shared by both, and the
token table is also the generator's output projection.

The objective is ``mlm_loss + disc_weight * disc_loss + balance_weight * balance_loss
(+ z_loss_weight * z_loss)``: the generator's cross entropy averaged over the selected tokens,
the discriminator's sigmoid cross entropy averaged over all non-padding tokens (the paper:
``disc_weight = 50``), and the MoE auxiliary losses summed over the MoE layers of both networks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparsemixer_jax.layers.norms import layer_norm
from sparsemixer_jax.models.encoder import Encoder, EncoderConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import read_fields
from sparsemixer_jax.token_ids import FIRST_WORD_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
    """``config.generator``: where the generator differs from the discriminator's
    ``config.model`` (None = the same); ``emb_dim`` may not differ (tied embeddings)."""

    num_layers: int | None = None
    num_heads: int | None = None
    mlp_dim: int | None = None
    num_experts: int | None = None
    moe_every: int | None = None

    @classmethod
    def from_config(cls, section: Any, where: str = "config.generator.") -> GeneratorConfig:
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(section) - set(fields))
        if unknown:
            raise ValueError(
                f"{where.rstrip('.')} has fields {unknown} that cannot differ from "
                f"config.model; allowed: {fields} (emb_dim is tied to the discriminator's)")
        return cls(**read_fields(cls, section, where))

    def encoder(self, model: EncoderConfig, where: str = "config.generator.") -> EncoderConfig:
        """The generator's encoder section: ``model`` with this section's fields, checked."""
        moe = dataclasses.replace(model.moe, **{
            name: getattr(self, name) for name in ("num_experts", "moe_every")
            if getattr(self, name) is not None})
        return dataclasses.replace(model, moe=moe, **{
            name: getattr(self, name) for name in ("num_layers", "num_heads", "mlp_dim")
            if getattr(self, name) is not None}).check(where)


class GeneratorHead(nnx.Module):
    """``Dense -> GELU -> LayerNorm``, then the tied token table plus an output bias (BERT's MLM
    head)."""

    def __init__(self, emb_dim: int, vocab_size: int, *, dtype, rngs: nnx.Rngs):
        self.dense = nnx.Linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.norm = layer_norm(emb_dim, dtype, rngs)
        self.bias = nnx.Param(jnp.zeros((vocab_size,), jnp.float32))

    def __call__(self, hidden: jax.Array, embeddings) -> jax.Array:
        """``hidden [..., emb]`` -> float32 logits ``[..., V]``."""
        h = self.norm(jax.nn.gelu(self.dense(hidden)))
        return embeddings.logits(h) + self.bias[...]


class DiscriminatorHead(nnx.Module):
    """``Dense -> GELU -> Dense(1)``: the replaced-token logit of every position."""

    def __init__(self, emb_dim: int, *, dtype, rngs: nnx.Rngs):
        self.dense = nnx.Linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(emb_dim, 1, dtype=dtype, rngs=rngs)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """``hidden [B, L, emb]`` -> float32 ``[B, L]``."""
        return self.out(jax.nn.gelu(self.dense(hidden)))[..., 0].astype(jnp.float32)


class Electra(nnx.Module):
    """Generator + discriminator with tied embeddings (module docstring).

    ``discriminator`` is the :class:`Encoder` of ``model``; ``generator`` the encoder of
    ``generator`` (``model`` with ``config.generator``'s fields:
    :meth:`GeneratorConfig.encoder`) sharing the discriminator's embedding block; both route
    by ``router``.
    """

    def __init__(self, model: EncoderConfig, router: RouterConfig, generator: EncoderConfig,
                 vocab_size: int, *, mesh=None, rngs: nnx.Rngs):
        dtype, emb = model.dtype, model.emb_dim
        self.discriminator = Encoder(model, router, vocab_size, mesh=mesh, rngs=rngs)
        self.generator = Encoder(generator, router, vocab_size, mesh=mesh, rngs=rngs,
                                 embeddings=self.discriminator.embeddings)
        self.generator_head = GeneratorHead(emb, vocab_size, dtype=dtype, rngs=rngs)
        self.discriminator_head = DiscriminatorHead(emb, dtype=dtype, rngs=rngs)

    def set_admin_scales(self, batch: dict[str, Any]) -> dict[str, list[float]]:
        """Admin's profiling pass for both encoders (``model.init='admin'``) on one training
        micro-batch: the generator on its masked ``inputs``, the discriminator on the original
        ``tokens`` (what it mostly sees; its corrupted input depends on the generator's samples),
        both with the batch's ``segments`` (int ``[B, L]`` each). Returns each encoder's scales
        (:meth:`Encoder.set_admin_scales`)."""
        segments = jnp.asarray(batch["segments"])
        return {
            "generator": self.generator.set_admin_scales(jnp.asarray(batch["inputs"]), segments),
            "discriminator": self.discriminator.set_admin_scales(jnp.asarray(batch["tokens"]),
                                                                 segments),
        }


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The objective's weights and the number of predicted positions per row (hashable)."""

    disc_weight: float
    balance_weight: float
    z_loss_weight: float
    mask_prob: float


def num_predictions(seq_len: int, mask_prob: float) -> int:
    """Positions per row the generator predicts: at least the ``max(1, round(mask_prob * n))``
    that :func:`sparsemixer_jax.data.text.mask_tokens` selects among ``n <= seq_len`` tokens."""
    return min(seq_len, max(1, math.ceil(mask_prob * seq_len)))


def selected_positions(selected: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The first ``count`` selected positions of each row and whether each is real.

    ``selected`` bool ``[B, L]`` -> int32 positions ``[B, count]`` (distinct within a row; rows
    with fewer selections are filled with unselected positions) and bool ``weights [B, count]``.
    """
    order = jnp.argsort(~selected, axis=1, stable=True)[:, :count].astype(jnp.int32)
    return order, jnp.take_along_axis(selected, order, axis=1)


def sample_replacements(
    logits: jax.Array, key: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """Samples from ``softmax(logits / temperature)`` without a gradient, never a special id.

    ``logits`` float32 ``[..., V]`` -> int32 ``[...]``.
    """
    logits = jax.lax.stop_gradient(logits) / temperature
    special = jnp.arange(logits.shape[-1]) < FIRST_WORD_ID
    logits = jnp.where(special, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def corrupt(
    tokens: jax.Array, positions: jax.Array, weights: jax.Array, samples: jax.Array
) -> jax.Array:
    """``tokens [B, L]`` with ``samples [B, P]`` written at ``positions`` where ``weights``."""
    original = jnp.take_along_axis(tokens, positions, axis=1)
    values = jnp.where(weights, samples, original)
    rows = jnp.arange(tokens.shape[0])[:, None]
    return tokens.at[rows, positions].set(values)


def electra_loss(
    model: Electra,
    batch: dict[str, jax.Array],
    key: jax.Array,
    settings: LossSettings,
    *,
    deterministic: bool = False,
) -> tuple[jax.Array, dict[str, Any]]:
    """The pretraining objective of one batch and its metrics.

    Args:
      batch: ``tokens`` (originals), ``segments``, ``inputs`` (with ``[MASK]``), ``selected``;
        each ``[B, L]`` (see :func:`sparsemixer_jax.data.text.mlm_batch`).
      key: the sampling key.

    Returns:
      the scalar objective and a dict of float32 metrics: sums ``mlm_nll``, ``mlm_correct``
      over ``mlm_count`` predicted tokens, ``disc_nll``, ``disc_correct`` over ``disc_count``
      tokens, ``replaced`` and ``replaced_correct`` (replaced tokens, and those the
      discriminator found); ``mlm_loss``, ``disc_loss``, ``balance_loss``, ``z_loss`` (means of
      this batch); ``moe`` (per-network, per-layer router metrics); and ``corrupted`` (int32
      ``[B, L]``, the discriminator's input).
    """
    tokens, segments, selected = batch["tokens"], batch["segments"], batch["selected"]
    count = num_predictions(tokens.shape[1], settings.mask_prob)
    positions, weights = selected_positions(selected.astype(bool), count)
    fweights = weights.astype(jnp.float32)

    hidden, gen_aux = model.generator(batch["inputs"], segments=segments,
                                      deterministic=deterministic)
    hidden = jnp.take_along_axis(hidden, positions[..., None], axis=1)  # [B, P, emb]
    logits = model.generator_head(hidden, model.discriminator.embeddings)  # [B, P, V]
    targets = jnp.take_along_axis(tokens, positions, axis=1)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    mlm_nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mlm_count = jnp.sum(fweights)
    mlm_nll_sum = jnp.sum(mlm_nll * fweights)
    mlm_correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets) * fweights)

    corrupted = corrupt(tokens, positions, weights, sample_replacements(logits, key))
    labels = (corrupted != tokens).astype(jnp.float32)
    hidden, disc_aux = model.discriminator(corrupted, segments=segments,
                                           deterministic=deterministic)
    disc_logits = model.discriminator_head(hidden)
    real = (tokens != PAD_ID).astype(jnp.float32)
    disc_count = jnp.sum(real)
    disc_nll_sum = jnp.sum(optax.sigmoid_binary_cross_entropy(disc_logits, labels) * real)
    disc_right = ((disc_logits > 0) == (labels > 0)).astype(jnp.float32) * real

    mlm_loss = mlm_nll_sum / jnp.maximum(mlm_count, 1.0)
    disc_loss = disc_nll_sum / jnp.maximum(disc_count, 1.0)
    balance = gen_aux["balance_loss"] + disc_aux["balance_loss"]
    z_loss = gen_aux["z_loss"] + disc_aux["z_loss"]
    loss = (mlm_loss + settings.disc_weight * disc_loss + settings.balance_weight * balance
            + settings.z_loss_weight * z_loss)
    moe = {}
    if gen_aux["moe"]:
        moe["generator"] = gen_aux["moe"]
    if disc_aux["moe"]:
        moe["discriminator"] = disc_aux["moe"]
    metrics = {
        "mlm_nll": mlm_nll_sum,
        "mlm_correct": mlm_correct,
        "mlm_count": mlm_count,
        "disc_nll": disc_nll_sum,
        "disc_correct": jnp.sum(disc_right),
        "disc_count": disc_count,
        "replaced": jnp.sum(labels * real),
        "replaced_correct": jnp.sum(disc_right * labels),
        "mlm_loss": mlm_loss,
        "disc_loss": disc_loss,
        "balance_loss": balance,
        "z_loss": z_loss,
        "moe": moe,
        "corrupted": corrupted,
    }
    return loss, metrics
