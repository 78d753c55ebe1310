"""The configuration of the decoder-only MoE language model
(:mod:`sparsemixer_jax.models.causal_lm`).

One frozen, hashable dataclass describes every model type the library builds (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, Phi-3.5-MoE, and models trained from scratch): each difference between the
types is a field of one of its sections (:class:`LMArchitecture`, the MoE layers' experts and
routing, :class:`LMExecution`), and :meth:`LMConfig.__post_init__` checks them all, so a model is
never built from a config it cannot compute. :mod:`sparsemixer_jax.hf.config` builds one from a
Hugging Face ``config.json`` and back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from sparsemixer_jax import routers
from sparsemixer_jax.layers.attention_impls import ATTENTION_IMPLS, check_attention_dtype
from sparsemixer_jax.layers.gated_deltanet import LAYOUTS, GatedDeltaNetConfig
from sparsemixer_jax.layers.rope import RopeConfig
from sparsemixer_jax.models.layer_stacks import LayerKind
from sparsemixer_jax.moe.config import NORMAL_INIT, MoEConfig
from sparsemixer_jax.moe.dispatch import clamped_swiglu
from sparsemixer_jax.section import read_fields

#: The Hugging Face model types this model reproduces (``config.json``'s ``model_type``).
MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "phimoe", "glm4_moe", "gpt_oss",
               "deepseek_v3", "qwen3_next", "qwen3_5_moe_text", "glm4_moe_lite", "minimax_m2",
               "llama4_text")
ROPE_KINDS = ("default", "longrope", "yarn", "llama3")
#: ``"rms"``: RMSNorm scaled by its weight; ``"zero_centred_rms"``: by ``1 + weight`` (its
#: weight starts at zero: Qwen3-Next, Qwen3.5); ``"layer"``: LayerNorm with bias.
NORMS = ("rms", "zero_centred_rms", "layer")
QK_NORMS = ("none", "head", "full", "l2")
COMPUTE_DTYPES = ("float32", "bfloat16")
# How cuDNN's fused attention takes packed documents (LMConfig.cudnn_document_mask).
CUDNN_DOCUMENT_MASKS = ("bias", "offsets")
#: Rematerialisation of the scanned layers: ``"none"`` (keep every activation the backward pass
#: needs), ``"full"`` (keep only each layer's input; recompute the rest in the backward pass),
#: ``"elementwise"`` (recompute elementwise and layout operations only, fused into the backward
#: pass's kernels: :func:`sparsemixer_jax.models.causal_lm.recompute_elementwise`), or a policy
#: of :data:`jax.checkpoint_policies` naming what the recomputation may keep.
REMAT_POLICIES = ("none", "full", "elementwise", "dots_saveable",
                  "dots_with_no_batch_dims_saveable", "nothing_saveable", "everything_saveable")


@dataclasses.dataclass(frozen=True)
class LMExecution:
    """How a language model computes (precision, kernels, memory), as opposed to which model it
    is: the same settings for a model from scratch and for a checkpoint (``config.model``'s
    fields of these names; :meth:`from_config` reads them), never written to ``config.json``.

    Attributes:
      compute_dtype: ``"float32"`` or ``"bfloat16"`` (params stay float32; norms, softmax and
        routing run in float32).
      dispatch, grouped_impl, capacity_factor, expert_buffer_factor: the MoE layer's
        (:class:`~sparsemixer_jax.moe.MoEFeedForward`).
      attention_impl: ``"einsum"`` (the model's own attention, what transformers computes),
        ``"xla"`` or ``"auto"`` (``jax.nn.dot_product_attention``'s XLA form), ``"cudnn"``
        (cuDNN's fused flash attention: NVIDIA GPUs, ``compute_dtype="bfloat16"``),
        ``"splash"`` (jax's Pallas flash attention on TPU, for full causal passes without a
        window; :mod:`sparsemixer_jax.kernels.splash_attention`).
      cudnn_document_mask: how cuDNN's attention takes packed documents (``segment_ids``) in a
        full forward pass: ``"bias"``, the boolean mask, which it reads as an additive bias
        ``[B, 1, T, T]``; ``"offsets"``, each row's segments as offsets and lengths in cuDNN's
        packed layout (:mod:`sparsemixer_jax.layers.packed_attention`), no bias, with
        ``max_segments_per_row`` segments at most (``configs/lm_bench.py``'s choice; the
        language-model task refuses data with a row of more before a run, a forward pass on
        such concrete ids raises, and under ``jit`` its logits are NaN). Without segment ids,
        padding or a sliding window cuDNN takes its causal flag alone either way.
      max_segments_per_row: ``M``, the segments (documents, padding) a row may hold for
        ``cudnn_document_mask="offsets"``. cuDNN's softmax statistics, kept for the backward
        pass, take ``B M H T`` floats. 64: the Wikipedia sample's 36,183 articles, encoded by
        ``configs/lm_bench.py``'s 32,768-token SentencePiece vocabulary and packed into 3,107
        rows of 4,096 (:func:`~sparsemixer_jax.data.lm_text.pack_documents`), hold 12.6
        segments a row on average, 32 at the 99th percentile and 54 at most.
      remat: a name in :data:`REMAT_POLICIES`: what the backward pass of the scanned layers
        recomputes instead of keeping (memory for compute; the numbers are unchanged).
    """

    compute_dtype: str = "float32"
    dispatch: str = "auto"
    grouped_impl: str = "mosaic"
    capacity_factor: float = 0.0
    expert_buffer_factor: float = 0.0
    attention_impl: str = "einsum"
    cudnn_document_mask: str = "bias"
    max_segments_per_row: int = 64
    remat: str = "none"

    @classmethod
    def from_config(cls, section: Any, where: str = "config.model.") -> LMExecution:
        """The fields of these names in ``section`` (a model section; the others it holds are
        not read), checked: a one-line ValueError naming ``{where}{field}``."""
        return cls(**read_fields(cls, section, where)).check(where)

    def check(self, where: str = "") -> LMExecution:
        """Itself, or a one-line ValueError naming the first field the model cannot compute
        (``where`` prefixes the name). The MoE layer's fields are checked with its section
        (:meth:`LMConfig.moe_sections`)."""
        for name, choices in (("compute_dtype", COMPUTE_DTYPES),
                              ("attention_impl", tuple(ATTENTION_IMPLS)),
                              ("cudnn_document_mask", CUDNN_DOCUMENT_MASKS),
                              ("remat", REMAT_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{where}{name}={getattr(self, name)!r}; choose one of "
                                 f"{', '.join(choices)}")
        check_attention_dtype(self.attention_impl, self.compute_dtype, where)
        m = self.max_segments_per_row
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{where}max_segments_per_row must be an int >= 1, got {m!r}")
        return self


@dataclasses.dataclass(frozen=True)
class LMArchitecture:
    """The layers of a decoder-only language model apart from its MoE sublayers' experts and
    routing: sizes, attention, norms, rotary positions, which layers are routed, embeddings.
    Checked by :meth:`check` (``LMConfig`` checks it on construction).

    Attributes:
      model_type: a name in :data:`MODEL_TYPES`, the Hugging Face type saved with the model.
      vocab_size, hidden_size, num_layers: sizes.
      num_heads, num_kv_heads, head_dim: query heads, key/value heads (``num_heads`` divisible
        by it: grouped-query attention), width of a head (need not be hidden / heads); with
        latent attention the query/key head width, ``qk_nope_head_dim + qk_rope_head_dim``.
      kv_lora_rank: > 0: multi-head latent attention (DeepSeek-V3,
        :mod:`sparsemixer_jax.models.latent_attention`): keys and values are expanded from a
        normed latent of this width, plus one rotary key of ``qk_rope_head_dim`` shared by
        every head; 0: grouped-query attention.
      q_lora_rank: the queries' latent width (latent attention; 0: one query projection).
      qk_rope_head_dim, v_head_dim: latent attention's rotated query/key width (the last
        dimensions of each head) and value head width.
      rope_interleave: the checkpoint's rotated dimensions are pairs ``(x0, x1), (x2, x3)``
        (DeepSeek's and Llama 4's layout) instead of halves: latent attention reorders them as
        it runs; grouped-query attention's q/k projections are reordered on load and back on
        save (:mod:`sparsemixer_jax.hf.weights`).
      intermediate_size: width of the dense layers' MLP.
      moe_intermediate_size: width of each expert.
      moe_layers: one bool per layer, True where the feed-forward sublayer is routed.
      norm: a name in :data:`NORMS`: ``"rms"`` (RMSNorm, weight only), ``"zero_centred_rms"``
        (RMSNorm times ``1 + weight``, also the q/k norms: Qwen3-Next, Qwen3.5) or ``"layer"``
        (LayerNorm with bias, Phi-3.5-MoE).
      norm_eps: epsilon of every norm.
      qk_norm: ``"none"``, ``"head"`` (RMSNorm over each head's query/key, Qwen3-MoE),
        ``"full"`` (RMSNorm over the whole query/key projection, OLMoE) or ``"l2"`` (each
        head's rotated query and key divided by its root mean square, no weight, on the layers
        with rotary positions: Llama 4).
      qkv_bias, out_bias, lm_head_bias: biases of the q/k/v projections, of the output
        projection and of the LM head.
      clip_qkv: clamp queries, keys and values to ``[-clip_qkv, clip_qkv]`` (OLMoE), or None.
      rope: :class:`RopeConfig`.
      sliding_window: keys further back than this many positions are masked (every layer, or
        those of ``sliding_layers``), or None.
      sliding_layers: one bool per layer, True where ``sliding_window`` or
        ``attention_chunk_size`` applies (gpt-oss's and Llama 4's ``layer_types``); empty:
        every layer.
      attention_chunk_size: a query attends to the keys of its own chunk of this many positions
        only (Llama 4's chunked attention; on the ``sliding_layers``), or None.
      rope_layers: one bool per layer, True where queries and keys are rotated (Llama 4's
        ``no_rope_layers``); empty: every layer.
      attn_temperature_floor, attn_temperature_scale: > 0: the queries of the layers without
        rotary positions are multiplied by ``1 + scale * log(1 + floor((p + 1) / floor))`` at
        position ``p`` (Llama 4's temperature tuning); 0: off.
      attention_sinks: each attention head has a learned logit ``s_h`` in its softmax's
        denominator, ``exp(l_j) / (sum_i exp(l_i) + exp(s_h))`` (gpt-oss's ``sinks``).
      attention_output_gate: the query projection also gives a gate per head and dimension,
        and each head's output is multiplied by its sigmoid before the output projection
        (Qwen3-Next's and Qwen3.5's gated attention; ``q_proj`` is ``[emb, H * 2 * head_dim]``,
        per head its query then its gate).
      linear_layers: one bool per layer, True where Gated DeltaNet
        (:class:`~sparsemixer_jax.layers.gated_deltanet.GatedDeltaNet`) takes attention's
        place (the hybrids' ``linear_attention`` layers); empty: attention on every layer.
      linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
        linear_value_head_dim, linear_conv_kernel_dim: the Gated DeltaNet layers' heads, head
        widths and convolution taps (:meth:`deltanet`).
      linear_layout: their projections, ``"fused"`` (Qwen3-Next) or ``"separate"`` (Qwen3.5).
      tie_word_embeddings: the LM head is the token embedding.
      max_position_embeddings: the longest sequence the checkpoint was made for (informational,
        and longrope's factor).
      initializer_range: std of the normal initialisation of every weight (as each type's own).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    moe_layers: tuple[bool, ...]
    norm: str = "rms"
    norm_eps: float = 1e-5
    qk_norm: str = "none"
    qkv_bias: bool = False
    out_bias: bool = False
    lm_head_bias: bool = False
    clip_qkv: float | None = None
    rope: RopeConfig = RopeConfig()  # noqa: RUF009 (frozen: one shared default is safe)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    attention_sinks: bool = False
    attention_output_gate: bool = False
    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_layout: str = "fused"
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    attention_chunk_size: int | None = None
    rope_layers: tuple[bool, ...] = ()
    attn_temperature_floor: int = 0
    attn_temperature_scale: float = 0.1
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02

    def check(self) -> LMArchitecture:
        """Itself, or a one-line ValueError naming the first field the model cannot compute
        (one group at a time: sizes, choices, the layers' options, the rotary positions)."""
        self._check_sizes()
        for name, value, choices in (("norm", self.norm, NORMS),
                                     ("qk_norm", self.qk_norm, QK_NORMS)):
            if value not in choices:
                _fail(f"{name}={value!r}; choose one of {choices}")
        self._check_layer_options()
        self._check_rope()
        return self

    def _check_sizes(self) -> None:
        """The model type, the widths and counts, and how heads and layers divide up."""
        if self.model_type not in MODEL_TYPES:
            _fail(f"model_type={self.model_type!r} is not supported; supported: {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            _check_count(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            _fail(f"num_heads={self.num_heads} is not divisible by num_kv_heads="
                  f"{self.num_kv_heads} (grouped-query attention shares each key/value head "
                  "among num_heads / num_kv_heads query heads)")
        if self.head_dim % 2:
            _fail(f"head_dim={self.head_dim} must be even (rotary positions rotate pairs)")
        if len(self.moe_layers) != self.num_layers:
            _fail(f"moe_layers has {len(self.moe_layers)} entries for num_layers="
                  f"{self.num_layers}")
        if any(self.moe_layers) and self.moe_intermediate_size < 1:
            _fail(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if not all(self.moe_layers) and self.intermediate_size < 1:
            _fail(f"intermediate_size must be >= 1 for the dense layers, got "
                  f"{self.intermediate_size}")

    def _check_layer_options(self) -> None:
        """The norms' and attention's numeric options."""
        if not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            _fail(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            _fail(f"clip_qkv must be > 0 or None, got {self.clip_qkv}")
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        for name in ("sliding_layers", "rope_layers"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                _fail(f"{name} has {len(getattr(self, name))} entries for num_layers="
                      f"{self.num_layers}")
        chunk = self.attention_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1 or self.sliding_window is not None):
            _fail(f"attention_chunk_size must be an int >= 1 without a sliding_window, or None; "
                  f"got {chunk!r} (sliding_window={self.sliding_window})")
        if self.attn_temperature_floor < 0:
            _fail(f"attn_temperature_floor must be >= 0 (0: off), got "
                  f"{self.attn_temperature_floor}")
        if any(self.linear_layers):
            self._check_linear_layers()

    def _check_linear_layers(self) -> None:
        """The Gated DeltaNet layers' sizes (each field named as the ``config.json`` key)."""
        if len(self.linear_layers) != self.num_layers:
            _fail(f"linear_layers has {len(self.linear_layers)} entries for num_layers="
                  f"{self.num_layers}")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            _check_count(name, getattr(self, name))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            _fail(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                  f"linear_num_key_heads={self.linear_num_key_heads} (each key head serves a "
                  "whole group of value heads)")
        if self.linear_layout not in LAYOUTS:
            _fail(f"linear_layout={self.linear_layout!r}; choose one of {LAYOUTS}")
        if self.kv_lora_rank:
            _fail("Gated DeltaNet layers and latent attention do not go together")

    def _check_rope(self) -> None:
        """The rotary positions: their kind's settings and the rotated width (latent
        attention's is its own ``qk_rope_head_dim``, so its fields are checked first)."""
        rope = self.rope
        if not rope.theta > 0:
            _fail(f"rope theta must be > 0, got {rope.theta}")
        if rope.kind not in ROPE_KINDS:
            _fail(f"rope kind {rope.kind!r} is not implemented; implemented: "
                  f"{', '.join(ROPE_KINDS)}")
        # beta_fast == beta_slow (Kimi-K2's config.json) is computed: the ramp gets transformers'
        # minimal width (yarn_inv_freq).
        if rope.kind == "yarn" and not (rope.factor >= 1 and rope.beta_fast >= rope.beta_slow > 0
                                        and rope.original_max_position_embeddings >= 1):
            _fail(f"yarn needs factor >= 1, beta_fast >= beta_slow > 0 and "
                  f"original_max_position_embeddings >= 1, got {rope}")
        if rope.kind == "llama3" and not (rope.factor >= 1 and 0 < rope.low_freq_factor
                                          <= rope.high_freq_factor
                                          and rope.original_max_position_embeddings >= 1):
            _fail(f"llama3 rope needs factor >= 1, 0 < low_freq_factor <= high_freq_factor and "
                  f"original_max_position_embeddings >= 1, got {rope}")
        if self.kv_lora_rank:
            self._check_latent_attention()
        rotary = self.rotary_dim
        if not 0 < rope.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
            _fail(f"partial_rotary_factor={rope.partial_rotary_factor} of head_dim="
                  f"{self.head_dim} rotates {rotary} dimensions; it must be an even number >= 2 "
                  "and the factor in (0, 1]")
        if rope.kind == "longrope":
            half = self.head_dim // 2
            if len(rope.short_factor) != half or len(rope.long_factor) != half:
                _fail(f"longrope needs short_factor and long_factor of head_dim / 2 = {half} "
                      f"values, got {len(rope.short_factor)} and {len(rope.long_factor)}")
            if rope.original_max_position_embeddings < 1:
                _fail("longrope needs original_max_position_embeddings >= 1")

    def _check_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail(f"{name} must be an int >= 0, got {value!r}")
        if not 2 <= self.qk_rope_head_dim < self.head_dim or self.v_head_dim < 1:
            _fail(f"latent attention needs 2 <= qk_rope_head_dim < head_dim and v_head_dim >= 1, "
                  f"got qk_rope_head_dim={self.qk_rope_head_dim}, head_dim={self.head_dim}, "
                  f"v_head_dim={self.v_head_dim}")
        if self.num_kv_heads != self.num_heads:
            _fail(f"latent attention expands keys and values for every head: num_kv_heads="
                  f"{self.num_kv_heads} must equal num_heads={self.num_heads}")
        for name, value, off in (("qk_norm", self.qk_norm, "none"),
                                 ("attention_sinks", self.attention_sinks, False),
                                 ("clip_qkv", self.clip_qkv, None)):
            if value != off:
                _fail(f"latent attention takes {name}={off!r} only, got {value!r}")
        if self.rope.partial_rotary_factor != 1.0 or self.rope.kind == "longrope":
            _fail("latent attention rotates qk_rope_head_dim dimensions by default or yarn rope "
                  "(no partial_rotary_factor, no longrope)")

    @property
    def rotary_dim(self) -> int:
        """The rotated width of a query/key head: ``qk_rope_head_dim`` with latent attention,
        else ``head_dim`` times ``partial_rotary_factor``."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's :class:`LayerKind`, in order."""
        linear = self.linear_layers or (False,) * self.num_layers
        return tuple(LayerKind(m, n) for m, n in zip(self.moe_layers, linear, strict=True))

    def deltanet(self, compute_dtype: str) -> GatedDeltaNetConfig:
        """The Gated DeltaNet layers' section (norm epsilon and initialisation the model's)."""
        return GatedDeltaNetConfig(
            hidden_size=self.hidden_size, num_key_heads=self.linear_num_key_heads,
            num_value_heads=self.linear_num_value_heads, key_head_dim=self.linear_key_head_dim,
            value_head_dim=self.linear_value_head_dim,
            conv_kernel_size=self.linear_conv_kernel_dim, layout=self.linear_layout,
            norm_eps=self.norm_eps, compute_dtype=compute_dtype,
            initializer_range=self.initializer_range)

    @property
    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(heads, width)`` of a cached key and of a cached value: grouped-query attention's
        keys and values, or latent attention's normed latent (one "head" of ``kv_lora_rank``)
        and its rotated shared key (``qk_rope_head_dim``)."""
        if self.kv_lora_rank:
            return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)


def _fail(message: str) -> None:
    raise ValueError(f"LMConfig: {message}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(f"{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """A decoder-only MoE language model: pre-norm blocks of grouped-query attention with rotary
    positions and a feed-forward sublayer that is routed (gated SwiGLU experts, optionally a
    shared expert with a sigmoid gate) or dense (one SwiGLU MLP).

    Its sections: ``arch`` (:class:`LMArchitecture`), the MoE layers' experts and routing (the
    fields here, which :meth:`moe_sections` gives as the layer's sections) and ``execution``
    (:class:`LMExecution`). :meth:`build` and :meth:`replace` take any field by its own name;
    :meth:`value` reads one.

    Attributes:
      arch: :class:`LMArchitecture`.
      num_experts, top_k: experts per MoE layer and per token.
      shared_expert_size: width of the shared expert (Qwen2-MoE's; GLM-4.5's shared experts
        as one MLP of their summed width); 0: none.
      shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x w_g)``
        (Qwen2-MoE); off: added as it is (GLM-4.5).
      selection_bias: every MoE layer holds a per-expert selection bias as its bias state
        (GLM-4.5's ``e_score_correction_bias``), also without bias balancing.
      router_bias: the router's linear map has a bias (gpt-oss).
      expert_biases: the experts' projections have biases (gpt-oss's ``gate_up_proj_bias``,
        ``down_proj_bias``).
      swiglu_limit, swiglu_alpha: the experts compute gpt-oss's clamped SwiGLU
        (:func:`sparsemixer_jax.moe.dispatch.clamped_swiglu`) with these constants; None: SwiGLU.
      router: a name in :data:`sparsemixer_jax.routers.ROUTERS`; ``jitter_eps`` its jitter /
        mask threshold; ``norm_topk_prob`` renormalises the ``k`` gates (routers with Switch's
        forward only). The checkpoint's own routing: ``switch`` with ``jitter_eps=0`` (softmax
        top-k) for every type but ``phimoe``, which routes by ``sparsemixer_v2``.
      router_options: further :class:`sparsemixer_jax.routers.RouterOptions` fields, as sorted
        ``(name, value)`` pairs.
      moe_input_jitter: in training, the MoE sublayer's input is multiplied by
        ``U(1 - e, 1 + e)`` per element (Mixtral's ``router_jitter_noise``, Phi-3.5-MoE's
        ``input_jitter_noise``); 0: none.
      input_gates: the MoE layers gate the experts' inputs by the sigmoids of the chosen
        logits and sum their outputs (Llama 4; :class:`~sparsemixer_jax.moe.config.MoEConfig`),
        with the ``switch`` router only.
      router_aux_loss_coef: weight of the load-balancing loss in training (read by the task).
      execution: :class:`LMExecution`, how the model computes (dtypes, the MoE layers'
        dispatch, attention's implementation, rematerialisation); never written to
        ``config.json``.
      hf_config: the ``config.json`` this config was read from (JSON text), so that saving keeps
        the keys that do not change the computation (token ids, ...); empty if none.
    """

    arch: LMArchitecture
    num_experts: int
    top_k: int
    shared_expert_size: int = 0
    shared_expert_gate: bool = True
    selection_bias: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    router: str = "switch"
    jitter_eps: float = 0.0
    norm_topk_prob: bool = False
    router_options: tuple[tuple[str, Any], ...] = ()
    moe_input_jitter: float = 0.0
    input_gates: bool = False
    router_aux_loss_coef: float = 0.0
    execution: LMExecution = LMExecution()
    hf_config: str = ""

    def __post_init__(self) -> None:
        """Every field checked, one section at a time: a one-line ValueError naming the first
        that the model cannot compute."""
        arch = self.arch.check()
        for name in ("num_experts", "top_k"):
            _check_count(name, getattr(self, name))
        if self.shared_expert_size < 0:
            _fail(f"shared_expert_size must be >= 0, got {self.shared_expert_size}")
        try:
            self.execution.check()
        except ValueError as err:
            _fail(str(err))
        impl = self.execution.attention_impl
        if arch.attention_sinks and impl != "einsum":
            _fail(f"attention_sinks need attention_impl='einsum' (jax.nn.dot_product_attention "
                  f"has no sink logit), got {impl!r}")
        if self.input_gates and self.router != "switch":
            _fail(f"input_gates (Llama 4's sigmoid gates on the experts' inputs) take router "
                  f"'switch' only, got {self.router!r}: the other routers' gradient estimators "
                  "are defined for gates that scale the experts' outputs")
        if arch.kv_lora_rank and impl != "einsum":
            _fail(f"latent attention takes attention_impl='einsum' only, got {impl!r}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            _fail(f"swiglu_limit must be > 0 or None, got {self.swiglu_limit}")
        if self.hf_config:
            json.loads(self.hf_config)  # must be JSON text
        try:  # the MoE layers' settings, as the layer checks them
            self.moe_sections()
        except ValueError as err:
            _fail(str(err))

    @classmethod
    def build(cls, **fields: Any) -> LMConfig:
        """An :class:`LMConfig` of fields named on their own (``hidden_size=...``,
        ``compute_dtype=...``), each given to the section that owns it."""
        arch = {name: fields.pop(name) for name in ARCH_FIELDS if name in fields}
        run = {name: fields.pop(name) for name in EXECUTION_FIELDS if name in fields}
        if run:
            fields["execution"] = LMExecution(**run)
        return cls(arch=LMArchitecture(**arch), **fields)

    def value(self, name: str) -> Any:
        """The field ``name`` of whichever section owns it (a :class:`~sparsemixer_jax.hf.
        families.Key` names fields so)."""
        if name in ARCH_FIELDS:
            return getattr(self.arch, name)
        if name in EXECUTION_FIELDS:
            return getattr(self.execution, name)
        return getattr(self, name)

    def router_option_dict(self) -> dict[str, Any]:
        """The router's options: ``router_options`` plus ``normalize_top_k`` from
        ``norm_topk_prob`` for the routers that take it (the others cannot renormalise)."""
        options = dict(self.router_options)
        # Sigmoid scores renormalise their gates by definition (and refuse normalize_top_k).
        if self.norm_topk_prob and options.get("score", "softmax") == "softmax" and \
                self.router in routers.registry.routers_taking("normalize_top_k"):
            options.setdefault("normalize_top_k", True)
        return options

    def moe_sections(self) -> tuple[MoEConfig, routers.RouterConfig]:
        """The MoE layers' sections (:class:`~sparsemixer_jax.moe.MoEFeedForward`): gated
        SwiGLU experts (gpt-oss's clamped form where ``swiglu_limit`` is set) without dropout,
        initialised as the types are (``normal(initializer_range)``), and the router."""
        activation = "silu" if self.swiglu_limit is None else \
            clamped_swiglu(self.swiglu_limit, self.swiglu_alpha)
        run = self.execution
        moe = MoEConfig(
            num_experts=self.num_experts, dispatch=run.dispatch, grouped_impl=run.grouped_impl,
            capacity_factor=run.capacity_factor, expert_buffer_factor=run.expert_buffer_factor,
            activation=activation, activation_dropout=0.0, init=NORMAL_INIT, gated=True,
            expert_biases=self.expert_biases, router_bias=self.router_bias,
            selection_bias=self.selection_bias, input_jitter=self.moe_input_jitter,
            input_gates=self.input_gates,
            init_std=self.arch.initializer_range).check()
        router = routers.check_router(self.router, top_k=self.top_k, jitter_eps=self.jitter_eps,
                                      num_experts=self.num_experts, where="",
                                      **self.router_option_dict())
        return moe, router

    @property
    def hf(self) -> dict[str, Any]:
        """The ``config.json`` this config was read from, as a dict (empty if none)."""
        return json.loads(self.hf_config) if self.hf_config else {}

    def replace(self, **changes: Any) -> LMConfig:
        """A copy with ``changes`` (checked again); a field of a section may be named on its
        own (``compute_dtype="bfloat16"``: the execution section's)."""
        for section, names in (("arch", ARCH_FIELDS), ("execution", EXECUTION_FIELDS)):
            moved = {name: changes.pop(name) for name in names if name in changes}
            if moved:
                changes[section] = dataclasses.replace(
                    changes.get(section, getattr(self, section)), **moved)
        return dataclasses.replace(self, **changes)


#: The fields of :class:`LMArchitecture` and of :class:`LMExecution`, which
#: :meth:`LMConfig.build`, :meth:`LMConfig.replace` and :meth:`LMConfig.value` take by name.
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(LMArchitecture))
EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(LMExecution))
