"""The one attention module of every model, and the one key/value cache of cached decoding.

:class:`Attention` is multi-head attention with grouped query heads: the translation
Transformer and the ELECTRA encoder build it with fairseq's projections, attention-weight
dropout, cross-attention and (the encoder) a relative position bias
(:func:`sparsemixer_jax.layers.fairseq.make_attention`); the decoder-only language models build it
with
the Hugging Face types' projections, rotary positions, q/k norms, value clipping and sink logits
(:func:`sparsemixer_jax.models.causal_lm.make_attention`). Its parameters keep each model's
names (:attr:`AttentionOptions.names`), so both models' checkpoints and the Hugging Face name
tables read as before.

:class:`KVCache` holds the keys and values written so far: the translation decoder keeps one
array per decoder layer, the language model one per scanned stack layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.kernels.splash_attention import splash_block, splash_heads
from sparsemixer_jax.layers.attention_impls import ATTENTION_IMPLS, check_attention_impl
from sparsemixer_jax.layers.packed_attention import SegmentLayout, packed_attention
from sparsemixer_jax.layers.rope import apply_rope
from sparsemixer_jax.moe.shared import MakeLinear

# Large negative logit for masked attention entries; finite so that a fully masked row (padding)
# gives a uniform distribution instead of NaN.
MASK_VALUE = -1e9

#: Parameter names of the query, key, value and output projections: fairseq's (the translation
#: and ELECTRA checkpoints) and the Hugging Face types' (the language models' name tables).
FAIRSEQ_NAMES = ("query", "key", "value", "out")
HF_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")


def mask_as_lengths(mask: jax.Array, batch: int, queries: int) -> tuple[jax.Array, bool]:
    """Attention masks as ``(key lengths int32 [B], causal)``.

    For masks that keep the keys before a per-row length (padding on the right) and, when they
    have a query axis longer than one (decoder self-attention in training), are also causal. A
    row without any key gets length 1 instead of 0 (only all-padding filler rows have none;
    their outputs are never used), so no kernel sees an empty row.
    """
    causal = mask.shape[-2] > 1
    last_row = jnp.broadcast_to(mask, (batch, 1, queries, mask.shape[-1]))[:, 0, -1, :]
    return jnp.maximum(jnp.sum(last_row, axis=-1, dtype=jnp.int32), 1), causal


class FusedMask(NamedTuple):
    """What a fused attention (cuDNN's, splash) may take instead of a full causal pass's
    boolean mask (:meth:`Attention.attend`; XLA's and the einsum attention read the mask as it
    is).

    Attributes:
      exactly_causal: the mask hides the keys after each query and nothing else (one sequence
        per row, no padding, no sliding window): cuDNN takes its causal flag alone.
      segments: the packed documents as segment offsets
        (:func:`~sparsemixer_jax.layers.packed_attention.segment_layout`), or None: the mask.
      segment_ids, token_mask: splash's form of a causal mask without a window: the packed
        documents' ids (int ``[B, T]``) and the padding (bool ``[B, T]``), each None where
        there is none.
    """

    exactly_causal: bool = False
    segments: SegmentLayout | None = None
    segment_ids: jax.Array | None = None
    token_mask: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """What an :class:`Attention` computes.

    Attributes:
      emb_dim: width of the inputs and of the output.
      num_heads, num_kv_heads, head_dim: query heads, key/value heads (dividing ``num_heads``;
        query head ``h`` reads key/value head ``h // (num_heads / num_kv_heads)``, as
        transformers' ``repeat_kv`` lays them out) and the width of a head.
      names: the parameter names of the q/k/v/output projections (:data:`FAIRSEQ_NAMES` or
        :data:`HF_NAMES`).
      qkv_bias, out_bias: biases of the q/k/v projections and of the output projection.
      dropout: dropout rate on the attention weights; None: no dropout layer at all (the
        language models, whose RNG streams have none).
      implementation: a key of :data:`ATTENTION_IMPLS`.
      masks_are_lengths: the caller's masks keep the keys before a per-row length and are
        causal where the query axis is longer than one (the translation and ELECTRA models), so
        cuDNN takes them as lengths and a causal flag (:func:`mask_as_lengths`) instead of a
        general mask that it would read in full as an additive bias. False (the language
        models: packed documents, sliding windows, left padding): cuDNN takes the boolean mask,
        or what the caller's :class:`FusedMask` gives instead, and only for a full causal pass
        (:meth:`Attention.attend`'s ``causal``); cached decoding takes XLA's form.
      qk_norm: ``"none"``, ``"head"`` (a norm over each head's query and key, Qwen3-MoE) or
        ``"full"`` (over the whole query and key projections, before the head split, OLMoE).
      clip_qkv: clamp queries, keys and values to ``[-clip_qkv, clip_qkv]`` (OLMoE), or None.
      sinks: a learned logit per head in the softmax's denominator (gpt-oss's ``sinks``).
      output_gate: the query projection is twice as wide, per head its query then a gate, and
        each head's output is multiplied by the gate's sigmoid before the output projection
        (Qwen3-Next's gated attention: :meth:`Attention.project_q_and_gate`).
      einsum_layout: how the einsum attention lays out its operands: ``"grouped"`` (logits
        ``[B, KV, H / KV, T, S]``, the language models') or ``"heads"`` (``[B, H, T, S]``,
        fairseq's; needs ``num_kv_heads == num_heads``). The two give the same attention up to
        float rounding; each model keeps the one its runs and checkpoints were made with, so
        its numbers stay bit for bit what they were.
    """

    emb_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    names: tuple[str, str, str, str] = HF_NAMES
    qkv_bias: bool = True
    out_bias: bool = True
    dropout: float | None = None
    implementation: str = "einsum"
    masks_are_lengths: bool = False
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sinks: bool = False
    output_gate: bool = False
    einsum_layout: str = "grouped"


def _grouped_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
    """``x`` broadcastable to ``[B, H, T, S]`` (a mask, a bias, the sinks) as
    ``[B, KV, G, T, S]``: query head ``h = k * G + g``, as ``repeat_kv`` lays them out; a
    head axis of 1 stays broadcast."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], num_kv_heads, x.shape[1] // num_kv_heads, *x.shape[2:])


class Attention(nnx.Module):
    """Multi-head attention with grouped query heads, softmax in float32 at scale
    ``head_dim^-0.5``.

    Args:
      options: :class:`AttentionOptions`.
      qkv_linear, out_linear: build the q/k/v projections and the output projection (each
        model's initialisation and compute dtype); drawn in the order query, key, value, output.
      norm: builds a q/k norm over a given width (needed where ``options.qk_norm`` is not
        ``"none"``).
      sinks_init: draws the sink logits ``[num_heads]`` (needed where ``options.sinks``),
        after the projections.
      rngs: ``params`` for the projections and sinks; ``dropout`` where ``options.dropout`` is
        not None (its dropout layer is built last).
      mesh: the ``("data", "fsdp", "expert")`` mesh the rows are split over, or None; splash
        attention runs on each device's rows (:func:`~sparsemixer_jax.kernels.splash_attention.
        splash_heads`).

    Use: ``q, k, v = attn.qkv(x)`` (or :meth:`project_q` and :meth:`project_kv` of another
    sequence, for cross-attention and cached keys), then ``attn.attend(q, k, v, mask)``;
    ``attn(x, memory, mask)`` does both.
    """

    def __init__(self, options: AttentionOptions, *, qkv_linear: MakeLinear,
                 out_linear: MakeLinear, norm: Callable[[int], nnx.Module] | None = None,
                 sinks_init: nnx.initializers.Initializer | None = None, rngs: nnx.Rngs,
                 mesh: jax.sharding.Mesh | None = None):
        o = options
        if o.num_heads % o.num_kv_heads:
            raise ValueError(f"num_heads={o.num_heads} is not divisible by "
                             f"num_kv_heads={o.num_kv_heads}")
        check_attention_impl(o.implementation, o.dropout or 0.0)
        if o.einsum_layout not in ("grouped", "heads") or (
                o.einsum_layout == "heads" and o.num_kv_heads != o.num_heads):
            raise ValueError(f"einsum_layout={o.einsum_layout!r} with {o.num_heads} query and "
                             f"{o.num_kv_heads} key/value heads; 'heads' needs them equal")
        if (o.qk_norm != "none" and norm is None) or (o.sinks and sinks_init is None):
            raise ValueError(f"qk_norm={o.qk_norm!r}, sinks={o.sinks}: Attention needs norm "
                             "for a q/k norm and sinks_init for sink logits")
        taken = [name for name in o.names if hasattr(type(self), name)]
        if taken:
            raise ValueError(f"projection names {taken} are Attention's own attributes")
        self.options = o
        q_name, k_name, v_name, out_name = o.names
        # Set by name: each model keeps its checkpoints' parameter paths.
        if o.output_gate and o.qk_norm == "full":
            raise ValueError("output_gate takes a per-head q/k norm or none, not qk_norm='full'")
        setattr(self, q_name, qkv_linear(o.emb_dim, o.num_heads * o.head_dim * (1 + o.output_gate),
                                         use_bias=o.qkv_bias))
        for name in (k_name, v_name):
            setattr(self, name,
                    qkv_linear(o.emb_dim, o.num_kv_heads * o.head_dim, use_bias=o.qkv_bias))
        setattr(self, out_name,
                out_linear(o.num_heads * o.head_dim, o.emb_dim, use_bias=o.out_bias))
        if o.qk_norm != "none":
            per_head = o.qk_norm == "head"
            self.q_norm = norm(o.head_dim if per_head else o.num_heads * o.head_dim)
            self.k_norm = norm(o.head_dim if per_head else o.num_kv_heads * o.head_dim)
        self.sinks = nnx.Param(sinks_init(rngs.params(), (o.num_heads,), jnp.float32)) \
            if o.sinks else None
        self.dropout = nnx.Dropout(o.dropout, rngs=rngs) if o.dropout is not None else None
        self.mesh = mesh

    @property
    def implementation(self) -> str:
        """The key of :data:`ATTENTION_IMPLS` this attention runs."""
        return self.options.implementation

    def _projection(self, which: int) -> nnx.Linear:
        return getattr(self, self.options.names[which])

    def _heads(self, x: jax.Array, heads: int) -> jax.Array:
        return x.reshape(*x.shape[:-1], heads, self.options.head_dim)

    def _clip(self, x: jax.Array) -> jax.Array:
        c = self.options.clip_qkv
        return x if c is None else jnp.clip(x, -c, c)

    def project_q(self, x: jax.Array, cos: jax.Array | None = None,
                  sin: jax.Array | None = None) -> jax.Array:
        """Queries ``[B, T, H, D]`` of ``x [B, T, emb]``, rotated by ``cos, sin``
        (:func:`~sparsemixer_jax.layers.rope.apply_rope`) when given."""
        return self.project_q_and_gate(x, cos, sin)[0]

    def project_q_and_gate(self, x: jax.Array, cos: jax.Array | None = None,
                           sin: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """:meth:`project_q`'s queries and, with ``output_gate``, the gate ``[B, T, H * D]``
        that :meth:`attend` takes (None without)."""
        q, gate = self._projection(0)(x), None
        if self.options.output_gate:  # per head: its query, then its gate
            q, gate = jnp.split(q.reshape(*q.shape[:-1], self.options.num_heads, -1), 2, axis=-1)
            q, gate = q.reshape(*q.shape[:-2], -1), gate.reshape(*gate.shape[:-2], -1)
        if self.options.qk_norm == "full":
            q = self.q_norm(q)
        q = self._heads(self._clip(q), self.options.num_heads)
        if self.options.qk_norm == "head":
            q = self.q_norm(q)
        return (q if cos is None else apply_rope(q, cos, sin)), gate

    def project_kv(self, x: jax.Array, cos: jax.Array | None = None,
                   sin: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Keys and values of ``x [B, S, emb]``: each ``[B, S, KV, D]`` in the compute dtype,
        the keys rotated by ``cos, sin`` when given."""
        o = self.options
        k, v = self._projection(1)(x), self._projection(2)(x)
        if o.qk_norm == "full":
            k = self.k_norm(k)
        k, v = self._heads(self._clip(k), o.num_kv_heads), self._heads(self._clip(v),
                                                                        o.num_kv_heads)
        if o.qk_norm == "head":
            k = self.k_norm(k)
        return (k if cos is None else apply_rope(k, cos, sin)), v

    def qkv(self, x: jax.Array, cos: jax.Array | None = None, sin: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B, T, H, D]``, keys and values ``[B, T, KV, D]`` of ``x [B, T, emb]``
        (:meth:`project_q`, :meth:`project_kv`)."""
        return (self.project_q(x, cos, sin), *self.project_kv(x, cos, sin))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
               causal: bool = False, bias: jax.Array | None = None,
               deterministic: bool = True, fused: FusedMask | None = None,
               gate: jax.Array | None = None) -> jax.Array:
        """``q [B, T, H, D]`` over ``k, v [B, S, KV, D]``: the output projection of the heads,
        ``[B, T, emb]``.

        ``mask`` is bool, broadcastable to ``[B, H, T, S]``, True where a query may attend to a
        key. ``bias`` (float32, broadcastable to ``[B, H, T, S]``, e.g. T5's relative position
        bias ``[1, H, T, S]``) is added to the scaled logits before masking. ``causal``: the mask
        hides every key after its query (a full forward pass), which lets cuDNN skip those
        blocks; the mask is applied either way. ``deterministic``: no dropout on the weights.
        ``fused``: how cuDNN or splash may take a causal ``mask`` without reading it
        (:class:`FusedMask`; the other implementations ignore it). Splash attention runs where
        ``fused`` describes the mask, with no ``bias`` and no sinks, and the lengths are
        multiples of 128; the einsum attention everywhere else (cached decoding, windows).
        ``gate``: :meth:`project_q_and_gate`'s, multiplying the heads by its sigmoid.
        """
        o = self.options
        b, t, h, d = q.shape
        if o.implementation == "splash":
            if causal and fused is not None and bias is None and self.sinks is None \
                    and splash_block(t, k.shape[1]) is not None:
                heads = splash_heads(q, k, v, segment_ids=fused.segment_ids,
                                     token_mask=fused.token_mask, mesh=self.mesh)
                return self._output(heads.reshape(b, t, h * d), gate)
        elif o.implementation != "einsum":
            heads = self._fused(q, k, v, mask, causal, bias, fused)
            return self._output(heads.reshape(b, t, h * d), gate)
        # The grouped layout keeps its logits as [B, KV, G, T, S] throughout (mask, bias and
        # sinks are brought to it, not the logits to [B, H, T, S]): a reshape between the two
        # einsums changes how XLA orders the backward pass's sums, and so the last bits of a
        # language model's training.
        grouped = o.einsum_layout == "grouped"
        to_layout = (lambda a: _grouped_heads(a, o.num_kv_heads)) if grouped else (lambda a: a)
        if grouped:
            q = q.reshape(b, t, o.num_kv_heads, h // o.num_kv_heads, d) * jnp.asarray(
                d**-0.5, q.dtype)
            logits = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bthd,bshd->bhts", q * jnp.asarray(d**-0.5, q.dtype),
                                k.astype(q.dtype), preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + to_layout(bias)
        logits = jnp.where(to_layout(mask), logits, MASK_VALUE)
        if self.sinks is not None:  # one more logit per head, in the denominator only
            sinks = to_layout(self.sinks[...].reshape(1, h, 1, 1))
            sinks = jnp.broadcast_to(sinks, (*logits.shape[:-1], 1))
            weights = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
        else:
            weights = jax.nn.softmax(logits, axis=-1)
        if self.dropout is not None:
            weights = self.dropout(weights, deterministic=deterministic)
        weights = weights.astype(v.dtype)
        if grouped:
            heads = jnp.einsum("bkgts,bskd->btkgd", weights, v)
        else:
            heads = jnp.einsum("bhts,bshd->bthd", weights, v)
        return self._output(heads.reshape(b, t, h * d), gate)

    def _output(self, heads: jax.Array, gate: jax.Array | None) -> jax.Array:
        """The output projection of ``heads [B, T, H * D]``, gated by ``sigmoid(gate)``."""
        if gate is not None:
            heads = heads * jax.nn.sigmoid(gate).astype(heads.dtype)
        return self._projection(3)(heads)

    def _fused(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal: bool,
               bias: jax.Array | None, fused: FusedMask | None = None) -> jax.Array:
        """The heads ``[B, T, H, D]`` by ``jax.nn.dot_product_attention``: no dropout on the
        weights (:func:`check_attention_impl`), no sinks, softmax in float32 inside the kernel
        or XLA's reference, the same scale and mask; query heads grouped as ``repeat_kv``."""
        b, t = q.shape[:2]
        implementation = ATTENTION_IMPLS[self.options.implementation]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        scale = q.shape[-1]**-0.5
        if implementation == "cudnn" and causal and fused is not None and bias is None:
            if fused.exactly_causal:
                return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                    implementation="cudnn")
            if fused.segments is not None:
                # No fallback to the mask for rows the layout cannot hold: a branch taking it
                # would keep the [B, 1, T, T] bias in the program. The language model makes
                # its logits NaN there instead, and the data refuses such rows before a run.
                sharded = self.mesh is not None and self.mesh.size > 1
                return packed_attention(q, k, v, fused.segments, scale, sharded=sharded)
        kwargs = {}
        if implementation == "cudnn" and self.options.masks_are_lengths:
            lengths, is_causal = mask_as_lengths(mask, b, t)
            kwargs = {"key_value_seq_lengths": lengths, "is_causal": is_causal}
        else:
            # cuDNN turns the boolean mask (padding, packed documents, a sliding window) into a
            # constant additive bias, with no gradient computed for it. Cached decoding (a few
            # queries against the whole cache) takes XLA's form: flash attention is for long
            # queries.
            if implementation == "cudnn" and not causal:
                implementation = "xla"
            kwargs = {"mask": jnp.broadcast_to(mask, (b, *mask.shape[1:-2], t, k.shape[1])),
                      "is_causal": implementation == "cudnn"}
        if bias is not None:
            kwargs["bias"] = bias.astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation,
                                            **kwargs)

    def __call__(self, x: jax.Array, memory: jax.Array, mask: jax.Array, *,
                 deterministic: bool, bias: jax.Array | None = None) -> jax.Array:
        """Queries of ``x [B, T, emb]`` attend to keys and values of ``memory [B, S, emb]``
        (``memory`` is ``x`` for self-attention); ``mask`` and ``bias`` as :meth:`attend`'s.
        Returns ``[B, T, emb]``."""
        k, v = self.project_kv(memory)
        return self.attend(self.project_q(x), k, v, mask, bias=bias, deterministic=deterministic)


class KVCache(NamedTuple):
    """Keys and values of every attention layer for cached decoding (a pytree).

    Attributes:
      keys, values: one array per cached layer, in model order: ``[B, S, KV, D]`` per decoder
        layer (the translation Transformer), or ``[repeats, B, S, KV, D]`` per layer of a
        scanned stack (the language models), in the compute dtype; rotary positions are
        applied to the keys already. Latent attention caches its normed latent as the keys and
        its rotated shared key as the values
        (:attr:`~sparsemixer_jax.models.lm_config.LMArchitecture.cache_shapes`).
      index: int32 scalar, the number of slots written (shared by the whole batch).
      valid: bool ``[B, S]``, slots that hold a real token (False: not yet written, or left
        padding of a prompt).
      positions: int32 ``[B]``, the position the next token takes in each row.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    index: jax.Array
    valid: jax.Array
    positions: jax.Array

    @classmethod
    def empty(cls, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...], batch_size: int,
              max_len: int) -> KVCache:
        """A cache of ``max_len`` slots with nothing written, holding ``keys`` and ``values``
        (zeros of each layer's shape)."""
        return cls(keys, values, jnp.zeros((), jnp.int32), jnp.zeros((batch_size, max_len), bool),
                   jnp.zeros((batch_size,), jnp.int32))

    def valid_after(self, real: jax.Array) -> jax.Array:
        """:attr:`valid` once ``real`` (bool ``[B, T]``, the new tokens' token mask) is written
        at slots ``index ..``: bool ``[B, S]``."""
        return jax.lax.dynamic_update_slice_in_dim(self.valid, real, self.index, 1)

    def advanced(self, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...],
                 real: jax.Array) -> KVCache:
        """The cache after writing ``T`` new tokens (``real``: their token mask ``[B, T]``),
        holding ``keys`` and ``values`` (each layer's, with the new slots written)."""
        return KVCache(keys, values, self.index + real.shape[1], self.valid_after(real),
                       self.positions + jnp.sum(real, axis=1, dtype=jnp.int32))


def write_slots(cached: jax.Array, new: jax.Array, index: jax.Array, axis: int = 1) -> jax.Array:
    """``cached`` with ``new`` written at slot ``index`` along ``axis`` (cast to its dtype)."""
    return jax.lax.dynamic_update_slice_in_dim(cached, new.astype(cached.dtype), index, axis)
