"""Layers shared by the models: attention, the dense feed-forward, LayerNorm, the FFN choice.

The translation Transformer (:mod:`sparsemixer_jax.models`) and the ELECTRA encoder
(:mod:`sparsemixer_jax.encoder`) are built from these. Parameters are float32; ``dtype`` is the
compute dtype (matmuls in bf16 when asked, softmax and LayerNorm statistics in float32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.initializers import attention_init, feed_forward_init
from sparsemixer_jax.moe import MoEFeedForward, activation_fn
from sparsemixer_jax.routers import options_from_config

# Large negative logit for masked attention entries; finite so that a fully masked row gives a
# uniform distribution instead of NaN.
MASK_VALUE = -1e9



def compute_dtype(name: str) -> jnp.dtype:
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"compute_dtype must be 'float32' or 'bfloat16', got {name!r}")
    return jnp.dtype(name)


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


class Attention(nnx.Module):
    """Multi-head attention with separate q/k/v/out projections (with biases), as in fairseq.

    Split into :meth:`project_kv` and :meth:`attend` so that the decoder can cache keys/values.
    ``init`` is the initialisation scheme (:mod:`sparsemixer_jax.initializers`).
    """

    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        *,
        attention_dropout: float,
        dtype: jnp.dtype,
        implementation: str = "einsum",
        init: str = "flax",
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
    (:mod:`sparsemixer_jax.initializers`); ``x [..., emb] -> [..., emb]``.
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
        init: str = "flax",
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


def make_ffn(model_cfg: Any, router_cfg: Any, layer: int, dtype, mesh, rngs: nnx.Rngs):
    """The feed-forward sublayer of ``layer``: MoE on every ``moe_every``-th layer, else dense;
    both with ``model_cfg.activation`` and initialised by ``model_cfg.init``."""
    num_experts = int(model_cfg.num_experts)
    if num_experts > 0 and layer % int(model_cfg.moe_every) == 0:
        return MoEFeedForward(
            model_cfg.emb_dim,
            model_cfg.mlp_dim,
            num_experts,
            router=router_cfg.name,
            jitter_eps=float(router_cfg.jitter_eps),
            top_k=int(router_cfg.top_k),
            activation_dropout=float(model_cfg.activation_dropout),
            dispatch=model_cfg.dispatch,
            grouped_impl=str(model_cfg.grouped_impl),
            capacity_factor=float(model_cfg.capacity_factor),
            activation=str(model_cfg.activation),
            router_init_scale=float(router_cfg.init_scale),
            init=str(model_cfg.init),
            default_decay=float(router_cfg.default_decay),
            router_options=options_from_config(router_cfg),
            dtype=dtype,
            mesh=mesh,
            rngs=rngs,
        )
    return FeedForward(
        model_cfg.emb_dim,
        model_cfg.mlp_dim,
        activation_dropout=float(model_cfg.activation_dropout),
        dtype=dtype,
        rngs=rngs,
        activation=str(model_cfg.activation),
        init=str(model_cfg.init),
    )


def layer_norm(emb_dim: int, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # fairseq's LayerNorm epsilon; flax computes the statistics in float32 whatever ``dtype``.
    return nnx.LayerNorm(emb_dim, epsilon=1e-5, dtype=dtype, rngs=rngs)


def collect_moe_metrics(metrics: dict[str, dict]) -> dict[str, Any]:
    """Collects per-layer MoE metrics and sums the auxiliary losses over layers."""
    zero = jnp.zeros((), jnp.float32)
    balance = sum((m["balance_loss"] for m in metrics.values()), zero)
    z_loss = sum((m["z_loss"] for m in metrics.values()), zero)
    return {"moe": metrics, "balance_loss": balance, "z_loss": z_loss}


