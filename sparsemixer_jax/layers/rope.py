"""Rotary position embeddings of :class:`sparsemixer_jax.models.causal_lm.CausalLM`: their
settings (:class:`RopeConfig`, a field of the model's config), the frequencies of each kind
(default, Phi-3.5-MoE's longrope, gpt-oss's YaRN, Llama 3's llama3) and the rotation, as
transformers 5.23 computes them (``modeling_rope_utils.py``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    Attributes:
      theta: the base wavelength (``rope_theta``).
      kind: ``"default"``, ``"longrope"`` (Phi-3 / Phi-3.5-MoE), ``"yarn"`` (gpt-oss) or
        ``"llama3"`` (Llama 3.1 / 4's frequency bands: :func:`llama3_inv_freq`).
      short_factor, long_factor: longrope's per-frequency divisors (``head_dim / 2`` each).
      short_mscale, long_mscale: longrope's scales of cos/sin below / above
        ``original_max_position_embeddings``.
      original_max_position_embeddings: longrope's switch point; YaRN's and llama3's
        pretraining length.
      low_freq_factor, high_freq_factor: llama3's band edges (wavelengths of
        ``original_max_position_embeddings`` divided by each).
      factor, beta_fast, beta_slow, truncate: YaRN's context extension factor, the rotation
        counts bounding its correction range, and whether that range is rounded outwards
        (:func:`sparsemixer_jax.layers.rope.yarn_inv_freq`).
      attention_factor: YaRN's scale of cos and sin.
      mscale_all_dim: YaRN's ``mscale_all_dim``; latent attention (DeepSeek-V3) multiplies its
        softmax scale by ``(0.1 * mscale_all_dim * ln(factor) + 1)^2`` where it is non-zero
        (other types read it into ``attention_factor`` only).
      partial_rotary_factor: the fraction of each head's width that is rotated (the first
        ``int(head_dim * factor)`` dimensions; the rest pass unrotated: GLM-4.5).
    """

    theta: float = 10000.0
    kind: Literal["default", "longrope", "yarn", "llama3"] = "default"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float = 1.0
    long_mscale: float = 1.0
    original_max_position_embeddings: int = 0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    mscale_all_dim: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


def yarn_inv_freq(rope: RopeConfig, dim: int) -> jax.Array:
    """YaRN's frequencies ``[dim / 2]`` (float32): each frequency ``1 / theta^(2i / dim)`` is
    kept (dimensions below the correction range), divided by ``factor`` (above it), or
    blended linearly in between. The range is where a dimension turns ``beta_fast`` to
    ``beta_slow`` times over ``original_max_position_embeddings`` positions; ``truncate``
    rounds it outwards to whole dimensions (gpt-oss's checkpoints say false)."""
    def correction_dim(rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    wavelengths = rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation, interpolation = 1.0 / wavelengths, 1.0 / (rope.factor * wavelengths)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def llama3_inv_freq(rope: RopeConfig, dim: int) -> jax.Array:
    """llama3's frequencies ``[dim / 2]`` (float32): each frequency ``1 / theta^(2i / dim)``
    whose wavelength is shorter than ``L / high_freq_factor`` is kept, one longer than ``L /
    low_freq_factor`` divided by ``factor``, and one in between blended, weighting the kept
    frequency by ``(L / wavelength - low_freq_factor) / (high_freq_factor -
    low_freq_factor)`` (``L``: ``original_max_position_embeddings``)."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    length = rope.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low, high = rope.low_freq_factor, rope.high_freq_factor
    long = jnp.where(wavelength > length / low, inv_freq / rope.factor, inv_freq)
    # Equal factors (Llama 4 Scout's): no band between, nothing blended.
    kept = (length / wavelength - low) / (high - low if high > low else 1.0)
    blended = (1 - kept) * long / rope.factor + kept * long
    middle = (wavelength >= length / high) & (wavelength <= length / low) & (high > low)
    return jnp.where(middle, blended, long)


def rope_cos_sin(rope: RopeConfig, rotary_dim: int, positions: jax.Array,
                 num_positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[B, T, head_dim]`` (float32) of the rotary embedding at int ``positions``
    ``[B, T]``: frequencies ``1 / theta^(2i / d)``, each used twice (``rotate_half`` layout);
    ``d`` is the rotated width ``rotary_dim``
    (:attr:`~sparsemixer_jax.models.lm_config.LMArchitecture.rotary_dim`: ``head_dim`` times
    ``partial_rotary_factor``, or latent attention's ``qk_rope_head_dim``).

    longrope (Phi-3.5-MoE) divides the frequencies by ``short_factor`` and scales cos/sin by
    ``short_mscale``, or ``long_mscale`` once ``num_positions`` (the largest position of the
    call plus one) exceeds ``original_max_position_embeddings``. As in transformers 5.23's
    ``phimoe``, the frequencies keep the short factors beyond that point; only the scale
    switches. YaRN (gpt-oss) takes :func:`yarn_inv_freq` and scales cos/sin by
    ``attention_factor``; llama3 takes :func:`llama3_inv_freq`.
    """
    d = rotary_dim
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    scale = jnp.ones((), jnp.float32)
    if rope.kind == "longrope":
        inv_freq = inv_freq / jnp.asarray(rope.short_factor, jnp.float32)
        if num_positions is None:
            num_positions = jnp.max(positions) + 1
        long = num_positions > rope.original_max_position_embeddings
        scale = jnp.where(long, rope.long_mscale, rope.short_mscale).astype(jnp.float32)
    elif rope.kind == "yarn":
        inv_freq = yarn_inv_freq(rope, d)
        scale = jnp.asarray(rope.attention_factor, jnp.float32)
    elif rope.kind == "llama3":
        inv_freq = llama3_inv_freq(rope, d)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """The factor DeepSeek-V3's latent attention multiplies its softmax scale by:
    ``(0.1 * mscale_all_dim * ln(factor) + 1)^2`` under a scaled rope with a non-zero
    ``mscale_all_dim`` and ``factor > 1``, else 1 (transformers 5.23's ``yarn_apply_mscale``)."""
    if rope.kind == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2


def deinterleave(x: jax.Array) -> jax.Array:
    """``x [..., R]`` with its rotary pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout)
    reordered to halves ``(x0, x2, ...), (x1, x3, ...)``, the layout :func:`apply_rope`
    rotates: rotating the reordered query and key gives the interleaved rotation's dot
    products (transformers' ``apply_rotary_pos_emb_interleave`` returns this order too)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, H, D]`` rotated: ``x cos + rotate_half(x) sin`` (cos/sin ``[B, T, R]``): the
    first ``R`` dimensions of each head, the rest passed through (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
