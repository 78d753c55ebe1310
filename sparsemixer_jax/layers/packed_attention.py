"""Packed documents for cuDNN's fused attention as segment offsets instead of a mask.

A packed row holds several documents (``segment_ids``, :meth:`CausalLM.forward
<sparsemixer_jax.models.causal_lm.CausalLM.forward>`), and a token attends only to earlier
tokens of its own document. ``jax.nn.dot_product_attention(implementation="cudnn")`` takes
that as a boolean mask, which it turns into an additive bias ``[B, 1, T, S]`` that the kernel
reads for every head and tile. cuDNN's packed ("THD") layout takes the documents instead as
per-row offsets and lengths, with a causal mask within each: :func:`segment_layout` computes
them once a forward pass, :func:`packed_attention` passes them to every layer's call.

JAX's public ``jax.nn.dot_product_attention`` has no offsets argument (it takes one length per
row), so :func:`packed_attention` calls what is behind it in
``jax._src.cudnn.fused_attention_stablehlo``, a private API. Its entry point
(``dot_product_attention``) turns the per-row offsets into the flat form cuDNN reads at every
call, forward and backward, about 15 small kernels a call; on one device
:func:`packed_attention` binds the kernels' primitives itself and passes the flat form that
:func:`segment_layout` computed once, outside the layer scan. ``tests/test_packed_attention.py``
pins what it uses, so a JAX release that changes it fails there instead of here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["lengths", "offsets", "fits", "flat_lengths", "flat_q_offsets",
                                "flat_kv_offsets"], meta_fields=["widths"])
@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Each row's segments as cuDNN's packed layout takes them (a pytree of arrays).

    A segment is a maximal run of positions with the same segment id that are all real tokens,
    or all padding (padding's own segment: its outputs are never used, but stay finite).

    Attributes:
      lengths: int32 ``[B, M]``, the length of each of a row's segments in order, then -1.
      offsets: int32 ``[B, M + 1]``, the position each segment starts at, then -1.
      fits: bool scalar: every row has at most ``M`` segments and no real segment id occurs in
        two runs of a row, so that the layout gives exactly the mask of segment ids
        (:func:`segment_layout`). Where False the attention is not the mask's: the language
        model's logits are NaN (:func:`check_rows_fit` refuses such rows before a run).
      flat_lengths: int32 ``[B, M]``: cuDNN's form of ``lengths``: every row's segments'
        lengths in row order from the start of the array, then 0.
      flat_q_offsets, flat_kv_offsets: int32 ``[B, M + 1]``: cuDNN's form of ``offsets``:
        where each segment starts among the ``B * T`` positions of all rows, in the same
        order, then ``B * T``, times the width of a query or key token (``widths``).
      widths: ``(query heads * head width, key/value heads * head width)`` (static).
    """

    lengths: jax.Array
    offsets: jax.Array
    fits: jax.Array
    flat_lengths: jax.Array
    flat_q_offsets: jax.Array
    flat_kv_offsets: jax.Array
    widths: tuple[int, int] = (1, 1)


