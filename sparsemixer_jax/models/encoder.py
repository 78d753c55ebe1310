"""Bidirectional Transformer encoder with T5 relative position buckets, for ELECTRA and GLUE.

BERT layout (post-norm layers ``x = LayerNorm(x + Dropout(sublayer(x)))``, an embedding
LayerNorm, segment embeddings) with two changes the paper makes (its Appendix, "Pre-training"):
T5's relative position buckets (Raffel et al., 2020), a learned bias per (bucket, head) added to
every layer's attention logits, and MoE feed-forward layers on every ``moe_every``-th layer.

Positions: the paper "further enhanced the model with the T5 relative position encoding" (32
bins), following METRO and Dong et al. (2023); "enhanced" reads as on top of BERT's learned
absolute position embeddings, and COCO-LM's code (the METRO line's public encoder) indeed keeps its
learned absolute positions beside the relative bias. ``model.absolute_positions = P > 0`` adds a
learned table of ``P`` positions to the token + segment embeddings before the embedding
LayerNorm (BERT's place; ``P`` bounds the sequence length); ``0`` leaves the relative bias alone
(configs saved before the field existed). The feed-forward nonlinearity is ``model.activation``
(GELU in BERT / ELECTRA / COCO-LM). The attention, the feed-forward / MoE sublayers and the
LayerNorms are the translation model's own (:mod:`sparsemixer_jax.models.encoder_decoder`);
there is one MoE implementation.

Conventions (shared with :mod:`sparsemixer_jax.data.text`): token id 0 is padding and is masked
out of attention and of the MoE layers; segment ids are 0 for ``[CLS] a [SEP]`` and 1 for
``b [SEP]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import uses_admin
from sparsemixer_jax.layers import fairseq
from sparsemixer_jax.layers.norms import layer_norm
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import check_positive
from sparsemixer_jax.token_ids import PAD_ID

NUM_SEGMENTS = 2

# BERT / ELECTRA initialise embeddings with N(0, 0.02).
_embedding_init = nnx.initializers.normal(stddev=0.02)


def relative_position_bucket(
    relative_position: jax.Array, *, num_buckets: int = 32, max_distance: int = 128
) -> jax.Array:
    """T5's bidirectional bucketing of ``relative_position = key_position - query_position``.

    Half of the buckets are for keys before the query (``0 .. num_buckets/2 - 1``), half for keys
    after it (``num_buckets/2 ..``). In each half the first ``num_buckets/4`` distances get a
    bucket each; larger distances share logarithmically wider buckets up to ``max_distance``, and
    everything farther falls in the last bucket of its half. Returns int32 of the input's shape.
    """
    if num_buckets < 4 or num_buckets % 2:
        raise ValueError(f"num_buckets must be even and >= 4, got {num_buckets}")
    half = num_buckets // 2
    exact = half // 2
    if max_distance <= exact:
        raise ValueError(f"max_distance must exceed num_buckets/4 = {exact}, got {max_distance}")
    relative_position = jnp.asarray(relative_position, jnp.int32)
    offset = jnp.where(relative_position > 0, half, 0)
    distance = jnp.abs(relative_position)
    # Distance d >= exact: exact + floor(log(d / exact) / log(max_distance / exact) * (half-exact)).
    # (max(d, 1) keeps log finite where the branch is not taken.)
    scaled = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(
        max_distance / exact
    )
    far = exact + (scaled * (half - exact)).astype(jnp.int32)
    far = jnp.minimum(far, half - 1)
    return offset + jnp.where(distance < exact, distance, far)


@dataclasses.dataclass(frozen=True)
class EncoderConfig(fairseq.ModelConfig):
    """``config.model`` of the encoder (schema: ``configs/electra.py``): the fields of
    :class:`~sparsemixer_jax.layers.fairseq.ModelConfig`, the depth, T5's relative position buckets
    (``relative_buckets`` even and >= 4, up to ``relative_max_distance``) and
    ``absolute_positions`` (learned positions, 0 = none; module docstring)."""

    num_layers: int = 12
    relative_buckets: int = 32
    relative_max_distance: int = 128
    absolute_positions: int = 0

    def check(self, where: str = "") -> EncoderConfig:
        check_positive(where, num_layers=self.num_layers)
        super().check(where)
        if self.relative_buckets < 4 or self.relative_buckets % 2:
            raise ValueError(f"{where}relative_buckets must be even and >= 4, got "
                             f"{self.relative_buckets}")
        if self.relative_max_distance <= self.relative_buckets // 4:
            raise ValueError(f"{where}relative_max_distance must exceed relative_buckets/4 = "
                             f"{self.relative_buckets // 4}, got {self.relative_max_distance}")
        if self.absolute_positions < 0:
            raise ValueError(f"{where}absolute_positions must be an int >= 0 (0 = none), got "
                             f"{self.absolute_positions!r}")
        return self


class RelativePositionBias(nnx.Module):
    """A learned scalar per (bucket, head), shared by all layers of an encoder as in T5."""

    def __init__(self, num_heads: int, *, num_buckets: int, max_distance: int, rngs: nnx.Rngs):
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.table = nnx.Embed(num_buckets, num_heads, embedding_init=_embedding_init, rngs=rngs)

    def __call__(self, length: int) -> jax.Array:
        """float32 ``[1, H, length, length]``: bias of query ``t`` attending to key ``s``."""
        positions = jnp.arange(length)
        buckets = relative_position_bucket(
            positions[None, :] - positions[:, None],
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias = self.table(buckets)  # [T, S, H]
        return jnp.transpose(bias, (2, 0, 1))[None].astype(jnp.float32)


class Embeddings(nnx.Module):
    """Token + segment (+ learned absolute position) embeddings, LayerNorm, dropout (BERT's
    embedding block).

    ELECTRA ties this whole block between the generator and the discriminator; the token table
    also serves as the generator's output projection. ``absolute_positions = P > 0`` adds a
    learned ``[P, emb]`` table (N(0, 0.02), as BERT) indexed by position; 0 adds none. With a
    ``mesh`` the tables are read gathered whole
    (:func:`sparsemixer_jax.parallel.sharding.lookup_rows`).
    """

    def __init__(self, vocab_size: int, emb_dim: int, *, dropout: float, dtype, rngs: nnx.Rngs,
                 absolute_positions: int = 0, mesh=None):
        if absolute_positions < 0:
            raise ValueError(f"absolute_positions must be >= 0 (0 = none), got "
                             f"{absolute_positions}")
        self.dtype = dtype
        self.whole_sharding = sharding.whole_sharding(mesh)
        self.absolute_positions = int(absolute_positions)
        self.position = nnx.Embed(
            absolute_positions, emb_dim, embedding_init=_embedding_init, dtype=dtype, rngs=rngs
        ) if absolute_positions else None
        self.token = nnx.Embed(
            vocab_size, emb_dim, embedding_init=_embedding_init, dtype=dtype, rngs=rngs
        )
        self.segment = nnx.Embed(
            NUM_SEGMENTS, emb_dim, embedding_init=_embedding_init, dtype=dtype, rngs=rngs
        )
        self.norm = layer_norm(emb_dim, dtype, rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tokens: jax.Array, segments: jax.Array, *, deterministic: bool):
        """``tokens``, ``segments`` int ``[B, L]`` -> ``[B, L, emb]`` in the compute dtype."""
        x = self._lookup(self.token, tokens) + self._lookup(self.segment, segments)
        if self.position is not None:
            length = tokens.shape[1]
            if length > self.absolute_positions:
                raise ValueError(f"sequence of {length} tokens, but the model has learned "
                                 f"positions for {self.absolute_positions} "
                                 "(model.absolute_positions)")
            x = x + self._lookup(self.position, jnp.arange(length))[None]
        x = self.norm(x)
        return self.dropout(x, deterministic=deterministic)

    def _lookup(self, table: nnx.Embed, ids: jax.Array) -> jax.Array:
        """``table``'s rows at ``ids``, as ``nnx.Embed`` computes them (in the compute dtype)."""
        rows = table.embedding[...].astype(self.dtype)
        return sharding.lookup_rows(rows, ids, self.whole_sharding)

    def logits(self, x: jax.Array) -> jax.Array:
        """Tied output projection ``[..., emb] -> float32 [..., V]`` (f32 accumulation)."""
        table = self.token.embedding[...].astype(self.dtype)
        return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32)


