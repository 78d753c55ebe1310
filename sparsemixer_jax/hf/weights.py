"""Tensor names and layouts between Hugging Face checkpoints and :class:`CausalLM`'s params.

Hugging Face ``nn.Linear`` weights are ``[out, in]``, flax kernels ``[in, out]``: every
projection is transposed. Per layer ``L`` the model's stacked params are indexed
``[repeat]`` (and ``[repeat, expert]`` for experts), found by :meth:`CausalLM.layer_index`.

The names come from one table used both ways: :func:`saved_tensors` lists every tensor a
checkpoint holds, which saving writes and loading reads (:func:`read_table`). What differs by
type, the MoE sublayer's names, is the type's record
(:attr:`sparsemixer_jax.hf.families.Family.moe_names`). Expert layouts read (both, in any mix):

* per expert, as Hub checkpoints and transformers' ``save_pretrained`` write them:
  ``model.layers.L.block_sparse_moe.experts.j.w1/w3/w2.weight`` (Mixtral, Phi-3.5-MoE: gate,
  up, down) or ``model.layers.L.mlp.experts.j.gate_proj/up_proj/down_proj.weight`` (Qwen, OLMoE);
  the router ``...block_sparse_moe.gate.weight`` / ``...mlp.gate.weight``;
* fused, as transformers 5 holds them in memory: ``model.layers.L.mlp.experts.gate_up_proj``
  ``[N, 2 * I, emb]`` (gate rows first) and ``...mlp.experts.down_proj`` ``[N, emb, I]``; the
  router ``...mlp.gate.weight`` or ``...mlp.router.weight`` (Phi-3.5-MoE; the record's
  ``fused_router``).

Written: the per-expert layout, which transformers 4.x and 5.x both load. gpt-oss's checkpoints
have one layout only (the record's ``interleaved_experts``): ``mlp.experts.gate_up_proj``
``[N, emb, 2 * I]`` with gate and up interleaved (even and odd columns) and its bias
``[N, 2 * I]`` alike, ``mlp.experts.down_proj`` ``[N, I, emb]`` and its bias, the router
``mlp.router.weight`` and ``mlp.router.bias``; read and written as they are. Llama 4's too:
``feed_forward.experts.gate_up_proj`` ``[N, emb, 2 * I]`` with gate and up its halves,
``feed_forward.experts.down_proj`` ``[N, I, emb]``, ``feed_forward.router.weight``, the shared
expert ``feed_forward.shared_expert.*`` and the dense layers' ``feed_forward.*``; its q/k
projections (and biases) hold each head's rotary pairs, reordered to halves on load and back
on save (:func:`pair_order`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from sparsemixer_jax.hf.families import (
    LATENT_ATTENTION_NAMES,
    LATENT_ATTENTION_NORMS,
    SELECTION_BIAS,
    family_of,
)
from sparsemixer_jax.models.lm_config import LMConfig

Path = tuple[Any, ...]
#: The shared expert's projections in a checkpoint -> their
#: :class:`~sparsemixer_jax.moe.shared.SharedExperts` params (its gate is ``gate``).
SHARED_EXPERT_PARAMS = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
#: Where each stacked layer lives: ``(stack, repeat, position)`` per layer, in order
#: (:meth:`CausalLM.layer_index_of`).
Layers = list[tuple[int, int, int]]


class Slot(NamedTuple):
    """Where one checkpoint tensor goes: the param ``path`` (keys of the model's pure state
    dict), the ``index`` into its leading axes, and how to turn the tensor into the slice."""

    path: Path
    index: tuple[int, ...]
    # "same", "T" (2-D transpose), "gate"/"up" (halves of fused gate_up), "down",
    # "even"/"odd" (the interleaved columns of gpt-oss's gate_up_proj, on the last axis),
    # "conv" (a depthwise Conv1d weight [C, 1, K] as the param [C, K]),
    # "first"/"second" (the halves of Llama 4's gate_up_proj, on the last axis), "pairs<D>"
    # (transposed, each head of D columns reordered from rotary pairs to halves: Llama 4's q/k),
    # "bpairs<D>" (such a projection's bias reordered alike)
    transform: str


def convert(value: np.ndarray, transform: str) -> np.ndarray:
    """A checkpoint tensor as the model's slice (see :class:`Slot`)."""
    if transform == "same":
        return value
    if transform == "T":
        return value.T
    if transform in ("even", "odd"):
        return value[..., 0::2] if transform == "even" else value[..., 1::2]
    if transform == "conv":
        return value[:, 0, :]
    if transform in ("first", "second"):
        half = value.shape[-1] // 2
        return value[..., :half] if transform == "first" else value[..., half:]
    if transform.startswith("pairs"):
        return value.T[:, pair_order(value.shape[0], int(transform[5:]))]
    if transform.startswith("bpairs"):  # the bias of such a projection
        return value[pair_order(value.shape[0], int(transform[6:]))]
    if transform in ("gate", "up"):  # [N, 2I, emb] -> [N, emb, I]
        half = value.shape[1] // 2
        part = value[:, :half] if transform == "gate" else value[:, half:]
        return np.swapaxes(part, 1, 2)
    return np.swapaxes(value, 1, 2)  # "down": [N, emb, I] -> [N, I, emb]


