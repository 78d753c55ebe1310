"""Tensor names and layouts between Hugging Face checkpoints and :class:`CausalLM`'s params.

Hugging Face ``nn.Linear`` weights are ``[out, in]``, flax kernels ``[in, out]``: every
projection is transposed. Per layer ``L`` the model's stacked params are indexed
``[repeat]`` (and ``[repeat, expert]`` for experts), found by :meth:`CausalLM.layer_index`.

Expert layouts read (both, in any mix):

* per expert, as Hub checkpoints and transformers' ``save_pretrained`` write them:
  ``model.layers.L.block_sparse_moe.experts.j.w1/w3/w2.weight`` (Mixtral, Phi-3.5-MoE: gate,
  up, down) or ``model.layers.L.mlp.experts.j.gate_proj/up_proj/down_proj.weight`` (Qwen, OLMoE);
  the router ``...block_sparse_moe.gate.weight`` / ``...mlp.gate.weight``;
* fused, as transformers 5 holds them in memory: ``model.layers.L.mlp.experts.gate_up_proj``
  ``[N, 2 * I, emb]`` (gate rows first) and ``...mlp.experts.down_proj`` ``[N, emb, I]``; the
  router ``...mlp.gate.weight`` or ``...mlp.router.weight`` (Phi-3.5-MoE).

Written: the per-expert layout, which transformers 4.x and 5.x both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from sparsemixer_jax.models.lm_config import LMConfig

Path = tuple[Any, ...]


class Slot(NamedTuple):
    """Where one checkpoint tensor goes: the param ``path`` (keys of the model's pure state
    dict), the ``index`` into its leading axes, and how to turn the tensor into the slice."""

    path: Path
    index: tuple[int, ...]
    transform: str  # "same", "T" (2-D transpose), "gate"/"up" (halves of fused gate_up), "down"


def _legacy_moe(model_type: str) -> tuple[str, dict[str, str]]:
    """The per-expert prefix and names (gate, up, down) a type's checkpoints use."""
    if model_type in ("mixtral", "phimoe"):
        return "block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
    return "mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


