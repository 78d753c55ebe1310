"""Layers shared by the models: attention, the dense feed-forward, LayerNorm, the FFN choice,
and the model section every model's config extends (:class:`ModelConfig`).

The translation Transformer (:mod:`sparsemixer_jax.models.encoder_decoder`) and the ELECTRA
encoder (:mod:`sparsemixer_jax.models.encoder`) are built from these. Parameters are float32;
``dtype`` is the compute dtype (matmuls in bf16 when asked, softmax and LayerNorm statistics in
float32).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import attention_init, feed_forward_init
from sparsemixer_jax.moe import MoEConfig, MoEFeedForward, activation_fn
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import check_fraction, check_positive, read_fields

# Large negative logit for masked attention entries; finite so that a fully masked row gives a
# uniform distribution instead of NaN.
MASK_VALUE = -1e9
DTYPES = ("float32", "bfloat16")


def compute_dtype(name: str) -> jnp.dtype:
    if name not in DTYPES:
        raise ValueError(f"compute_dtype must be 'float32' or 'bfloat16', got {name!r}")
    return jnp.dtype(name)


# -- the model section ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.model`` every model has; each model's section extends it
    (:class:`sparsemixer_jax.models.encoder_decoder.TransformerConfig`,
    :class:`sparsemixer_jax.models.encoder.EncoderConfig`).

    Attributes:
      emb_dim, mlp_dim, num_heads: widths and attention heads (``num_heads`` divides
        ``emb_dim``).
      moe: the feed-forward sublayers (dense or MoE), read from the same section.
      dropout, attention_dropout: residual and attention-weight dropout rates, in ``[0, 1)``.
      attention_impl: a key of :data:`ATTENTION_IMPLS`.
      compute_dtype: ``"float32"`` or ``"bfloat16"`` (params stay float32).
    """

    emb_dim: int
    mlp_dim: int
    num_heads: int
    moe: MoEConfig
    dropout: float = 0.1
    attention_dropout: float = 0.1
    attention_impl: str = "einsum"
    compute_dtype: str = "float32"

    @classmethod
    def from_config(cls: type[M], section: Any, where: str = "config.model.") -> M:
        """The model of ``section`` (``config.model``), checked (:meth:`check`)."""
        moe = MoEConfig(**read_fields(MoEConfig, section, where))
        return cls(moe=moe, **read_fields(cls, section, where, skip=("moe",))).check(where)

    def check(self: M, where: str = "") -> M:
        """``self`` if every field is usable, else a one-line ValueError naming the first one
        that is not with the prefix ``where``."""
        check_positive(where, emb_dim=self.emb_dim, mlp_dim=self.mlp_dim,
                       num_heads=self.num_heads)
        if self.emb_dim % self.num_heads:
            raise ValueError(f"{where}emb_dim={self.emb_dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        check_fraction(where, dropout=self.dropout, attention_dropout=self.attention_dropout)
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"{where}compute_dtype must be float32 or bfloat16, got "
                             f"{self.compute_dtype!r}")
        self.moe.check(where)
        try:
            check_attention_impl(self.attention_impl, self.attention_dropout)
        except ValueError as err:
            raise ValueError(f"{where}attention_impl: {err}") from None
        check_attention_dtype(self.attention_impl, self.compute_dtype, where)
        return self

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def init(self) -> str:
        """The initialisation scheme of the whole model (``config.model.init``)."""
        return self.moe.init


M = TypeVar("M", bound=ModelConfig)


# -- attention ------------------------------------------------------------------------------------


# model.attention_impl -> jax.nn.dot_product_attention's ``implementation`` ("einsum" is this
# module's own attention, the only one with dropout on the attention weights: the paper's setting).
# "xla" and "auto" (jax picks; XLA in jax 0.10) take the boolean mask as it is. "cudnn" is cuDNN's
# fused flash attention (NVIDIA GPUs, bf16): a general mask would become an additive bias that the
# kernel reads in full, so it gets the masks as sequence lengths and a causal flag instead
# (:func:`mask_as_lengths`).
ATTENTION_IMPLS = {"einsum": None, "xla": "xla", "cudnn": "cudnn", "auto": None}
_LENGTH_MASKED = ("cudnn",)


