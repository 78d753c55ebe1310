"""A decoder-only MoE language model (Flax NNX): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
Phi-3.5-MoE, GLM-4.5, gpt-oss, DeepSeek-V3 and the Gated DeltaNet hybrids Qwen3-Next and
Qwen3.5-MoE in one implementation, configured by
:class:`sparsemixer_jax.models.lm_config.LMConfig`.

Each block is pre-norm: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``, where ``attn`` is
grouped-query attention with rotary positions (optional q/k norms, biases, value clipping,
sliding window on every or some layers, sink logits), or DeepSeek-V3's multi-head latent
attention (:mod:`sparsemixer_jax.models.latent_attention`), and ``ffn`` is the project's
:class:`sparsemixer_jax.moe.MoEFeedForward` with gated SwiGLU experts (plus a shared expert) or
a dense SwiGLU MLP.

Layers are scanned: the layers are grouped into stacks of a repeating unit
(:func:`sparsemixer_jax.models.layer_stacks.layer_pattern_stacks`), each stack's parameters carry a
leading ``repeats`` axis, and :func:`jax.lax.scan` runs it, so compile time does not grow with
depth. Parameters are float32; ``compute_dtype`` sets the matmuls' dtype (norm statistics,
softmax, routing and the logits in float32).

Modes: the model is built in training mode (routers sample, jitter applies); flax's
``model.eval()`` sets ``deterministic`` and makes every call deterministic (routing by the
router's evaluation rule). :func:`sparsemixer_jax.hf.load_pretrained` returns it in eval mode.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparsemixer_jax.layers.attention import (
    HF_NAMES,
    Attention,
    AttentionOptions,
    FusedMask,
    KVCache,
    write_slots,
)
from sparsemixer_jax.layers.gated_deltanet import DeltaNetCache, GatedDeltaNet
from sparsemixer_jax.layers.linear import linear, linear_maker
from sparsemixer_jax.layers.norms import LayerNorm, RMSNorm
from sparsemixer_jax.layers.packed_attention import check_rows_fit, segment_layout
from sparsemixer_jax.layers.rope import rope_cos_sin
from sparsemixer_jax.models.latent_attention import LatentAttention
from sparsemixer_jax.models.layer_stacks import LayerKind, layer_pattern_stacks
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.models.lm_routes import check_routes, gathered_routes, stack_routes
from sparsemixer_jax.moe import MoEFeedForward
from sparsemixer_jax.moe.shared import SharedExperts
from sparsemixer_jax.packed_tree import PackedTree
from sparsemixer_jax.parallel import sharding


class LMOutput(NamedTuple):
    """What :meth:`CausalLM.forward` returns.

    Attributes:
      logits: float32 ``[B, T, V]``.
      cache: the updated :class:`KVCache`, or None when none was given.
      aux: float32 scalars summed over the MoE layers, ``balance_loss`` and ``z_loss``, and
        ``moe``: each MoE layer's metrics (:meth:`MoEFeedForward.__call__`: loads, router
        diagnostics) under ``"layer_{i}"``, ``i`` the layer's index in the model.
      routes: int32 ``[B, T, L, K]``: the experts each token was routed to in each of the
        ``L`` MoE layers (layer order), ``-1`` on padding
        (:mod:`~sparsemixer_jax.models.lm_routes`).
    """

    logits: jax.Array
    cache: KVCache | None
    aux: dict[str, jax.Array]
    routes: jax.Array


def _dtype(config: LMConfig) -> jnp.dtype:
    return jnp.dtype(config.execution.compute_dtype)


def make_norm(config: LMConfig, dim: int | None = None) -> RMSNorm | LayerNorm:
    dim = dim or config.arch.hidden_size
    if config.arch.norm == "layer":
        return LayerNorm(dim, config.arch.norm_eps, _dtype(config))
    return RMSNorm(dim, config.arch.norm_eps, _dtype(config),
                   zero_centred=config.arch.norm == "zero_centred_rms")


def make_attention(config: LMConfig, rngs: nnx.Rngs,
                   mesh: jax.sharding.Mesh | None = None) -> Attention:
    """Grouped-query self-attention as the Hugging Face types compute it (params ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``, as their checkpoints name them): projections drawn as
    :func:`linear` draws (biases per config), q/k norms (per head or over the whole
    projection), value clipping, rotary positions (given to :meth:`Attention.qkv`), with a
    learned sink logit per head in its softmax's denominator where the config has
    ``attention_sinks``. ``mesh``: the mesh the rows are split over (splash attention runs on
    each device's rows)."""
    arch = config.arch
    options = AttentionOptions(
        arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, names=HF_NAMES,
        qkv_bias=arch.qkv_bias, out_bias=arch.out_bias,
        implementation=config.execution.attention_impl,
        qk_norm="none" if arch.qk_norm == "l2" else arch.qk_norm,  # l2: the layer's (no weight)
        clip_qkv=arch.clip_qkv, sinks=arch.attention_sinks, output_gate=arch.attention_output_gate)
    make = linear_maker(config, rngs)
    zero_centred = arch.norm == "zero_centred_rms"  # the q/k norms are the model's kind
    return Attention(options, qkv_linear=make, out_linear=make,
                     norm=lambda dim: RMSNorm(dim, arch.norm_eps, _dtype(config), zero_centred),
                     sinks_init=nnx.initializers.normal(config.arch.initializer_range), rngs=rngs,
                     mesh=mesh)


class GatedMLP(nnx.Module):
    """The dense SwiGLU MLP ``down(silu(gate(x)) * up(x))`` without biases."""

    def __init__(self, config: LMConfig, width: int, rngs: nnx.Rngs):
        e = config.arch.hidden_size
        self.gate_proj = linear(e, width, False, config, rngs)
        self.up_proj = linear(e, width, False, config, rngs)
        self.down_proj = linear(width, e, False, config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nnx.Module):
    """The routed sublayer: :class:`MoEFeedForward` of the config's sections
    (:meth:`~sparsemixer_jax.models.lm_config.LMConfig.moe_sections`: gated experts, the type's
    router bias, expert biases and selection bias, input jitter, initialised as the Hugging
    Face types are), and the type's shared experts
    (:class:`~sparsemixer_jax.moe.shared.SharedExperts`: one SwiGLU MLP of width
    ``shared_expert_size``, times Qwen2-MoE's gate ``sigmoid(x w_g)`` where the config has
    one, drawn as :func:`linear` draws) added to the routed output on every token, padding
    too, as transformers adds them. No type has both shared experts and input jitter; the
    shared experts take the sublayer's input as it is."""

    def __init__(self, config: LMConfig, mesh: jax.sharding.Mesh | None, rngs: nnx.Rngs):
        moe, router = config.moe_sections()
        self.moe = MoEFeedForward((config.arch.hidden_size, config.arch.moe_intermediate_size), moe,
                                  router, dtype=_dtype(config), mesh=mesh, rngs=rngs)
        make = linear_maker(config, rngs)
        self.shared_experts = SharedExperts(
            config.arch.hidden_size, config.shared_expert_size, gated=True, activation="silu",
            linear=make, gate_linear=make if config.shared_expert_gate else None,
        ) if config.shared_expert_size else None

    def __call__(self, x: jax.Array, token_mask: jax.Array | None, deterministic: bool,
                 dropless: bool, routes: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """``x [B, T, emb]`` -> ``([B, T, emb], metrics)``, the selection made under
        ``metrics["routes"]``; ``routes [B, T, K]`` replays given experts."""
        y, metrics = self.moe(x, token_mask, deterministic=deterministic, dropless=dropless,
                              routes=routes, record_routes=True)
        if self.shared_experts is not None:  # on every token, padding too, as transformers'
            y = y + self.shared_experts(x).astype(y.dtype)
        return y, metrics


class DecoderLayer(nnx.Module):
    """One pre-norm block: attention (or, in a hybrid's linear layers, Gated DeltaNet), then
    the routed or dense feed-forward sublayer."""

    def __init__(self, config: LMConfig, kind: LayerKind, mesh, rngs: nnx.Rngs):
        self.input_layernorm = make_norm(config)
        self.linear = kind.linear
        if kind.linear:
            self.linear_attn = GatedDeltaNet(
                config.arch.deltanet(config.execution.compute_dtype), rngs)
        else:
            self.self_attn = LatentAttention(config, rngs) if config.arch.kv_lora_rank \
                else make_attention(config, rngs, mesh)
        self.post_attention_layernorm = make_norm(config)
        self.l2_eps = config.arch.norm_eps if config.arch.qk_norm == "l2" else None
        self.is_moe = is_moe = kind.moe
        if is_moe:
            self.mlp = MoEBlock(config, mesh, rngs)
        else:
            self.mlp = GatedMLP(config, config.arch.intermediate_size, rngs)

    def _mix(self, h, cos, sin, mask, kv, token_mask, fused, rope_on, temperature):
        """The token-mixing sublayer on the normed ``h [B, T, emb]`` (arguments as
        :meth:`__call__`'s): ``(y [B, T, emb], the layer's new cache entries or None)``."""
        if self.linear:  # its cache entries: the convolution's last inputs and the state
            segment_ids = None
            if kv is None:  # a token that may not see the one before starts a new document
                follows = jnp.diagonal(mask, offset=-1, axis1=1, axis2=2)
                segment_ids = jnp.cumsum(jnp.pad(~follows, ((0, 0), (1, 0))), axis=1)
            y, out = self.linear_attn(h, segment_ids=segment_ids, token_mask=token_mask,
                                      cache=None if kv is None else DeltaNetCache(*kv[:2]))
            return y, None if kv is None else tuple(out)
        if rope_on is not None:  # the identity rotation where the layer has no rotary positions
            cos, sin = jnp.where(rope_on, cos, 1.0), jnp.where(rope_on, sin, 0.0)
        gate = None
        if isinstance(self.self_attn, Attention) and self.self_attn.options.output_gate:
            q, gate = self.self_attn.project_q_and_gate(h, cos, sin)
            k, v = self.self_attn.project_kv(h, cos, sin)
        else:
            q, k, v = self.self_attn.qkv(h, cos, sin)
        on = True if rope_on is None else rope_on
        if self.l2_eps is not None:  # Llama 4: each rotated head over its root mean square
            q, k = (jnp.where(on, _l2_normed(a, self.l2_eps), a) for a in (q, k))
        if temperature is not None:
            q = q * jnp.where(on, 1.0, temperature)[:, :, None, None].astype(q.dtype)
        new_kv = None
        if kv is not None:
            keys, values, index = kv
            keys, values = write_slots(keys, k, index), write_slots(values, v, index)
            k, v, new_kv = keys, values, (keys, values)
        # Without a cache the mask is causal over the T new tokens (forward's mask).
        attend = {} if fused is None else {"fused": fused}  # latent attention takes none
        if gate is not None:
            attend["gate"] = gate
        return self.self_attn.attend(q, k, v, mask[:, None], causal=kv is None, **attend), new_kv

    def __call__(self, x, cos, sin, mask, kv, token_mask, deterministic, dropless, fused=None,
                 routes=None, rope_on=None, temperature=None):
        """``x [B, T, emb]``; ``kv``: this layer's cache ``(keys, values, index)`` or None;
        ``fused``: how cuDNN may take ``mask``
        (:class:`~sparsemixer_jax.layers.attention.FusedMask`); ``routes [B, T, K]``: the
        experts an MoE layer replays; ``rope_on``: bool scalar, whether this layer rotates
        (None: it does); ``temperature [B, T]``: the scale of the queries of a layer that does
        not (Llama 4), or None.

        Returns ``(x, (keys, values) or None, (balance_loss, z_loss))``."""
        y, new_kv = self._mix(self.input_layernorm(x), cos, sin, mask, kv, token_mask, fused,
                              rope_on, temperature)
        x = x + y.astype(x.dtype)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            y, metrics = self.mlp(h, token_mask, deterministic, dropless, routes)
        else:
            y, metrics = self.mlp(h), {}
        return x + y.astype(x.dtype), new_kv, metrics


def _l2_normed(x: jax.Array, eps: float) -> jax.Array:
    """``x [..., D]`` divided by its root mean square over ``D`` (in float32), no weight."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class LayerUnit(nnx.Module):
    """The repeating unit of a stack: one or more :class:`DecoderLayer` in order."""

    def __init__(self, config: LMConfig, pattern: tuple[LayerKind, ...], mesh, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, kind, mesh, rngs) for kind in pattern])


def _make_stack(config: LMConfig, pattern: tuple[LayerKind, ...], repeats: int, mesh,
                rngs: nnx.Rngs) -> LayerUnit:
    """``repeats`` copies of the unit ``pattern``, their params stacked on a leading axis (each
    drawn from its own split of ``rngs``)."""
    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> LayerUnit:
        return LayerUnit(config, pattern, mesh, rngs)

    return make(rngs)


def _scan_stack(stack: LayerUnit, x, kvs, index, cos, sin, masks, sliding, token_mask,
                deterministic, dropless, remat: str = "none", rows_sharding=None, fused=None,
                routes=None, rope_on=None, temperature=None):
    """Runs a stack (a :class:`LayerUnit` whose state has a leading ``repeats`` axis) with
    ``jax.lax.scan``: each step merges one repeat's state, runs its layers, and returns the
    state again (router RNG counts and Default MoE's vectors change in training). ``masks``:
    the attention masks ``(full, sliding window)``; a layer takes the second where ``sliding``
    (bool ``[repeats, unit layers]``) says, the first everywhere when it is None. ``remat``:
    :data:`~sparsemixer_jax.models.lm_config.REMAT_POLICIES`, applied to the step.
    ``rows_sharding``: the sharding each step's activations keep
    (:func:`sparsemixer_jax.parallel.sharding.keep_rows_split`). ``fused``: how cuDNN may take the
    mask
    (:class:`~sparsemixer_jax.layers.attention.FusedMask`; None where there is a window).
    ``routes``: int32 ``[repeats, MoE layers of the unit, B, T, K]``, the experts they replay
    (:func:`~sparsemixer_jax.models.lm_routes.stack_routes`), or None. ``rope_on``: bool
    ``[repeats, unit layers]``, which layers rotate (None: all); ``temperature``: as
    :meth:`DecoderLayer.__call__` takes it.
    """
    graphdef, state = nnx.split(stack)

    def body(h, xs):
        h = sharding.keep_rows_split(h, rows_sharding)
        unit_state, unit_kvs, unit_sliding, unit_routes, unit_rope = xs
        unit = nnx.merge(graphdef, unit_state)
        new_kvs, metrics = [], []
        moe_slot = 0  # the unit's MoE layers take unit_routes in order
        for i, layer in enumerate(unit.layers):
            kv = None if unit_kvs is None else (*unit_kvs[i], index)
            mask = masks[0] if unit_sliding is None else \
                jnp.where(unit_sliding[i], masks[1], masks[0])
            layer_routes = None
            if unit_routes is not None and layer.is_moe:
                layer_routes, moe_slot = unit_routes[moe_slot], moe_slot + 1
            h, new_kv, layer_metrics = layer(
                h, cos, sin, mask, kv, token_mask, deterministic, dropless, fused, layer_routes,
                None if unit_rope is None else unit_rope[i], temperature)
            new_kvs.append(new_kv)
            metrics.append(layer_metrics)
        out_kvs = None if unit_kvs is None else tuple(new_kvs)
        # Every float32 metric in one vector per step: the scan writes one stacked output
        # instead of one small kernel per metric and layer.
        return h, (nnx.state(unit), out_kvs, PackedTree.pack(metrics))

    if remat != "none":
        # The backward pass recomputes the layer body (keeping what the policy names) instead of
        # holding its activations for every layer; prevent_cse is unneeded inside scan.
        policy = {"full": None, "elementwise": recompute_elementwise}.get(
            remat, getattr(jax.checkpoint_policies, remat, None))
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, (new_state, new_kvs, metrics) = jax.lax.scan(body, x, (state, kvs, sliding, routes,
                                                              rope_on))
    nnx.update(stack, new_state)
    return x, new_kvs, metrics.unpack()


# What remat="elementwise" recomputes: elementwise arithmetic, casts and layout changes, which
# XLA fuses into the kernels of the backward pass that read them, so recomputing them costs no
# launches and reads their (saved) inputs instead of a saved copy (bfloat16 activations instead
# of their float32 casts, one hidden array instead of its halves and products).
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "clamp", "concatenate", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expand_dims", "ge", "gt",
    "integer_pow", "iota", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "not", "or", "pad", "pow", "reshape", "rsqrt", "select_n", "sign", "sin", "slice",
    "sqrt", "square", "squeeze", "sub", "tanh", "transpose"})


def recompute_elementwise(primitive, *_, **__) -> bool:
    """The checkpoint policy of ``remat="elementwise"``: keep the output of every operation but
    elementwise and layout ones (matmuls, attention and grouped kernels, reductions, gathers,
    sorts, random bits are kept)."""
    return primitive.name not in _ELEMENTWISE


def _positions_and_masks(config: LMConfig, real: jax.Array, positions: jax.Array | None,
                         segment_ids: jax.Array | None, cache: KVCache | None
                         ) -> tuple[jax.Array, tuple[jax.Array, jax.Array | None]]:
    """The rotary positions and attention masks of a forward pass of ``real [B, T]`` (its
    token mask; the other arguments as :meth:`CausalLM.forward`'s).

    Returns ``(positions [B, T], (mask, window))``: bool ``[B, T, S]`` masks, causal over
    slots and real keys only (and within a segment; ``S = T`` without a cache, the cache's
    length with one); ``window`` where some layers take a sliding window and others not (None
    otherwise: with a window on every layer, ``mask`` has it)."""
    b, t = real.shape
    q_slot = jnp.arange(t)
    if cache is None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        k_slot, k_real = q_slot, real
    else:
        if positions is None:
            positions = cache.positions[:, None] + jnp.cumsum(real, axis=1) - 1
            positions = jnp.maximum(positions, 0)
        q_slot = cache.index + q_slot
        k_slot = jnp.arange(cache.valid.shape[1])
        k_real = cache.valid_after(real)
    # Causal over slots (queries see their own and earlier slots), real keys only.
    mask = (k_slot[None, None, :] <= q_slot[None, :, None]) & k_real[:, None, :]
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids (packed sequences) are for full forward passes, "
                             "not for cached decoding")
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    chunk = config.arch.attention_chunk_size
    if chunk is not None:  # Llama 4: keys of the query's own chunk of positions
        k_pos = positions if cache is None else jnp.cumsum(k_real, axis=1) - 1
        local = mask & (positions[:, :, None] // chunk == k_pos[:, None, :] // chunk)
        return positions, (mask, local) if config.arch.sliding_layers else (local, None)
    if config.arch.sliding_window is None:
        return positions, (mask, None)
    # A key at most sliding_window - 1 positions back (transformers' sliding overlay); left
    # padding holds no real key, so slot distance equals position distance.
    window = mask & ((q_slot[None, :, None] - k_slot[None, None, :]) < config.arch.sliding_window)
    return positions, (mask, window) if config.arch.sliding_layers else (window, None)


def _fused_mask(config: LMConfig, token_mask: jax.Array | None, segment_ids: jax.Array | None,
                cache: KVCache | None) -> FusedMask | None:
    """How cuDNN's or splash attention may take the mask of :func:`_positions_and_masks`
    (arguments as :meth:`CausalLM.forward`'s), in a full pass without a window: cuDNN its
    causal flag alone where the mask is exactly causal (no segment ids, no padding as far as is
    known when tracing), the segments' offsets where the execution section's
    ``cudnn_document_mask`` says so; splash the segment ids and the padding. None (the mask)
    otherwise and for the other implementations, which read the mask as it is."""
    run = config.execution
    if run.attention_impl not in ("cudnn", "splash") or cache is not None \
            or config.arch.sliding_window is not None \
            or config.arch.attention_chunk_size is not None:
        return None
    all_real = token_mask is None or (not isinstance(token_mask, jax.core.Tracer)
                                      and bool(np.all(np.asarray(token_mask))))
    if run.attention_impl == "splash":
        return FusedMask(exactly_causal=segment_ids is None and all_real,
                         segment_ids=segment_ids, token_mask=None if all_real else token_mask)
    if segment_ids is None:
        return FusedMask(exactly_causal=True) if all_real else None
    if run.cudnn_document_mask != "offsets":
        return None
    real = jnp.ones(segment_ids.shape, bool) if token_mask is None else token_mask
    if not isinstance(segment_ids, jax.core.Tracer) and not isinstance(real, jax.core.Tracer):
        check_rows_fit(segment_ids, real, run.max_segments_per_row, "segment_ids")
    widths = (config.arch.num_heads * config.arch.head_dim,
              config.arch.num_kv_heads * config.arch.head_dim)
    return FusedMask(segments=segment_layout(segment_ids, real, run.max_segments_per_row,
                                             widths))


def _summed_moe_aux(moe: dict[str, dict]) -> dict[str, Any]:
    """:attr:`LMOutput.aux` of the MoE layers' metrics ``{"layer_{i}": metrics}``."""
    zero = jnp.zeros((), jnp.float32)
    return {"balance_loss": sum((m["balance_loss"] for m in moe.values()), zero),
            "z_loss": sum((m["z_loss"] for m in moe.values()), zero),
            "moe": dict(sorted(moe.items(), key=lambda kv: int(kv[0][6:])))}


class CausalLM(nnx.Module):
    """The decoder-only MoE language model.

    Args:
      config: :class:`sparsemixer_jax.models.lm_config.LMConfig`.
      mesh: optional ``("data", "expert")`` mesh: the MoE layers' experts are split over its
        expert axis (:mod:`sparsemixer_jax.moe.expert_parallel`).
      rngs: ``params`` for the initialisation (normal with ``initializer_range``, as each type's
        own), ``router`` for the routers' sampling and the MoE input jitter in training.

    Params: ``embed_tokens`` ``[V, emb]``, ``stacks`` (per stack a :class:`LayerUnit` with a
    leading ``repeats`` axis), ``norm``, ``lm_head`` (absent when the embeddings are tied).
    """

    def __init__(self, config: LMConfig, *, mesh: jax.sharding.Mesh | None = None,
                 rngs: nnx.Rngs):
        self.config = config
        self.deterministic = False
        # Activations split by rows over every mesh axis, as the batch arrives.
        self.rows_sharding = sharding.rows_sharding(mesh)
        self.embed_tokens = nnx.Embed(
            config.arch.vocab_size, config.arch.hidden_size, dtype=_dtype(config),
            param_dtype=jnp.float32,
            embedding_init=nnx.initializers.normal(config.arch.initializer_range), rngs=rngs)
        self.stack_patterns = layer_pattern_stacks(config.arch.layer_kinds)
        self.stacks = nnx.List([_make_stack(config, pattern, repeats, mesh, rngs)
                                for pattern, repeats in self.stack_patterns])
        self.norm = make_norm(config)
        self.lm_head = None if config.arch.tie_word_embeddings else linear(
            config.arch.hidden_size, config.arch.vocab_size, config.arch.lm_head_bias, config, rngs)

    @staticmethod
    def layer_index_of(config: LMConfig) -> list[tuple[int, int, int]]:
        """For every model layer in order, ``(stack, repeat, position in the unit)``."""
        return [(s, r, i) for s, (pattern, repeats) in
                enumerate(layer_pattern_stacks(config.arch.layer_kinds))
                for r in range(repeats) for i in range(len(pattern))]

    def layer_index(self) -> list[tuple[int, int, int]]:
        """:meth:`layer_index_of` this model's config."""
        return self.layer_index_of(self.config)

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` of ``max_len`` slots. A Gated DeltaNet layer's keys and
        values are its :class:`~sparsemixer_jax.layers.gated_deltanet.DeltaNetCache`: the
        convolution's last inputs and the float32 state (no slot per token)."""
        c, dtype = self.config, _dtype(self.config)
        key_shape, value_shape = c.arch.cache_shapes
        linear = DeltaNetCache.empty(c.arch.deltanet(c.execution.compute_dtype), batch_size) \
            if any(c.arch.linear_layers) else None

        def slots(shape: tuple[int, int], which: int) -> tuple[jax.Array, ...]:
            return tuple(
                jnp.broadcast_to(linear[which], (repeats, *linear[which].shape)) if kind.linear
                else jnp.zeros((repeats, batch_size, max_len, *shape), dtype)
                for pattern, repeats in self.stack_patterns for kind in pattern)

        return KVCache.empty(slots(key_shape, 0), slots(value_shape, 1), batch_size, max_len)

    def forward(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, token_mask: jax.Array | None = None,
                cache: KVCache | None = None, deterministic: bool | None = None,
                routes: jax.Array | None = None) -> LMOutput:
        """Logits of ``input_ids`` int ``[B, T]``.

        Args:
          positions: int ``[B, T]`` rotary positions; default ``0..T-1`` (with a cache: each
            row's next positions, ``cache.positions + 0..T-1``).
          segment_ids: int ``[B, T]`` for packed sequences: a token attends only to earlier
            tokens of its own segment (documents do not see each other). None: one sequence.
          token_mask: bool ``[B, T]``, False for padding: padding keys are never attended to and
            padding is left out of the MoE metrics. None: all real.
          cache: a :class:`KVCache` to decode with: the ``T`` new tokens are written at slots
            ``cache.index ..`` and attend to every valid earlier slot.
          deterministic: overrides ``self.deterministic`` (set by ``model.eval()`` /
            ``model.train()``).
          routes: int ``[B, T, L, K]``, routing replay: every MoE layer routes each token
            through these experts (a token's row of ``-1``: the layer's own choice), gated by
            its live router over them (:func:`sparsemixer_jax.routers.replayed_route`).
        """
        c = self.config
        deterministic = self.deterministic if deterministic is None else deterministic
        b, t = input_ids.shape
        if routes is not None:
            routes = check_routes(c, routes, b, t)
        real = jnp.ones((b, t), bool) if token_mask is None else token_mask.astype(bool)
        x = sharding.keep_rows_split(self.embed_tokens(input_ids), self.rows_sharding)
        positions, masks = _positions_and_masks(c, real, positions, segment_ids, cache)
        fused = _fused_mask(c, real if token_mask is not None else None, segment_ids, cache)
        num_positions = None
        if cache is not None and c.arch.rope.kind == "longrope":
            num_positions = jnp.max(positions) + 1
        cos, sin = rope_cos_sin(c.arch.rope, c.arch.rotary_dim, positions, num_positions)
        temperature = None
        if c.arch.attn_temperature_floor:  # Llama 4's, for the layers without rotary positions
            floors = jnp.floor((positions.astype(jnp.float32) + 1) / c.arch.attn_temperature_floor)
            temperature = 1.0 + c.arch.attn_temperature_scale * jnp.log1p(floors)
        if fused is not None and fused.segments is not None:
            # Rows that cuDNN's packed layout cannot hold would get another attention than the
            # mask's: NaN logits instead (cos feeds every layer and takes no gradient).
            cos = jnp.where(fused.segments.fits, cos, jnp.nan)
        x, (new_keys, new_values), moe = self._run_stacks(x, cache, cos, sin, masks, real,
                                                          deterministic, fused, routes,
                                                          temperature)
        chosen = gathered_routes(moe, b, t, c.top_k)
        aux = _summed_moe_aux(moe)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        logits = sharding.keep_rows_split(logits, self.rows_sharding)
        new_cache = None
        if cache is not None:
            new_cache = cache.advanced(tuple(new_keys), tuple(new_values), real)
        return LMOutput(logits.astype(jnp.float32), new_cache, aux, chosen)

    def _run_stacks(self, x: jax.Array, cache: KVCache | None, cos: jax.Array, sin: jax.Array,
                    masks: tuple[jax.Array, jax.Array | None], real: jax.Array,
                    deterministic: bool, fused: FusedMask | None = None,
                    routes: jax.Array | None = None, temperature: jax.Array | None = None
                    ) -> tuple[jax.Array, tuple[list, list], dict[str, dict]]:
        """Runs every stack on ``x [B, T, emb]`` (:func:`_scan_stack`; ``masks`` as
        :func:`_positions_and_masks` gives them, ``real`` the token mask, ``fused`` as
        :func:`_fused_mask` gives it; ``routes [B, T, L, K]`` replayed). Returns ``(x, (keys,
        values) per layer (empty without a cache), each MoE layer's metrics under
        "layer_{i}")``."""
        c = self.config
        dropless = cache is not None
        kv_in = iter(zip(cache.keys, cache.values, strict=True)) if cache is not None else None
        new_keys, new_values = [], []
        moe: dict[str, dict] = {}
        index = cache.index if cache is not None else None
        first = 0  # the model's index of the stack's first layer
        for stack, (pattern, repeats), routes_in in zip(
                self.stacks, self.stack_patterns, stack_routes(c, routes), strict=True):
            kvs = None if kv_in is None else tuple(next(kv_in) for _ in pattern)
            sliding = rope_on = None
            layer = first + jnp.arange(repeats)[:, None] * len(pattern) + jnp.arange(len(pattern))
            if masks[1] is not None:  # which layers of the stack take the window
                sliding = jnp.asarray(c.arch.sliding_layers)[layer]
            if c.arch.rope_layers:  # which rotate
                rope_on = jnp.asarray(c.arch.rope_layers)[layer]
            x, out_kvs, metrics = _scan_stack(stack, x, kvs, index, cos, sin, masks, sliding,
                                              real, deterministic, dropless, c.execution.remat,
                                              self.rows_sharding, fused, routes_in, rope_on,
                                              temperature)
            for i, kind in enumerate(pattern):
                if out_kvs is not None:
                    new_keys.append(out_kvs[i][0])
                    new_values.append(out_kvs[i][1])
                for r in range(repeats if kind.moe else 0):  # metrics[i]: stacked over repeats
                    moe[f"layer_{first + r * len(pattern) + i}"] = jax.tree.map(
                        lambda a, r=r: a[r], metrics[i])
            first += repeats * len(pattern)
        return x, (new_keys, new_values), moe

    def __call__(self, input_ids: jax.Array, **kwargs: Any) -> jax.Array:
        """Logits float32 ``[B, T, V]`` of ``input_ids [B, T]`` (keyword arguments as
        :meth:`forward`)."""
        return self.forward(input_ids, **kwargs).logits