_EXPERT_NAMES = {"w1": "w_gate", "gate_proj": "w_gate", "w3": "w_up", "up_proj": "w_up",
                 "w2": "w_down", "down_proj": "w_down"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def parse(name: str, config: LMConfig, layers: list[tuple[int, int, int]]) -> list[Slot] | None:
    """The slots of checkpoint tensor ``name``; None for a name this model has no place for."""
    if name == "model.embed_tokens.weight":
        return [Slot(("embed_tokens", "embedding"), (), "same")]
    if name in ("model.norm.weight", "model.norm.bias"):
        return [Slot(("norm", name.rsplit(".", 1)[1]), (), "same")]
    if name in ("lm_head.weight", "lm_head.bias"):
        leaf = "kernel" if name.endswith("weight") else "bias"
        return [Slot(("lm_head", leaf), (), "T" if leaf == "kernel" else "same")]
    match = _LAYER.fullmatch(name)
    if not match or int(match.group(1)) >= len(layers):
        return None
    stack, repeat, pos = layers[int(match.group(1))]
    base: Path = ("stacks", stack, "layers", pos)
    parts = match.group(2).split(".")
    if parts[0] in ("input_layernorm", "post_attention_layernorm") and len(parts) == 2:
        return [Slot((*base, parts[0], parts[1]), (repeat,), "same")]
    if parts[0] == "self_attn" and len(parts) == 3:
        if parts[1] in ("q_norm", "k_norm") and parts[2] == "weight":
            return [Slot((*base, "self_attn", parts[1], "weight"), (repeat,), "same")]
        if parts[2] == "weight":
            return [Slot((*base, "self_attn", parts[1], "kernel"), (repeat,), "T")]
        return [Slot((*base, "self_attn", parts[1], "bias"), (repeat,), "same")]
    if parts[0] not in ("mlp", "block_sparse_moe"):
        return None
    rest = parts[1:]
    moe: Path = (*base, "mlp", "moe")
    if rest in (["gate", "weight"], ["router", "weight"]):
        return [Slot((*moe, "router", "kernel"), (repeat,), "T")]
    if rest[0] == "experts":
        if len(rest) == 4 and rest[1].isdigit() and rest[3] == "weight" \
                and rest[2] in _EXPERT_NAMES:
            return [Slot((*moe, _EXPERT_NAMES[rest[2]]), (repeat, int(rest[1])), "T")]
        if rest[1:] == ["gate_up_proj"]:
            return [Slot((*moe, "w_gate"), (repeat,), "gate"),
                    Slot((*moe, "w_up"), (repeat,), "up")]
        if rest[1:] == ["down_proj"]:
            return [Slot((*moe, "w_down"), (repeat,), "down")]
        return None
    if parts[0] == "mlp" and len(rest) == 2 and rest[1] == "weight":  # dense MLP
        return [Slot((*base, "mlp", rest[0], "kernel"), (repeat,), "T")]
    if parts[0] == "mlp" and rest[0] == "shared_expert" and len(rest) == 3:
        return [Slot((*base, "mlp", "shared_expert", rest[1], "kernel"), (repeat,), "T")]
    if parts[0] == "mlp" and rest == ["shared_expert_gate", "weight"]:
        return [Slot((*base, "mlp", "shared_expert_gate", "kernel"), (repeat,), "T")]
    return None


def convert(value: np.ndarray, transform: str) -> np.ndarray:
    """A checkpoint tensor as the model's slice (see :class:`Slot`)."""
    if transform == "same":
        return value
    if transform == "T":
        return value.T
    if transform in ("gate", "up"):  # [N, 2I, emb] -> [N, emb, I]
        half = value.shape[1] // 2
        part = value[:, :half] if transform == "gate" else value[:, half:]
        return np.swapaxes(part, 1, 2)
    return np.swapaxes(value, 1, 2)  # "down": [N, emb, I] -> [N, I, emb]


def saved_tensors(config: LMConfig, layers: list[tuple[int, int, int]]
                  ) -> Iterator[tuple[str, Slot]]:
    """Every tensor a checkpoint of ``config`` holds, in the per-expert layout, in model order:
    ``(name, slot)``; the slot's value transposed back (``"T"``) is the tensor."""
    yield "model.embed_tokens.weight", Slot(("embed_tokens", "embedding"), (), "same")
    prefix, names = _legacy_moe(config.model_type)
    norm_leaves = ("weight",) if config.norm == "rms" else ("weight", "bias")
    for number, (stack, repeat, pos) in enumerate(layers):
        base: Path = ("stacks", stack, "layers", pos)
        layer = f"model.layers.{number}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            for leaf in norm_leaves:
                yield f"{layer}.{norm}.{leaf}", Slot((*base, norm, leaf), (repeat,), "same")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attn = (*base, "self_attn", proj)
            yield f"{layer}.self_attn.{proj}.weight", Slot((*attn, "kernel"), (repeat,), "T")
            if (config.out_bias if proj == "o_proj" else config.qkv_bias):
                yield f"{layer}.self_attn.{proj}.bias", Slot((*attn, "bias"), (repeat,), "same")
        if config.qk_norm != "none":
            for norm in ("q_norm", "k_norm"):
                yield (f"{layer}.self_attn.{norm}.weight",
                       Slot((*base, "self_attn", norm, "weight"), (repeat,), "same"))
        if not config.moe_layers[number]:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{layer}.mlp.{proj}.weight", Slot((*base, "mlp", proj, "kernel"),
                                                         (repeat,), "T")
            continue
        moe = (*base, "mlp", "moe")
        yield f"{layer}.{prefix}.gate.weight", Slot((*moe, "router", "kernel"), (repeat,), "T")
        for expert in range(config.num_experts):
            for param in ("w_gate", "w_up", "w_down"):
                yield (f"{layer}.{prefix}.experts.{expert}.{names[param]}.weight",
                       Slot((*moe, param), (repeat, expert), "T"))
        if config.shared_expert_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield (f"{layer}.mlp.shared_expert.{proj}.weight",
                       Slot((*base, "mlp", "shared_expert", proj, "kernel"), (repeat,), "T"))
            yield (f"{layer}.mlp.shared_expert_gate.weight",
                   Slot((*base, "mlp", "shared_expert_gate", "kernel"), (repeat,), "T"))
    yield "model.norm.weight", Slot(("norm", "weight"), (), "same")
    if config.norm == "layer":
        yield "model.norm.bias", Slot(("norm", "bias"), (), "same")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", Slot(("lm_head", "kernel"), (), "T")
        if config.lm_head_bias:
            yield "lm_head.bias", Slot(("lm_head", "bias"), (), "same")