def mask_as_lengths(mask: jax.Array, batch: int, queries: int) -> tuple[jax.Array, bool]:
    """The model's attention masks as ``(key lengths int32 [B], causal)``.

    Every mask this model builds keeps the keys before a per-row length (padding is on the right)
    and, when it has a query axis longer than one (decoder self-attention in training), is also
    causal. A row without any key gets length 1 instead of 0 (only all-padding filler rows have
    none; their outputs are never used), so no kernel sees an empty row.
    """
    causal = mask.shape[-2] > 1
    last_row = jnp.broadcast_to(mask, (batch, 1, queries, mask.shape[-1]))[:, 0, -1, :]
    return jnp.maximum(jnp.sum(last_row, axis=-1, dtype=jnp.int32), 1), causal


def check_attention_impl(implementation: str, attention_dropout: float) -> None:
    """Raises ValueError if ``implementation`` is unknown or cannot apply ``attention_dropout``."""
    if implementation not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {implementation!r}; expected one of "
                         f"{sorted(ATTENTION_IMPLS)}")
    if implementation != "einsum" and attention_dropout > 0:
        raise ValueError(
            f"attention implementation {implementation!r} has no dropout on the attention "
            f"weights, but attention_dropout={attention_dropout}: set it to 0 or use 'einsum'"
        )


def check_attention_dtype(implementation: str, compute_dtype: str, where: str = "") -> None:
    """Raises ValueError unless ``implementation`` runs in ``compute_dtype``: cuDNN's fused
    (flash) attention takes 16-bit inputs, so ``"cudnn"`` needs ``"bfloat16"``. ``where``
    prefixes both field names (``"config.model."``)."""
    if implementation == "cudnn" and compute_dtype != "bfloat16":
        raise ValueError(f"{where}attention_impl='cudnn' needs {where}compute_dtype='bfloat16' "
                         f"(cuDNN's fused attention takes 16-bit inputs), got {compute_dtype!r}")


