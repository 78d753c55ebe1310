"""The sublayers of the fairseq-style models: fairseq's attention
(:mod:`sparsemixer_jax.layers.attention`'s module with fairseq's projections), the dense
feed-forward, the FFN choice, and the model section every such model's config extends
(:class:`ModelConfig`); their LayerNorm is :func:`sparsemixer_jax.layers.norms.layer_norm`.

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
from sparsemixer_jax.layers.attention import FAIRSEQ_NAMES, Attention, AttentionOptions
from sparsemixer_jax.layers.attention_impls import check_attention_dtype, check_attention_impl
from sparsemixer_jax.moe import MoEConfig, MoEFeedForward, activation_fn
from sparsemixer_jax.moe.shared import MakeLinear
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import check_fraction, check_positive, read_fields

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
      attention_impl: a key of :data:`~sparsemixer_jax.layers.attention_impls.ATTENTION_IMPLS`.
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
        if self.attention_impl == "splash":  # its masks are causal passes over packed rows
            raise ValueError(f"{where}attention_impl='splash' is the language models' causal "
                             f"attention on TPU; this model takes einsum, xla, auto or cudnn")
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


def fairseq_attention(
    emb_dim: int,
    num_heads: int,
    *,
    attention_dropout: float,
    dtype: jnp.dtype,
    implementation: str = "einsum",
    init: str = MoEConfig.init,
    rngs: nnx.Rngs,
) -> Attention:
    """Multi-head attention as in fairseq: separate q/k/v/out projections with biases (params
    ``query``, ``key``, ``value``, ``out``), dropout on the attention weights. ``init`` is the
    initialisation scheme (:mod:`sparsemixer_jax.initializers`; by default the model section's,
    :class:`~sparsemixer_jax.moe.MoEConfig`'s); ``implementation`` a key of
    :data:`~sparsemixer_jax.layers.attention_impls.ATTENTION_IMPLS`, given masks that are
    lengths (right padding, causal in decoder self-attention)."""
    if emb_dim % num_heads:
        raise ValueError(f"emb_dim {emb_dim} is not divisible by num_heads {num_heads}")
    inits = attention_init(init, emb_dim)

    def maker(which: str) -> MakeLinear:
        def make(in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
            del use_bias  # fairseq's projections all have biases (AttentionOptions' default)
            return inits[which].linear(in_features, out_features, dtype=dtype, rngs=rngs)
        return make

    options = AttentionOptions(emb_dim, num_heads, num_heads, emb_dim // num_heads,
                               names=FAIRSEQ_NAMES, dropout=attention_dropout,
                               implementation=implementation, masks_are_lengths=True,
                               einsum_layout="heads")
    return Attention(options, qkv_linear=maker("qkv"), out_linear=maker("out"), rngs=rngs)


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
    return fairseq_attention(model.emb_dim, model.num_heads,
                             attention_dropout=model.attention_dropout, dtype=dtype,
                             implementation=model.attention_impl, init=model.init, rngs=rngs)


def make_ffn(model: ModelConfig, router: RouterConfig, layer: int, dtype, mesh,
             rngs: nnx.Rngs) -> MoEFeedForward | FeedForward:
    """The feed-forward sublayer of ``layer``: MoE where ``model.moe`` puts one, else dense."""
    moe = model.moe
    if moe.is_moe(layer):
        return MoEFeedForward((model.emb_dim, model.mlp_dim), moe, router, dtype=dtype,
                              mesh=mesh, rngs=rngs)
    return FeedForward(model.emb_dim, model.mlp_dim, activation_dropout=moe.activation_dropout,
                       dtype=dtype, rngs=rngs, activation=moe.activation, init=moe.init)


def collect_moe_metrics(metrics: dict[str, dict]) -> dict[str, Any]:
    """Collects per-layer MoE metrics and sums the auxiliary losses over layers."""
    zero = jnp.zeros((), jnp.float32)
    balance = sum((m["balance_loss"] for m in metrics.values()), zero)
    z_loss = sum((m["z_loss"] for m in metrics.values()), zero)
    return {"moe": metrics, "balance_loss": balance, "z_loss": z_loss}