def pair_order(width: int, head_dim: int) -> np.ndarray:
    """The column order that turns each head of ``head_dim`` rotary pairs ``(x0, x1), (x2,
    x3), ...`` into halves ``(x0, x2, ...), (x1, x3, ...)`` (what the model's rotation takes;
    the same order on queries and keys keeps their dot products, and a norm over a head is
    unchanged), over ``width`` columns."""
    head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(0, width, head_dim)[:, None] + head).reshape(-1)


def _layer_tensors(config: LMConfig, number: int, stack: int, repeat: int, pos: int
                   ) -> Iterator[tuple[str, Slot]]:
    """Every tensor of layer ``number`` in a checkpoint of ``config``: ``(name, slot)``.
    Attention, norms and the dense MLP are named as the params (every type alike); the MoE
    sublayer by the type's ``moe_names`` and ``shared_expert_names``."""
    base: Path = ("stacks", stack, "layers", pos)
    layer = f"model.layers.{number}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        for leaf in ("weight",) if config.arch.norm != "layer" else ("weight", "bias"):
            yield f"{layer}.{norm}.{leaf}", Slot((*base, norm, leaf), (repeat,), "same")
    if config.arch.linear_layers and config.arch.linear_layers[number]:
        yield from _linear_attention(config, layer, (*base, "linear_attn"), repeat)
    elif config.arch.kv_lora_rank:
        yield from _latent_attention(config, layer, (*base, "self_attn"), repeat)
    else:
        yield from _attention(config, layer, (*base, "self_attn"), repeat)
    family = family_of(config.arch.model_type)
    if not config.arch.moe_layers[number]:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield (f"{layer}.{family.dense_mlp}.{proj}.weight",
                   Slot((*base, "mlp", proj, "kernel"), (repeat,), "T"))
        return
    names = family.moe_names
    moe = (*base, "mlp", "moe")
    yield f"{layer}.{names['router']}", Slot((*moe, "router", "kernel"), (repeat,), "T")
    if config.router_bias:
        yield f"{layer}.{names['router_bias']}", Slot((*moe, "router", "bias"), (repeat,), "same")
    if config.selection_bias:
        yield (f"{layer}.{names[SELECTION_BIAS]}",
               Slot((*moe, "expert_bias"), (repeat,), "same"))
    if family.interleaved_experts:
        yield from _interleaved_experts(config, layer, moe, repeat, names)
    for expert in range(0 if family.interleaved_experts else config.num_experts):
        for param in ("w_gate", "w_up", "w_down"):
            yield (f"{layer}.{names[param].format(e=expert)}",
                   Slot((*moe, param), (repeat, expert), "T"))
    if config.shared_expert_size:
        shared, params = family.shared_expert_names, (*base, "mlp", "shared_experts")
        for proj, param in SHARED_EXPERT_PARAMS.items():
            yield (f"{layer}.{shared}.{proj}.weight",
                   Slot((*params, param, "kernel"), (repeat,), "T"))
        if config.shared_expert_gate:
            yield f"{layer}.{shared}_gate.weight", Slot((*params, "gate", "kernel"), (repeat,), "T")