class EncoderLayer(nnx.Module):
    """Post-norm layer: self-attention with a relative position bias, then dense or MoE FFN.

    Each sublayer computes ``LayerNorm(omega * x + Dropout(f(x)))``; ``omega`` is 1 (no
    parameter) unless ``model.init`` is ``"admin"``, which gives each sublayer a trainable
    ``[emb]`` scale (``attn_residual_scale``, ``ffn_residual_scale``) that
    :meth:`Encoder.set_admin_scales` sets.
    """

    def __init__(self, model: EncoderConfig, router: RouterConfig, layer: int, *, dtype, mesh,
                 rngs: nnx.Rngs):
        emb = model.emb_dim
        self.self_attn = fairseq.make_attention(model, dtype, rngs)
        self.self_attn_norm = layer_norm(emb, dtype, rngs)
        self.ffn = fairseq.make_ffn(model, router, layer, dtype, mesh, rngs)
        self.ffn_norm = layer_norm(emb, dtype, rngs)
        self.dropout = nnx.Dropout(model.dropout, rngs=rngs)
        admin = uses_admin(model.init)
        self.attn_residual_scale = nnx.Param(jnp.ones((emb,), jnp.float32)) if admin else None
        self.ffn_residual_scale = nnx.Param(jnp.ones((emb,), jnp.float32)) if admin else None

    def attention_branch(self, x, bias, mask, *, deterministic: bool) -> jax.Array:
        """``Dropout(self_attn(x))``: the first sublayer's branch, ``[B, L, emb]``."""
        h = self.self_attn(x, x, mask, deterministic=deterministic, bias=bias)
        return self.dropout(h, deterministic=deterministic)

    def ffn_branch(self, x, token_mask, *, deterministic: bool) -> tuple[jax.Array, Any]:
        """``Dropout(ffn(x))`` and the MoE metrics (None for a dense FFN)."""
        h, metrics = self.ffn(x, token_mask, deterministic=deterministic)
        return self.dropout(h, deterministic=deterministic), metrics

    @staticmethod
    def residual(x: jax.Array, scale: nnx.Param | None) -> jax.Array:
        """The residual input of a sublayer: ``x``, times Admin's ``omega`` where there is one."""
        return x if scale is None else x * scale[...].astype(x.dtype)

    def __call__(self, x, bias, mask, token_mask, *, deterministic: bool):
        """x ``[B,L,emb]``, bias ``[1, H, L, L]``, mask ``[B, 1, 1, L]``, token_mask ``[B, L]``."""
        h = self.attention_branch(x, bias, mask, deterministic=deterministic)
        x = self.self_attn_norm(self.residual(x, self.attn_residual_scale) + h)
        h, metrics = self.ffn_branch(x, token_mask, deterministic=deterministic)
        x = self.ffn_norm(self.residual(x, self.ffn_residual_scale) + h)
        return x, metrics