def segment_layout(segment_ids: jax.Array, real: jax.Array, max_segments: int,
                   widths: tuple[int, int] = (1, 1)) -> SegmentLayout:
    """The :class:`SegmentLayout` of ``segment_ids`` int ``[B, T]`` with token mask ``real``
    bool ``[B, T]`` (False: padding), for at most ``max_segments`` (``M``) segments per row,
    for an attention of query and key token ``widths`` (:attr:`SegmentLayout.widths`).

    Where ``fits``, a real query at ``q`` attends under the layout to the keys ``k <= q`` of its
    own segment, which are exactly those of the language model's mask (causal, real keys, same
    segment id): a real key ``k <= q`` with ``q``'s id lies in ``q``'s run when the id has one
    run in the row. Padding queries attend to earlier padding of their run (the mask gives them
    no key at all); their outputs are never used.
    """
    b = segment_ids.shape[0]
    real = real.astype(bool)
    # A run starts at position 0 and wherever realness changes, or the id between real tokens.
    change = (real[:, 1:] != real[:, :-1]) | (real[:, 1:] & (segment_ids[:, 1:]
                                                             != segment_ids[:, :-1]))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # each position's run, 0, 1, ...
    count = run[:, -1] + 1
    # Where run r starts (t for r >= count): run is sorted along the row.
    # (compare_all: one fused comparison instead of a loop of small kernels.)
    bounds = jax.vmap(lambda r: jnp.searchsorted(r, jnp.arange(max_segments + 1), side="left",
                                                 method="compare_all"))(run).astype(jnp.int32)
    index = jnp.arange(max_segments + 1)
    lengths = jnp.where(index[:-1] < count[:, None], bounds[:, 1:] - bounds[:, :-1], -1)
    offsets = jnp.where(index < count[:, None], bounds, -1)
    # A real id in two runs of a row (e.g. 1 1 2 1) would attend across the runs in the mask:
    # compare the ids that start the row's first M real runs pairwise (a row of more does not
    # fit anyway). Small arrays, fused into few kernels: this runs once a forward pass.
    first = jnp.minimum(bounds[:, :-1], segment_ids.shape[1] - 1)
    first_id = jnp.take_along_axis(segment_ids, first, axis=1)
    first_real = jnp.take_along_axis(real, first, axis=1) & (index[:-1] < count[:, None])
    earlier = index[:-1, None] < index[None, :-1]
    repeated = earlier & first_real[:, :, None] & first_real[:, None, :] & (
        first_id[:, :, None] == first_id[:, None, :])
    fits = jnp.all(count <= max_segments) & ~jnp.any(repeated)
    lengths, offsets = lengths.astype(jnp.int32), offsets.astype(jnp.int32)
    # cuDNN's flat form (what JAX's entry point computes at every call): the rows' segments
    # one after another from the start of the array, each offset shifted by its row's start.
    # Flat slot p holds segment i = p - (the slots of the rows before) of the row whose slots
    # cover p; the rows are few, so a sum over them (no reduction kernel) finds it.
    t = segment_ids.shape[1]
    ends = jnp.cumsum(jnp.minimum(count, max_segments))  # the slots of the rows up to each
    p = jnp.arange(b * (max_segments + 1))
    row = sum((p >= ends[i]).astype(jnp.int32) for i in range(b))
    valid = row < b
    row = jnp.minimum(row, b - 1)
    i = p - (ends[row] - jnp.minimum(count, max_segments)[row])
    flat_starts = jnp.where(valid, offsets[row, i] + row * t, b * t).astype(jnp.int32)
    flat_starts = flat_starts.reshape(b, max_segments + 1)
    flat_lengths = jnp.where(valid, lengths[row, jnp.minimum(i, max_segments - 1)], 0)
    flat_lengths = flat_lengths[:b * max_segments].astype(jnp.int32)
    # In elements, as cuDNN reads them: computed here, once, so that no layer's call (nor its
    # recomputation in the backward pass) multiplies them again.
    return SegmentLayout(lengths, offsets, fits, flat_lengths.reshape(b, max_segments),
                         flat_starts * widths[0], flat_starts * widths[1], tuple(widths))


def check_rows_fit(segment_ids: np.ndarray, token_mask: np.ndarray, max_segments: int,
                   where: str) -> None:
    """Raises ValueError (one line naming the first such row of ``where`` and the limit) where
    a row of ``segment_ids`` int ``[B, T]`` (``token_mask`` bool ``[B, T]``, False: padding)
    holds more than ``max_segments`` segments, or a real segment id in two runs: cuDNN's packed
    layout (``model.cudnn_document_mask="offsets"``) cannot give such a row the mask of its
    segment ids (:func:`segment_layout`)."""
    ids, real = np.asarray(segment_ids), np.asarray(token_mask, bool)
    starts = np.ones(ids.shape, bool)
    starts[:, 1:] = (real[:, 1:] != real[:, :-1]) | (real[:, 1:] & (ids[:, 1:] != ids[:, :-1]))
    counts = starts.sum(axis=1)
    for row, count in enumerate(counts):
        first_ids = ids[row][starts[row] & real[row]]
        if count > max_segments or len(np.unique(first_ids)) < len(first_ids):
            raise ValueError(
                f"{where}: row {row} holds {count} segments (documents and padding runs)"
                f"{'' if count > max_segments else ', a document id in two runs'}; "
                f"model.cudnn_document_mask='offsets' takes at most "
                f"model.max_segments_per_row={max_segments} a row, each id in one run: raise "
                f"it or set model.cudnn_document_mask='bias'")


