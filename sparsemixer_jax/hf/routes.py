"""Routed expert ids from an inference engine, as one int32 array ``[tokens, MoE layers, top_k]``.

Routing replay for MoE reinforcement learning scores a rollout through the experts that were
chosen when it was sampled. The engines return those choices as follows (read from their
source and documentation):

- vLLM (``--enable-return-routed-experts``). The first form (``vllm/outputs.py`` and
  ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``, vllm-project/vllm) puts
  one numpy array ``[tokens, num_hidden_layers, num_experts_per_tok]`` on each
  ``CompletionOutput.routed_experts``, the prompt's rows included; its capture buffer is int32
  and zero-filled, and only the MoE layers write their rows, so a dense layer's rows hold zeros.
  Later releases (``docs/training/routed_experts_replay.md``, vLLM 0.21) split it:
  ``RequestOutput.prompt_routed_experts`` ``[prompt_len, num_moe_layers, top_k]`` shared by
  the completions, and each completion's ``routed_experts`` ``[gen_len, num_moe_layers,
  top_k]``, int16 ids in ``[0, num_experts)``; some builds send smaller unsigned types, and the
  last generated token, never fed back through the model, may have no row.
- SGLang (``--enable-return-routed-experts`` and ``return_routed_experts`` per request): a base64
  string in ``meta_info["routed_experts"]`` (``sgl_ext`` on OpenAI responses), the bytes of an
  int32 array ``[tokens, num_hidden_layers, num_experts_per_tok]`` flattened in C order, the
  prompt's tokens first (``python/sglang/srt/layers/moe/routed_experts_capturer.py`` allocates
  the buffer, ``python/sglang/srt/managers/detokenizer_manager.py`` encodes it with numpy's
  ``tobytes``, the host's byte order: little-endian on x86 and Arm servers, which this module
  assumes). Dense layers' rows are zeros there; SGL-JAX writes ``-1`` for them and for slots
  without an expert (sgl-project/sglang-jax ``docs/features/return_routed_experts.md``). By
  default the last token has no row.

The converters keep every row as the engine gives it (no token is added or dropped) and
``-1`` (a slot without an expert) as it is. With the model's :class:`LMConfig` a layer axis of
one row per decoder layer is reduced to the MoE layers, in layer order; a layer axis already of
the MoE layers' count is kept. Without a config the layer axis is taken as the MoE layers.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from sparsemixer_jax.models.lm_config import LMConfig

_INT32_MAX = np.iinfo(np.int32).max


def _moe_layer_flags(config: LMConfig) -> tuple[bool, ...]:
    """One bool per decoder layer, True where the feed-forward sublayer is routed (the one
    place this module reads the config's layer pattern)."""
    return tuple(bool(flag) for flag in config.arch.moe_layers)


def _int_rows(value: ArrayLike, name: str) -> np.ndarray:
    """``value`` as an integer array ``[tokens, layers, top_k]``, or a one-line ValueError."""
    rows = np.asarray(value)
    if rows.dtype == np.bool_ or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"{name} has dtype {rows.dtype}; expected an integer dtype "
                         "(expert ids)")
    if rows.ndim != 3:
        raise ValueError(f"{name} has shape {rows.shape}; expected [tokens, layers, top_k]")
    return rows


def _check_ids(rows: np.ndarray, num_experts: int | None, where: str) -> None:
    """Refuses ids below -1, and ids at or above ``num_experts`` (or past int32 without it)."""
    if rows.size == 0:
        return
    low, high = int(rows.min()), int(rows.max())
    limit = _INT32_MAX + 1 if num_experts is None else num_experts
    if low < -1 or high >= limit:
        bad = low if low < -1 else high
        raise ValueError(f"{where} holds expert id {bad}; expected ids in [-1, {limit}) "
                         "(-1: a slot without an expert)")