def _attention(config: LMConfig, layer: str, attn: Path, repeat: int
               ) -> Iterator[tuple[str, Slot]]:
    """Grouped-query attention's tensors: projections (biases per config), sinks, q/k norms."""
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        # Rotary pairs (Llama 4) reordered to the halves the model rotates.
        pairs = config.arch.rope_interleave and proj in ("q_proj", "k_proj")
        transform = f"pairs{config.arch.head_dim}" if pairs else "T"
        yield f"{layer}.self_attn.{proj}.weight", Slot((*attn, proj, "kernel"), (repeat,),
                                                       transform)
        if (config.arch.out_bias if proj == "o_proj" else config.arch.qkv_bias):
            yield (f"{layer}.self_attn.{proj}.bias",
                   Slot((*attn, proj, "bias"), (repeat,),
                        f"bpairs{config.arch.head_dim}" if pairs else "same"))
    if config.arch.attention_sinks:
        yield f"{layer}.self_attn.sinks", Slot((*attn, "sinks"), (repeat,), "same")
    if config.arch.qk_norm not in ("none", "l2"):  # l2 has no weight
        for norm in ("q_norm", "k_norm"):
            yield (f"{layer}.self_attn.{norm}.weight",
                   Slot((*attn, norm, "weight"), (repeat,), "same"))


#: Gated DeltaNet's input projections by layout
#: (:class:`~sparsemixer_jax.layers.gated_deltanet.GatedDeltaNet`).
LINEAR_PROJECTIONS = {"fused": ("in_proj_qkvz", "in_proj_ba"),
                      "separate": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}


def _linear_attention(config: LMConfig, layer: str, mixer: Path, repeat: int
                      ) -> Iterator[tuple[str, Slot]]:
    """A Gated DeltaNet layer's tensors (``linear_attn.*``): its projections, the depthwise
    convolution ``conv1d.weight [C, 1, K]``, ``dt_bias``, ``A_log`` and the gated norm."""
    for proj in (*LINEAR_PROJECTIONS[config.arch.linear_layout], "out_proj"):
        yield f"{layer}.linear_attn.{proj}.weight", Slot((*mixer, proj, "kernel"), (repeat,), "T")
    yield f"{layer}.linear_attn.conv1d.weight", Slot((*mixer, "conv1d"), (repeat,), "conv")
    for name in ("dt_bias", "A_log"):
        yield f"{layer}.linear_attn.{name}", Slot((*mixer, name), (repeat,), "same")
    yield f"{layer}.linear_attn.norm.weight", Slot((*mixer, "norm", "weight"), (repeat,), "same")


def _latent_attention(config: LMConfig, layer: str, attn: Path, repeat: int
                      ) -> Iterator[tuple[str, Slot]]:
    """Latent attention's tensors (:data:`LATENT_ATTENTION_NAMES`, the biases where
    ``attention_bias``; the query's low-rank pair or its one projection)."""
    skipped = ("q_proj",) if config.arch.q_lora_rank else ("q_a_proj", "q_b_proj", "q_a_layernorm")
    for proj, biased in LATENT_ATTENTION_NAMES.items():
        if proj in skipped:
            continue
        yield f"{layer}.self_attn.{proj}.weight", Slot((*attn, proj, "kernel"), (repeat,), "T")
        if biased and (config.arch.out_bias if proj == "o_proj" else config.arch.qkv_bias):
            yield f"{layer}.self_attn.{proj}.bias", Slot((*attn, proj, "bias"), (repeat,), "same")
    for norm in LATENT_ATTENTION_NORMS:
        if norm not in skipped:
            yield (f"{layer}.self_attn.{norm}.weight",
                   Slot((*attn, norm, "weight"), (repeat,), "same"))