_MASK_TYPE = cudnn_attention.MaskType.PADDING_CAUSAL
_LAYOUT = cudnn_attention.AttentionLayout.BTNH.value
# What the kernels' primitives take besides the arrays: no dropout, no bias, no window.
_STATIC = {"seed": 0, "dropout_rate": 0.0, "variadic_args": (False, False),
           "mask_type": _MASK_TYPE, "layout": _LAYOUT, "sliding_window_length": None}


def _operands(q: jax.Array, k: jax.Array, layout: SegmentLayout) -> tuple[jax.Array, ...]:
    """bias, lengths, offsets and page tables as the primitives take them."""
    empty = jnp.zeros(0, q.dtype)
    lengths = layout.flat_lengths
    return (empty, lengths, lengths, layout.flat_q_offsets, layout.flat_kv_offsets, empty,
            empty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flat_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout,
                    scale: float) -> jax.Array:
    return cudnn_attention._dot_product_attention_fwd_p.bind(
        q, k, v, *_operands(q, k, layout), scale=scale, is_training=False, **_STATIC)[0]


def _flat_attention_fwd(q, k, v, layout, scale):
    out, stats = cudnn_attention._dot_product_attention_fwd_p.bind(
        q, k, v, *_operands(q, k, layout), scale=scale, is_training=True, **_STATIC)
    return out, (q, k, v, layout, out, stats)


def _flat_attention_bwd(scale, residuals, grad):
    q, k, v, layout, out, stats = residuals
    dq, dk, dv = cudnn_attention._dot_product_attention_bwd_p.bind(
        q, k, v, *_operands(q, k, layout), stats, out, grad, scale=scale, **_STATIC)[:3]
    return dq, dk, dv, None  # the layout is integers: no gradient


_flat_attention.defvjp(_flat_attention_fwd, _flat_attention_bwd)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout,
                     scale: float, *, sharded: bool = False) -> jax.Array:
    """cuDNN's fused attention of ``q [B, T, H, D]`` over ``k, v [B, T, KV, D]`` (16-bit)
    within each segment of ``layout``, causal: ``[B, T, H, D]``; exact where ``layout.fits``.
    Positions outside every segment do not occur (the segments cover each row).

    ``sharded``: the rows are split over several devices; then JAX's entry point, whose
    partitioning rule splits the call by rows, computes cuDNN's flat form of each device's
    rows at every call. Otherwise the kernels take ``layout``'s flat form as it is."""
    if sharded:
        return cudnn_attention.dot_product_attention(
            q, k, v, q_seqlen=layout.lengths, kv_seqlen=layout.lengths,
            q_offsets=layout.offsets, kv_offsets=layout.offsets, scale=scale,
            mask_type=_MASK_TYPE)
    # The entry point's checks (a cuDNN, a Hopper or later GPU for the packed layout, the
    # head width), then the kernels.
    version = cudnn_attention.check_cudnn_version()
    cudnn_attention.check_layout(q, k, v, None, layout.lengths, layout.lengths, layout.offsets,
                                 layout.offsets, None, None,
                                 cudnn_attention.AttentionLayout.BTNH)
    cudnn_attention.check_is_flash_attention(q, k, v, _LAYOUT, version, False, True, True)
    widths = (q.shape[2] * q.shape[3], k.shape[2] * q.shape[3])
    if layout.widths != widths:
        raise ValueError(f"segment_layout(widths={layout.widths}) for an attention of token "
                         f"widths {widths} (heads times head width of queries, keys)")
    return _flat_attention(q, k, v, layout, scale)


@contextlib.contextmanager
def compute_capability_of(device: jax.Device) -> Iterator[None]:
    """Within the block, the packed layout's check for a Hopper or later GPU reads ``device``'s
    compute capability instead of the local GPU's: a compile-only device
    (:mod:`sparsemixer_jax.aot`) has no local GPU to ask. Does nothing for other devices."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        yield
        return
    have = tuple(int(x) for x in str(capability).split("."))

    def at_least(needed: str) -> bool:
        return have >= tuple(int(x) for x in needed.split("."))

    with mock.patch.object(cudnn_attention, "check_compute_capability", at_least):
        yield