def _to_moe_layers(rows: np.ndarray, config: LMConfig | None, where: str) -> np.ndarray:
    """``rows`` ``[tokens, L, K]`` as int32 ``[tokens, MoE layers, K]``, C-contiguous.

    With ``config``: ``L`` one row per decoder layer (the dense layers' rows are dropped) or
    one per MoE layer; ``K`` the config's ``top_k``; ids in ``[-1, num_experts)``.
    """
    if config is None:
        _check_ids(rows, None, where)
        return np.ascontiguousarray(rows, dtype=np.int32)
    flags = _moe_layer_flags(config)
    moe = [i for i, routed in enumerate(flags) if routed]
    layers, top_k = rows.shape[1], rows.shape[2]
    if layers not in (len(flags), len(moe)):
        raise ValueError(f"{where} has shape {rows.shape}: {layers} layers; expected "
                         f"{len(flags)} (one per decoder layer) or {len(moe)} (the MoE layers)")
    if top_k != config.top_k:
        raise ValueError(f"{where} has shape {rows.shape}: top_k={top_k}; the config routes "
                         f"each token to top_k={config.top_k} experts")
    if layers != len(moe):
        rows = rows[:, moe]
    _check_ids(rows, config.num_experts, where)
    return np.ascontiguousarray(rows, dtype=np.int32)


def routes_from_vllm(routed_experts: ArrayLike, prompt_routed_experts: ArrayLike | None = None, *,
                     config: LMConfig | None = None) -> np.ndarray:
    """vLLM's routed expert ids as one int32 array ``[tokens, MoE layers, top_k]``.

    Args:
      routed_experts: a completion's ``routed_experts``, ``[gen_tokens, layers, top_k]`` of any
        integer dtype (zero rows allowed). Where the engine returns no
        ``prompt_routed_experts``, this array already holds the prompt's rows first.
      prompt_routed_experts: the request's ``prompt_routed_experts``,
        ``[prompt_tokens, layers, top_k]``, or None; its rows come first in the result.
      config: the model's :class:`LMConfig`: a ``layers`` axis of one row per decoder layer
        (``num_hidden_layers``) is reduced to the MoE layers; ``top_k`` and the ids are checked
        against it. None: ``layers`` is taken as the MoE layers.

    Returns:
      int32 ``[prompt_tokens + gen_tokens, MoE layers, top_k]``, C-contiguous; ``-1`` kept.

    Raises ValueError in one line for a non-integer dtype, a rank other than 3, parts whose
    layer or top_k axes disagree, a layer count or top_k the config does not have, and ids
    outside ``[-1, num_experts)``.
    """
    rows = _int_rows(routed_experts, "routed_experts")
    if prompt_routed_experts is not None:
        prompt = _int_rows(prompt_routed_experts, "prompt_routed_experts")
        if prompt.shape[1:] != rows.shape[1:]:
            raise ValueError(f"prompt_routed_experts has shape {prompt.shape} and "
                             f"routed_experts {rows.shape}; their [layers, top_k] must agree")
        rows = np.concatenate([prompt, rows], axis=0)
    return _to_moe_layers(rows, config, "vLLM's routed experts")


def routes_from_sglang(data: str | bytes, num_layers: int, top_k: int, *,
                       config: LMConfig | None = None) -> np.ndarray:
    """SGLang's base64 routed expert ids as one int32 array ``[tokens, MoE layers, top_k]``.

    Args:
      data: ``meta_info["routed_experts"]``: base64 of little-endian int32 ids, flat
        ``[tokens, num_layers, top_k]`` in C order (the prompt's tokens first).
      num_layers, top_k: the layer and slot counts the engine wrote (SGLang: the model's
        ``num_hidden_layers`` and ``num_experts_per_tok``).
      config: the model's :class:`LMConfig`: with ``num_layers`` one per decoder layer, the
        rows are reduced to the MoE layers; ``top_k`` and the ids are checked against it. None:
        ``num_layers`` is taken as the MoE layers.

    Returns:
      int32 ``[tokens, MoE layers, top_k]``, C-contiguous; ``-1`` kept.

    Raises ValueError in one line for data that is not base64, a byte count that is not a
    whole number of ``[num_layers, top_k]`` int32 rows, and what :func:`routes_from_vllm`
    refuses.
    """
    for name, value in (("num_layers", num_layers), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, TypeError, ValueError) as err:
        raise ValueError(f"SGLang's routed_experts is not base64 text ({err})") from None
    row_bytes = num_layers * top_k * 4
    if len(raw) % row_bytes:
        raise ValueError(f"SGLang's routed_experts holds {len(raw)} bytes, not a whole number "
                         f"of tokens of num_layers={num_layers} x top_k={top_k} int32 ids "
                         f"({row_bytes} bytes each)")
    rows = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    return _to_moe_layers(rows, config, "SGLang's routed experts")