class Attention(nnx.Module):
    """Multi-head attention with separate q/k/v/out projections (with biases), as in fairseq.

    Split into :meth:`project_kv` and :meth:`attend` so that the decoder can cache keys/values.
    ``init`` is the initialisation scheme (:mod:`sparsemixer_jax.initializers`; by default the
    model section's, :class:`~sparsemixer_jax.moe.MoEConfig`'s).
    """

    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        *,
        attention_dropout: float,
        dtype: jnp.dtype,
        implementation: str = "einsum",
        init: str = MoEConfig.init,
        rngs: nnx.Rngs,
    ):
        if emb_dim % num_heads:
            raise ValueError(f"emb_dim {emb_dim} is not divisible by num_heads {num_heads}")
        check_attention_impl(implementation, attention_dropout)
        self.num_heads = num_heads
        self.head_dim = emb_dim // num_heads
        self.dtype = dtype
        self.implementation = implementation

        inits = attention_init(init, emb_dim)
        self.query = inits["qkv"].linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.key = inits["qkv"].linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.value = inits["qkv"].linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.out = inits["out"].linear(emb_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(attention_dropout, rngs=rngs)

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values of ``x [B, S, emb]``: each ``[B, S, H, Dh]`` in the compute dtype."""
        return self._heads(self.key(x)), self._heads(self.value(x))

    def attend(
        self,
        x: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask: jax.Array,
        *,
        deterministic: bool,
        bias: jax.Array | None = None,
    ) -> jax.Array:
        """Queries from ``x [B, T, emb]`` attend to ``k, v [B, S, H, Dh]``.

        ``mask`` is bool, broadcastable to ``[B, H, T, S]``; ``bias`` (float32, broadcastable to
        ``[B, H, T, S]``, e.g. T5's relative position bias ``[1, H, T, S]``) is added to the
        scaled logits before masking. Returns ``[B, T, emb]``.
        """
        if self.implementation != "einsum":
            # Fused attention: no dropout on the weights (check_attention_impl), softmax in
            # float32 inside the kernel / XLA's reference, the same scale and mask.
            q = self._heads(self.query(x))
            kwargs = {"mask": jnp.broadcast_to(mask, (q.shape[0], 1, q.shape[1], k.shape[1]))}
            if self.implementation in _LENGTH_MASKED:
                lengths, causal = mask_as_lengths(mask, q.shape[0], q.shape[1])
                kwargs = {"key_value_seq_lengths": lengths, "is_causal": causal}
            if bias is not None:
                kwargs["bias"] = bias.astype(q.dtype)
            heads = jax.nn.dot_product_attention(
                q, k.astype(q.dtype), v.astype(q.dtype), scale=self.head_dim**-0.5,
                implementation=ATTENTION_IMPLS[self.implementation], **kwargs)
            return self.out(heads.reshape(*heads.shape[:2], -1))
        q = self._heads(self.query(x)) * (self.head_dim**-0.5)
        logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias
        logits = jnp.where(mask, logits, MASK_VALUE)
        weights = jax.nn.softmax(logits, axis=-1)
        weights = self.dropout(weights, deterministic=deterministic).astype(self.dtype)
        heads = jnp.einsum("bhts,bshd->bthd", weights, v)
        return self.out(heads.reshape(*heads.shape[:2], -1))

    def __call__(
        self, x: jax.Array, memory: jax.Array, mask: jax.Array, *, deterministic: bool,
        bias: jax.Array | None = None,
    ) -> jax.Array:
        k, v = self.project_kv(memory)
        return self.attend(x, k, v, mask, deterministic=deterministic, bias=bias)


# -- feed-forward ---------------------------------------------------------------------------------


class FeedForward(nnx.Module):
    """Dense FFN ``Linear -> activation -> Dropout -> Linear`` (fairseq ``fc1``/``fc2``).

    ``activation`` is ``"relu"`` (fairseq's translation Transformer, the default) or ``"gelu"``
    (BERT / ELECTRA / COCO-LM); ``init`` the initialisation scheme
    (:mod:`sparsemixer_jax.initializers`; by default the model section's); ``x [..., emb] ->
    [..., emb]``.
    """

    def __init__(
        self,
        emb_dim: int,
        mlp_dim: int,
        *,
        activation_dropout: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        activation: str = "relu",
        init: str = MoEConfig.init,
    ):
        activation_fn(activation)  # validates the name
        self.activation = activation
        self.wi = feed_forward_init(init, emb_dim).linear(emb_dim, mlp_dim, dtype=dtype, rngs=rngs)
        self.wo = feed_forward_init(init, mlp_dim).linear(mlp_dim, emb_dim, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(activation_dropout, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        token_mask: jax.Array | None = None,
        *,
        deterministic: bool = False,
        dropless: bool = False,
    ) -> tuple[jax.Array, None]:
        del token_mask, dropless  # only the MoE layer needs them
        h = self.dropout(activation_fn(self.activation)(self.wi(x)), deterministic=deterministic)
        return self.wo(h), None


def make_attention(model: ModelConfig, dtype, rngs: nnx.Rngs) -> Attention:
    """An attention sublayer with ``model``'s width, heads, dropout, implementation and init."""
    return Attention(model.emb_dim, model.num_heads, attention_dropout=model.attention_dropout,
                     dtype=dtype, implementation=model.attention_impl, init=model.init, rngs=rngs)


def make_ffn(model: ModelConfig, router: RouterConfig, layer: int, dtype, mesh,
             rngs: nnx.Rngs) -> MoEFeedForward | FeedForward:
    """The feed-forward sublayer of ``layer``: MoE where ``model.moe`` puts one, else dense."""
    moe = model.moe
    if moe.is_moe(layer):
        return MoEFeedForward.from_config(model.emb_dim, model.mlp_dim, moe, router, dtype=dtype,
                                          mesh=mesh, rngs=rngs)
    return FeedForward(model.emb_dim, model.mlp_dim, activation_dropout=moe.activation_dropout,
                       dtype=dtype, rngs=rngs, activation=moe.activation, init=moe.init)


def layer_norm(emb_dim: int, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # fairseq's LayerNorm epsilon; flax computes the statistics in float32 whatever ``dtype``.
    return nnx.LayerNorm(emb_dim, epsilon=1e-5, dtype=dtype, rngs=rngs)


def collect_moe_metrics(metrics: dict[str, dict]) -> dict[str, Any]:
    """Collects per-layer MoE metrics and sums the auxiliary losses over layers."""
    zero = jnp.zeros((), jnp.float32)
    balance = sum((m["balance_loss"] for m in metrics.values()), zero)
    z_loss = sum((m["z_loss"] for m in metrics.values()), zero)
    return {"moe": metrics, "balance_loss": balance, "z_loss": z_loss}


