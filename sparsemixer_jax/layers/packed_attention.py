"""Packed documents for cuDNN's fused attention as segment offsets instead of a mask.

A packed row holds several documents (``segment_ids``, :meth:`CausalLM.forward
<sparsemixer_jax.models.causal_lm.CausalLM.forward>`), and a token attends only to earlier
tokens of its own document. ``jax.nn.dot_product_attention(implementation="cudnn")`` takes
that as a boolean mask, which it turns into an additive bias ``[B, 1, T, S]`` that the kernel
reads for every head and tile. cuDNN's packed ("THD") layout takes the documents instead as
per-row offsets and lengths, with a causal mask within each: :func:`segment_layout` computes
them, :func:`packed_attention` passes them.

JAX's public ``jax.nn.dot_product_attention`` has no offsets argument (it takes one length per
row), so :func:`packed_attention` calls the function behind it,
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, a private API;
``tests/test_packed_attention.py`` pins the arguments it uses, so a JAX release that changes them
fails there instead of here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention


class SegmentLayout(NamedTuple):
    """Each row's segments as cuDNN's packed layout takes them (a pytree of arrays).

    A segment is a maximal run of positions with the same segment id that are all real tokens,
    or all padding (padding's own segment: its outputs are never used, but stay finite).

    Attributes:
      lengths: int32 ``[B, M]``, the length of each of a row's segments in order, then -1.
      offsets: int32 ``[B, M + 1]``, the position each segment starts at, then -1.
      fits: bool scalar: every row has at most ``M`` segments and no real segment id occurs in
        two runs of a row, so that the layout gives exactly the mask of segment ids
        (:func:`segment_layout`). Where False the caller must take the mask instead.
    """

    lengths: jax.Array
    offsets: jax.Array
    fits: jax.Array


def segment_layout(segment_ids: jax.Array, real: jax.Array, max_segments: int) -> SegmentLayout:
    """The :class:`SegmentLayout` of ``segment_ids`` int ``[B, T]`` with token mask ``real``
    bool ``[B, T]`` (False: padding), for at most ``max_segments`` (``M``) segments per row.

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
    bounds = jax.vmap(lambda r: jnp.searchsorted(r, jnp.arange(max_segments + 1),
                                                 side="left"))(run).astype(jnp.int32)
    index = jnp.arange(max_segments + 1)
    lengths = jnp.where(index[:-1] < count[:, None], bounds[:, 1:] - bounds[:, :-1], -1)
    offsets = jnp.where(index < count[:, None], bounds, -1)
    # A real id in two runs of a row (e.g. 1 1 2 1) would attend across the runs in the mask:
    # sort the real runs' ids (other positions last) and look for equal neighbours.
    first_of_real_run = (starts & real).astype(jnp.int32)
    other, ids = jax.lax.sort((1 - first_of_real_run, segment_ids), dimension=1, num_keys=2)
    repeated = (other[:, 1:] == 0) & (other[:, :-1] == 0) & (ids[:, 1:] == ids[:, :-1])
    fits = jnp.all(count <= max_segments) & ~jnp.any(repeated)
    return SegmentLayout(lengths.astype(jnp.int32), offsets.astype(jnp.int32), fits)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout,
                     scale: float) -> jax.Array:
    """cuDNN's fused attention of ``q [B, T, H, D]`` over ``k, v [B, T, KV, D]`` (16-bit)
    within each segment of ``layout``, causal: ``[B, T, H, D]``. Use only where
    ``layout.fits``. Positions outside every segment do not occur (the segments cover each
    row)."""
    return cudnn_attention.dot_product_attention(
        q, k, v, q_seqlen=layout.lengths, kv_seqlen=layout.lengths, q_offsets=layout.offsets,
        kv_offsets=layout.offsets, scale=scale,
        mask_type=cudnn_attention.MaskType.PADDING_CAUSAL)


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
