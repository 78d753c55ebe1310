"""Switch Transformer encoder-decoder (fairseq ``transformer_wmt_en_de`` layout) in Flax NNX.

Transformer-base by default: 6+6 post-norm layers, ``x = LayerNorm(x + Dropout(sublayer(x)))``,
sinusoidal positions, one vocabulary shared by source, target and the (tied) output projection,
token embeddings scaled by ``sqrt(emb_dim)``. Every ``moe_every``-th feed-forward layer (layers
0, 2, 4 by default) is a :class:`sparsemixer_jax.moe.MoEFeedForward`; ``num_experts = 0`` gives
the dense baseline.

Conventions: token id 0 is padding and also the decoder's start token (the decoder input is the
target shifted right, as in flax ``examples/wmt``). Boolean attention masks are True where a query
may attend to a key. Parameters are float32; ``model.compute_dtype = "bfloat16"`` runs matmuls in
bf16 while attention softmax, LayerNorm statistics and the logits stay float32.

Generation uses an explicit key/value cache (:class:`sparsemixer_jax.layers.attention.KVCache`, a
pytree of arrays, its keys and values one array per decoder layer) so that one
decoding step is a pure function of ``(tokens, cache)`` and runs under ``jax.lax.while_loop``::

    encoded = model.encode(inputs)                 # once per batch
    cache = model.init_cache(batch_size, max_len)  # self-attention keys/values, all zeros
    logits, cache = model.decode_step(tokens, cache, encoded)  # one target position per call
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import uses_admin
from sparsemixer_jax.layers.attention import KVCache, write_slots
from sparsemixer_jax.layers.fairseq import (
    ModelConfig,
    collect_moe_metrics,
    make_attention,
    make_ffn,
)
from sparsemixer_jax.layers.norms import layer_norm
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import check_positive
from sparsemixer_jax.token_ids import PAD_ID


def shift_right(targets: jax.Array) -> jax.Array:
    """Decoder inputs: ``[B, T]`` targets shifted one step right with ``PAD_ID`` as start token."""
    start = jnp.full_like(targets[:, :1], PAD_ID)
    return jnp.concatenate([start, targets[:, :-1]], axis=1)


def sinusoidal_positions(positions: jax.Array, dim: int) -> jax.Array:
    """fairseq sinusoidal embedding: float32 ``[*positions.shape, dim]``, ``[sin | cos]`` halves.

    ``positions`` are int, 0-based. Frequencies are ``10000^(-i / (dim/2 - 1))``.
    """
    half = dim // 2
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / (half - 1)))
    angles = positions.astype(jnp.float32)[..., None] * freqs
    emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if dim % 2:
        emb = jnp.concatenate([emb, jnp.zeros((*emb.shape[:-1], 1), emb.dtype)], axis=-1)
    return emb


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """``config.model`` of the translation Transformer (schema: ``configs/wmt.py``): the fields
    of :class:`~sparsemixer_jax.layers.fairseq.ModelConfig` and the depth of each stack."""

    encoder_layers: int = 6
    decoder_layers: int = 6

    def check(self, where: str = "") -> TransformerConfig:
        check_positive(where, encoder_layers=self.encoder_layers,
                       decoder_layers=self.decoder_layers)
        if uses_admin(self.init):
            raise ValueError(f"{where}init={self.init!r}: Admin's residual scales are built for "
                             "the ELECTRA encoder; the translation model takes 'fairseq' or "
                             "'flax'")
        return super().check(where)


# -- layers ---------------------------------------------------------------------------------------


class EncoderLayer(nnx.Module):
    """Post-norm encoder layer: self-attention, then the (dense or MoE) feed-forward."""

    def __init__(self, model: ModelConfig, router: RouterConfig, layer: int, *, dtype, mesh,
                 rngs: nnx.Rngs):
        emb = model.emb_dim
        self.self_attn = make_attention(model, dtype, rngs)
        self.self_attn_norm = layer_norm(emb, dtype, rngs)
        self.ffn = make_ffn(model, router, layer, dtype, mesh, rngs)
        self.ffn_norm = layer_norm(emb, dtype, rngs)
        self.dropout = nnx.Dropout(model.dropout, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        token_mask: jax.Array,
        *,
        deterministic: bool,
        dropless: bool = False,
    ) -> tuple[jax.Array, dict | None]:
        """``x [B, S, emb]``, ``mask [B, 1, 1, S]``, ``token_mask [B, S]`` -> ``x``, metrics."""
        h = self.self_attn(x, x, mask, deterministic=deterministic)
        x = self.self_attn_norm(x + self.dropout(h, deterministic=deterministic))
        h, metrics = self.ffn(x, token_mask, deterministic=deterministic, dropless=dropless)
        x = self.ffn_norm(x + self.dropout(h, deterministic=deterministic))
        return x, metrics


class DecoderLayer(nnx.Module):
    """Post-norm decoder layer: causal self-attention, cross-attention, feed-forward."""

    def __init__(self, model: ModelConfig, router: RouterConfig, layer: int, *, dtype, mesh,
                 rngs: nnx.Rngs):
        emb = model.emb_dim
        self.self_attn = make_attention(model, dtype, rngs)
        self.self_attn_norm = layer_norm(emb, dtype, rngs)
        self.cross_attn = make_attention(model, dtype, rngs)
        self.cross_attn_norm = layer_norm(emb, dtype, rngs)
        self.ffn = make_ffn(model, router, layer, dtype, mesh, rngs)
        self.ffn_norm = layer_norm(emb, dtype, rngs)
        self.dropout = nnx.Dropout(model.dropout, rngs=rngs)

    def _residual(self, norm, x, h, deterministic):
        return norm(x + self.dropout(h, deterministic=deterministic))

    def __call__(
        self,
        x: jax.Array,
        self_kv: tuple[jax.Array, jax.Array],
        self_mask: jax.Array,
        cross_kv: tuple[jax.Array, jax.Array],
        cross_mask: jax.Array,
        token_mask: jax.Array | None,
        *,
        deterministic: bool,
        dropless: bool = False,
    ) -> tuple[jax.Array, dict | None]:
        """One decoder layer on ``x [B, T, emb]`` given precomputed keys/values.

        ``self_kv`` are the self-attention keys/values ``[B, L, H, Dh]`` (of ``x`` itself in the
        teacher-forced pass, or the cache in incremental decoding), ``cross_kv`` those of the
        encoder output ``[B, S, H, Dh]``. Masks broadcast to ``[B, H, T, L]`` and ``[B, H, T, S]``.
        """
        h = self.self_attn.attend(self.self_attn.project_q(x), *self_kv, self_mask,
                                  deterministic=deterministic)
        x = self._residual(self.self_attn_norm, x, h, deterministic)
        h = self.cross_attn.attend(self.cross_attn.project_q(x), *cross_kv, cross_mask,
                                   deterministic=deterministic)
        x = self._residual(self.cross_attn_norm, x, h, deterministic)
        h, metrics = self.ffn(x, token_mask, deterministic=deterministic, dropless=dropless)
        x = self._residual(self.ffn_norm, x, h, deterministic)
        return x, metrics


# -- decoding state -------------------------------------------------------------------------------


class Encoded(NamedTuple):
    """What incremental decoding needs from the encoder (a pytree; batch axis first).

    Attributes:
      cross_k, cross_v: per decoder layer, the cross-attention keys/values ``[B, S, H, Dh]``.
      src_mask: bool ``[B, S]``, True on source tokens (not padding).
    """

    cross_k: tuple[jax.Array, ...]
    cross_v: tuple[jax.Array, ...]
    src_mask: jax.Array


# -- the model ------------------------------------------------------------------------------------


def _token_embedding_init(emb_dim: int):
    # fairseq: N(0, emb_dim^-1/2); with the sqrt(emb_dim) input scale the inputs have unit scale.
    # Unlike fairseq, row 0 (padding) is neither zeroed nor frozen: it is also the decoder's start
    # token here, and padded positions are masked out of attention and the loss anyway.
    return nnx.initializers.normal(stddev=emb_dim**-0.5)


class Transformer(nnx.Module):
    """Switch Transformer encoder-decoder for translation.

    Args:
      model: the model's section (``config.model``; see ``configs/wmt.py``).
      router: the routers' section (``config.router``).
      vocab_size: size of the shared vocabulary (id 0 is padding / decoder start).
      mesh: optional ``jax.sharding.Mesh`` handed to the MoE layers; with one, the activations
        stay split by rows between layers and the embedding lookup reads the table gathered
        whole (:func:`sparsemixer_jax.parallel.sharding.keep_rows_split`,
        :func:`~sparsemixer_jax.parallel.sharding.lookup_rows`).
      rngs: ``nnx.Rngs``; ``params`` for initialisation, ``dropout`` (and whatever the MoE layer
        uses for routing) at training time.
    """

    def __init__(self, model: TransformerConfig, router: RouterConfig, vocab_size: int, *,
                 mesh=None, rngs: nnx.Rngs):
        self.vocab_size = int(vocab_size)
        self.emb_dim = model.emb_dim
        self.num_heads = model.num_heads
        self.num_experts = model.moe.num_experts
        self.dtype = dtype = model.dtype
        self.rows_sharding = sharding.rows_sharding(mesh)
        self.whole_sharding = sharding.whole_sharding(mesh)
        self.embed = nnx.Embed(
            self.vocab_size,
            self.emb_dim,
            embedding_init=_token_embedding_init(self.emb_dim),
            dtype=dtype,
            rngs=rngs,
        )
        self.embed_dropout = nnx.Dropout(model.dropout, rngs=rngs)
        self.encoder_layers = nnx.List(
            [
                EncoderLayer(model, router, i, dtype=dtype, mesh=mesh, rngs=rngs)
                for i in range(model.encoder_layers)
            ]
        )
        self.decoder_layers = nnx.List(
            [
                DecoderLayer(model, router, i, dtype=dtype, mesh=mesh, rngs=rngs)
                for i in range(model.decoder_layers)
            ]
        )

    # -- pieces ----------------------------------------------------------------------------------

    def _embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
        """``tokens [B, T]`` at ``positions`` (broadcastable to ``[B, T]``) -> ``[B, T, emb]``."""
        table = self.embed.embedding[...].astype(self.dtype)
        x = sharding.lookup_rows(table, tokens, self.whole_sharding)
        x = x * jnp.asarray(math.sqrt(self.emb_dim), self.dtype)
        x = x + sinusoidal_positions(positions, self.emb_dim).astype(self.dtype)
        return self.embed_dropout(x, deterministic=deterministic)

    def _logits(self, x: jax.Array) -> jax.Array:
        """Tied output projection: ``[..., emb]`` -> float32 ``[..., V]`` (f32 accumulation)."""
        table = self.embed.embedding[...].astype(self.dtype)
        return jnp.einsum("...e,ve->...v", x, table, preferred_element_type=jnp.float32)

    def _encode(
        self, inputs: jax.Array, deterministic: bool, dropless: bool = False
    ) -> tuple[jax.Array, jax.Array, dict[str, dict]]:
        """Encoder over ``inputs [B, S]`` -> hidden ``[B, S, emb]``, source mask, MoE metrics."""
        src_mask = inputs != PAD_ID
        positions = jnp.arange(inputs.shape[1])[None, :]
        x = self._embed(inputs, positions, deterministic)
        attn_mask = src_mask[:, None, None, :]
        metrics = {}
        for i, layer in enumerate(self.encoder_layers):
            x = sharding.keep_rows_split(x, self.rows_sharding)
            x, layer_metrics = layer(
                x, attn_mask, src_mask, deterministic=deterministic, dropless=dropless
            )
            if layer_metrics is not None:
                metrics[f"encoder/layer_{i}"] = layer_metrics
        return x, src_mask, metrics

    def _cross_kv(self, hidden: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        kvs = [layer.cross_attn.project_kv(hidden) for layer in self.decoder_layers]
        return tuple(k for k, _ in kvs), tuple(v for _, v in kvs)

    # -- teacher-forced forward ------------------------------------------------------------------

    def __call__(
        self, inputs: jax.Array, targets: jax.Array, *, deterministic: bool = False
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Teacher-forced forward pass.

        Args:
          inputs: int ``[B, S]`` source ids, 0-padded.
          targets: int ``[B, T]`` target ids, 0-padded; the decoder reads them shifted right.
          deterministic: disable dropout and use deterministic (argmax) routing.

        Returns:
          ``logits`` float32 ``[B, T, V]`` (position t predicts ``targets[:, t]``) and ``aux``:
          ``{"moe": {"encoder/layer_0": metrics, ..., "decoder/layer_0": ...},
          "balance_loss": sum over MoE layers, "z_loss": sum over MoE layers}`` (both float32
          scalars, 0 for the dense model).
        """
        hidden, src_mask, metrics = self._encode(inputs, deterministic)
        hidden = sharding.keep_rows_split(hidden, self.rows_sharding)
        cross_k, cross_v = self._cross_kv(hidden)

        tgt_mask = targets != PAD_ID
        length = targets.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        # Key j holds decoder input j; it is masked where target j is padding, which for every
        # non-padding query equals masking padded decoder inputs (the start token stays visible).
        self_mask = causal[None, None] & tgt_mask[:, None, None, :]
        cross_mask = src_mask[:, None, None, :]

        x = self._embed(shift_right(targets), jnp.arange(length)[None, :], deterministic)
        for i, layer in enumerate(self.decoder_layers):
            x = sharding.keep_rows_split(x, self.rows_sharding)
            self_kv = layer.self_attn.project_kv(x)
            x, layer_metrics = layer(
                x,
                self_kv,
                self_mask,
                (cross_k[i], cross_v[i]),
                cross_mask,
                tgt_mask,
                deterministic=deterministic,
            )
            if layer_metrics is not None:
                metrics[f"decoder/layer_{i}"] = layer_metrics
        x = sharding.keep_rows_split(x, self.rows_sharding)
        return self._logits(x), collect_moe_metrics(metrics)

    # -- incremental decoding --------------------------------------------------------------------

    def encode(self, inputs: jax.Array, *, deterministic: bool = True) -> Encoded:
        """Runs the encoder on ``inputs [B, S]`` and projects its output for every decoder layer.

        Decoding (this and :meth:`decode_step`) is dropless even with ``capacity_factor > 0``: a
        capacity shared by the sentences of a batch (and, per step, by a handful of tokens) would
        make a sentence's translation depend on the others it is batched with.
        """
        hidden, src_mask, _ = self._encode(inputs, deterministic, dropless=True)
        cross_k, cross_v = self._cross_kv(hidden)
        return Encoded(cross_k=cross_k, cross_v=cross_v, src_mask=src_mask)

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache for ``batch_size`` sequences of at most ``max_len`` decoder positions:
        keys and values ``[B, max_len, H, Dh]`` per decoder layer."""
        head_dim = self.emb_dim // self.num_heads
        shape = (batch_size, max_len, self.num_heads, head_dim)
        n = len(self.decoder_layers)
        zeros = tuple(jnp.zeros(shape, self.dtype) for _ in range(n))
        return KVCache.empty(zeros, zeros, batch_size, max_len)

    def decode_step(
        self,
        tokens: jax.Array,
        cache: KVCache,
        encoded: Encoded,
        *,
        deterministic: bool = True,
    ) -> tuple[jax.Array, KVCache]:
        """Feeds one decoder input per sequence and returns the next-token logits.

        Args:
          tokens: int ``[B]``, the decoder input at position ``cache.index`` (``PAD_ID`` as the
            start token at position 0, then the previously chosen token).
          cache: from :meth:`init_cache` or the previous step; batch size ``B``.
          encoded: from :meth:`encode`, batch size ``B`` (repeat it for beams).

        Returns:
          float32 ``[B, V]`` logits for the token at position ``cache.index`` and the updated
          cache (``index + 1``). Equal to the teacher-forced logits at that position.
        """
        index = cache.index
        real = jnp.ones((tokens.shape[0], 1), bool)  # every row feeds a token at every step
        x = self._embed(tokens[:, None], index[None, None], deterministic)
        # The keys at slots up to and including this one: a length per row, as cuDNN reads it.
        self_mask = cache.valid_after(real)[:, None, None, :]
        cross_mask = encoded.src_mask[:, None, None, :]
        new_k, new_v = [], []
        for i, layer in enumerate(self.decoder_layers):
            k_new, v_new = layer.self_attn.project_kv(x)
            k = write_slots(cache.keys[i], k_new, index)
            v = write_slots(cache.values[i], v_new, index)
            new_k.append(k)
            new_v.append(v)
            x, _ = layer(
                x,
                (k, v),
                self_mask,
                (encoded.cross_k[i], encoded.cross_v[i]),
                cross_mask,
                None,
                deterministic=deterministic,
                dropless=True,
            )
        return self._logits(x[:, 0]), cache.advanced(tuple(new_k), tuple(new_v), real)