class Encoder(nnx.Module):
    """The encoder of ``config.model`` / ``config.router`` (schema: ``configs/electra.py``).

    Args:
      model: the encoder's section (``config.model``).
      router: the routers' section (``config.router``).
      vocab_size: vocabulary size (id 0 is padding).
      mesh: optional ``("data", "fsdp", "expert")`` mesh handed to the MoE layers.
      rngs: ``params`` for initialisation; ``dropout`` and ``router`` streams for training.
      embeddings: an :class:`Embeddings` block to share (ELECTRA's tied embeddings); a new one
        is made if None.
    """

    def __init__(
        self,
        model: EncoderConfig,
        router: RouterConfig,
        vocab_size: int,
        *,
        mesh=None,
        rngs: nnx.Rngs,
        embeddings: Embeddings | None = None,
    ):
        self.vocab_size = int(vocab_size)
        self.emb_dim = model.emb_dim
        self.num_experts = model.moe.num_experts
        self.dtype = model.dtype
        if embeddings is None:
            embeddings = Embeddings(
                self.vocab_size, self.emb_dim, dropout=model.dropout, dtype=self.dtype,
                rngs=rngs, absolute_positions=model.absolute_positions, mesh=mesh,
            )
        self.embeddings = embeddings
        self.position_bias = RelativePositionBias(
            model.num_heads,
            num_buckets=model.relative_buckets,
            max_distance=model.relative_max_distance,
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                EncoderLayer(model, router, i, dtype=self.dtype, mesh=mesh, rngs=rngs)
                for i in range(model.num_layers)
            ]
        )

    def __call__(
        self,
        tokens: jax.Array,
        *,
        segments: jax.Array | None = None,
        deterministic: bool = True,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Encodes ``tokens``.

        Args:
          tokens: int ``[B, L]``, 0-padded.
          segments: int ``[B, L]`` segment ids (0 or 1); all 0 if None.
          deterministic: no dropout, deterministic routing.

        Returns:
          ``hidden [B, L, emb]`` in the compute dtype and ``aux``:
          ``{"moe": {"layer_0": metrics, ...}, "balance_loss": ..., "z_loss": ...}`` (sums over
          MoE layers, float32 scalars, 0 for a dense encoder), as the translation Transformer.
        """
        if segments is None:
            segments = jnp.zeros_like(tokens)
        token_mask = tokens != PAD_ID
        x = self.embeddings(tokens, segments, deterministic=deterministic)
        bias = self.position_bias(tokens.shape[1])
        attn_mask = token_mask[:, None, None, :]
        metrics = {}
        for i, layer in enumerate(self.layers):
            x, layer_metrics = layer(x, bias, attn_mask, token_mask, deterministic=deterministic)
            if layer_metrics is not None:
                metrics[f"layer_{i}"] = layer_metrics
        return x, fairseq.collect_moe_metrics(metrics)

    def set_admin_scales(self, tokens: jax.Array, segments: jax.Array | None = None
                         ) -> list[float]:
        """Admin's profiling pass: sets every sublayer's residual scale from a batch.

        Sublayer by sublayer, in the deterministic forward (no dropout, routing by the argmax),
        ``omega_1 = 1`` and ``omega_{i+1} = sqrt(Var[omega_i x_i] + Var[f_i(x_i)])``, where
        ``x_i`` is the sublayer's input (a LayerNorm's output, variance about 1) and ``f_i`` its
        branch: each scale is the standard deviation the residual sum before the previous
        LayerNorm had, so ``omega_i^2`` is about ``1 + sum_{j<i} Var[f_j]``. Variances are over
        the real tokens' elements of ``tokens`` (int ``[B, L]``, 0-padded).

        The reference (Liu et al.'s Transformer-Clinic) profiles in training mode, dropout on,
        and over padding too; here the scales are those of the function the model computes at
        inference, on real tokens. Returns the scales, two per layer.
        """
        if any(layer.attn_residual_scale is None for layer in self.layers):
            raise ValueError("set_admin_scales needs an encoder built with model.init='admin'")
        if segments is None:
            segments = jnp.zeros_like(tokens)
        token_mask = tokens != PAD_ID
        real = token_mask[..., None].astype(jnp.float32)
        count = jnp.maximum(jnp.sum(real), 1.0) * self.emb_dim

        def variance(v: jax.Array) -> float:
            v = v.astype(jnp.float32)
            mean = jnp.sum(v * real) / count
            return float(jnp.sum(((v - mean) * real) ** 2) / count)

        x = self.embeddings(tokens, segments, deterministic=True)
        bias = self.position_bias(tokens.shape[1])
        attn_mask = token_mask[:, None, None, :]
        omega, scales = 1.0, []
        for layer in self.layers:
            for name in ("attn", "ffn"):
                scale = getattr(layer, f"{name}_residual_scale")
                scale[...] = jnp.full((self.emb_dim,), omega, jnp.float32)
                scales.append(omega)
                if name == "attn":
                    h = layer.attention_branch(x, bias, attn_mask, deterministic=True)
                else:
                    h, _ = layer.ffn_branch(x, token_mask, deterministic=True)
                residual = layer.residual(x, scale)
                omega = math.sqrt(variance(residual) + variance(h))
                norm = layer.self_attn_norm if name == "attn" else layer.ffn_norm
                x = norm(residual + h)
        return scales