def _interleaved_experts(config: LMConfig, layer: str, moe: Path, repeat: int,
                         names: dict[str, str]) -> Iterator[tuple[str, Slot]]:
    """gpt-oss's experts: whole ``[N, ...]`` tensors, gate and up from the even and odd
    columns of one (each such name comes twice, once per param)."""
    gate, up = ("first", "second") if family_of(config.arch.model_type).halved_experts \
        else ("even", "odd")
    params = [("w_gate", gate), ("w_up", up), ("w_down", "same")]
    if config.expert_biases:
        params += [("b_gate", gate), ("b_up", up), ("b_down", "same")]
    for param, transform in params:
        yield f"{layer}.{names[param]}", Slot((*moe, param), (repeat,), transform)


def saved_value(value: np.ndarray, transform: str) -> np.ndarray:
    """A param slice as the checkpoint tensor of its one slot (:func:`convert` undone; the
    halves and interleaved pairs of two slots are joined by the caller)."""
    if transform == "T":
        return value.T
    if transform == "conv":  # a depthwise convolution's [channels, taps] as [channels, 1, taps]
        return value[:, None, :]
    if transform.startswith(("pairs", "bpairs")):
        head_dim = int(transform.removeprefix("b").removeprefix("pairs"))
        inverse = np.argsort(pair_order(value.shape[-1], head_dim))
        return value[..., inverse].T if transform.startswith("pairs") else value[inverse]
    return value


def saved_tensors(config: LMConfig, layers: Layers) -> Iterator[tuple[str, Slot]]:
    """Every tensor a checkpoint of ``config`` holds, in the per-expert layout, in model order:
    ``(name, slot)``; the slot's value transposed back (``"T"``) is the tensor, and a name
    given twice in a row (``"even"``, ``"odd"``) interleaves its two slots' values."""
    yield "model.embed_tokens.weight", Slot(("embed_tokens", "embedding"), (), "same")
    for number, (stack, repeat, pos) in enumerate(layers):
        yield from _layer_tensors(config, number, stack, repeat, pos)
    yield "model.norm.weight", Slot(("norm", "weight"), (), "same")
    if config.arch.norm == "layer":
        yield "model.norm.bias", Slot(("norm", "bias"), (), "same")
    if not config.arch.tie_word_embeddings:
        yield "lm_head.weight", Slot(("lm_head", "kernel"), (), "T")
        if config.arch.lm_head_bias:
            yield "lm_head.bias", Slot(("lm_head", "bias"), (), "same")


def read_table(config: LMConfig, layers: Layers) -> dict[str, list[Slot]]:
    """The slots of every tensor name a checkpoint of ``config`` may hold: the names
    :func:`saved_tensors` writes, and per MoE layer transformers 5's fused names (the type's
    ``fused_router``, ``mlp.experts.gate_up_proj`` to both the gate and up params,
    ``mlp.experts.down_proj``). A name not in it has no place in the model."""
    table: dict[str, list[Slot]] = {}
    for name, slot in saved_tensors(config, layers):
        table.setdefault(name, []).append(slot)
    family = family_of(config.arch.model_type)
    if family.interleaved_experts:  # one layout only: the saved names
        return table
    for number, (stack, repeat, pos) in enumerate(layers):
        if not config.arch.moe_layers[number]:
            continue
        layer, moe = f"model.layers.{number}", ("stacks", stack, "layers", pos, "mlp", "moe")
        table[f"{layer}.{family.fused_router}"] = [Slot((*moe, "router", "kernel"), (repeat,),
                                                        "T")]
        table[f"{layer}.mlp.experts.gate_up_proj"] = [Slot((*moe, "w_gate"), (repeat,), "gate"),
                                                      Slot((*moe, "w_up"), (repeat,), "up")]
        table[f"{layer}.mlp.experts.down_proj"] = [Slot((*moe, "w_down"), (repeat,), "down")]
    return table
