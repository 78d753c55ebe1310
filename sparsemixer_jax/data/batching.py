"""Tokenized pairs -> length-bucketed batches of ``inputs [B, L]`` and ``targets [B, L]``.

Batches are dicts of numpy ``int32`` arrays, 0-padded, both sides ending with EOS. ``L`` is a
bucket length and ``B`` the bucket's batch size, chosen so that ``B * L <= max_tokens``; the set
of shapes is small and fixed, so ``jit`` compiles once per bucket. One exception: evaluation keeps
sentences longer than ``max_len`` in extra, longer buckets, and a batch never has fewer rows than
the batch multiple (the device count), so a validation or test sentence longer than
``max_tokens / multiple`` makes a batch over ``max_tokens`` (the training split drops such pairs).
A batch whose bucket ran short is filled with all-padding rows (every id 0): the loss must weight
tokens by ``targets != 0`` -- which it does anyway -- and attention must survive fully masked rows.

Multi-host: every host builds the same *global* batch (same seed, same data) and keeps rows
``[p * B / P, (p + 1) * B / P)`` where ``p = process_index`` and ``P = process_count``. The global
batch (hence training) is therefore identical whatever the number of hosts; batch sizes are
multiples of ``lcm(batch_multiple, process_count)`` so every host gets the same number of rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sparsemixer_jax.data import Pair
from sparsemixer_jax.data.tokenizer import Tokenizer
from sparsemixer_jax.token_ids import EOS_ID, PAD_ID

Batch = dict[str, np.ndarray]


# -----------------------------------------------------------------------------------------------
# Tokenized examples.
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TokenizedPairs:
    """``N`` tokenized pairs stored flat (one id array per side plus offsets) to keep memory low.

    Example ``i`` is ``src_ids[src_offsets[i]:src_offsets[i + 1]]`` (ends with EOS), likewise for
    the target; ``index[i]`` is its position among the split's non-empty pairs.
    """

    src_ids: np.ndarray  # [total source tokens]
    src_offsets: np.ndarray  # [N + 1] int64
    tgt_ids: np.ndarray  # [total target tokens]
    tgt_offsets: np.ndarray  # [N + 1] int64
    index: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """[N] int: ``max(source length, target length)``, EOS included -- the bucketing key."""
        return np.maximum(np.diff(self.src_offsets), np.diff(self.tgt_offsets))

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]


def _flatten(seqs: list[list[int]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.fromiter((t for s in seqs for t in s), dtype=dtype, count=int(offsets[-1]))
    return flat, offsets


def drop_empty(pairs: Sequence[Pair]) -> tuple[list[Pair], int]:
    """Pairs whose sides both have non-space text, and how many were dropped."""
    kept = [p for p in pairs if p[0].strip() and p[1].strip()]
    return kept, len(pairs) - len(kept)


def tokenize_pairs(
    tokenizer: Tokenizer, pairs: Sequence[Pair], max_len: int | None, chunk: int = 100_000
) -> tuple[TokenizedPairs, int]:
    """Tokenizes non-empty ``pairs`` (each side + EOS); drops pairs with a side over ``max_len``.

    Returns the examples and the number dropped for length (0 when ``max_len`` is None).
    """
    # uint16 halves the memory of a WMT-sized corpus when the vocabulary allows it.
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    srcs: list[list[int]] = []
    tgts: list[list[int]] = []
    index: list[int] = []
    too_long = 0
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        enc_src = tokenizer.encode_batch([p[0] for p in part])
        enc_tgt = tokenizer.encode_batch([p[1] for p in part])
        for k, (s, t) in enumerate(zip(enc_src, enc_tgt, strict=True)):
            if max_len is not None and max(len(s), len(t)) + 1 > max_len:
                too_long += 1
                continue
            srcs.append([*s, EOS_ID])
            tgts.append([*t, EOS_ID])
            index.append(start + k)
    src_ids, src_offsets = _flatten(srcs, dtype)
    tgt_ids, tgt_offsets = _flatten(tgts, dtype)
    return TokenizedPairs(
        src_ids, src_offsets, tgt_ids, tgt_offsets, np.asarray(index, np.int64)
    ), too_long


# -----------------------------------------------------------------------------------------------
# Buckets and batches.
# -----------------------------------------------------------------------------------------------
def _next_bucket(length: int, ratio: float, step: int) -> int:
    return int(math.ceil(max(length + step, length * ratio) / step) * step)


def bucket_lengths(
    max_len: int, *, min_len: int = 8, ratio: float = 1.25, step: int = 8
) -> list[int]:
    """Padded lengths 8, 16, 24, ... growing ~``ratio``x (multiples of ``step``), last ``max_len``.

    ``max_len=256`` gives 13 buckets: 8 16 24 32 40 56 72 96 120 152 192 240 256. Geometric growth
    keeps padding under ~25% while the number of compiled shapes stays small.
    """
    lengths = []
    length = min(min_len, max_len)
    while length < max_len:
        lengths.append(length)
        length = _next_bucket(length, ratio, step) if length >= 32 else length + step
    lengths.append(max_len)
    return lengths


def extend_buckets(
    lengths: list[int], longest: int, *, ratio: float = 1.25, step: int = 8
) -> list[int]:
    """``lengths`` plus more (same growth rule) until one holds ``longest`` -- for eval only."""
    lengths = list(lengths)
    while lengths[-1] < longest:
        lengths.append(_next_bucket(lengths[-1], ratio, step))
    return lengths


def bucket_batch_size(length: int, max_tokens: int, multiple: int) -> int:
    """Largest multiple of ``multiple`` with ``size * length <= max_tokens`` (>= ``multiple``)."""
    return max(multiple, (max_tokens // length) // multiple * multiple)


def assign_buckets(examples: TokenizedPairs, lengths: Sequence[int]) -> np.ndarray:
    """[N] int: the first bucket whose length holds each example (both sides)."""
    bucket = np.searchsorted(np.asarray(lengths), examples.lengths, side="left")
    if len(examples) and bucket.max() >= len(lengths):
        raise ValueError(
            f"an example of length {examples.lengths.max()} exceeds the last bucket {lengths[-1]}"
        )
    return bucket


def make_batch(
    examples: TokenizedPairs,
    rows: Sequence[int],
    batch_size: int,
    length: int,
    lo: int = 0,
    hi: int | None = None,
    with_index: bool = False,
) -> Batch:
    """Rows ``[lo, hi)`` of the global ``[batch_size, length]`` batch of ``examples[rows]``.

    Returns ``inputs [hi - lo, length]`` and ``targets [hi - lo, length]`` int32 (0-padded; rows
    past ``len(rows)`` are all padding), plus ``index [hi - lo]`` int32 (the example's position
    among the split's non-empty pairs, -1 for padding rows) when ``with_index``.
    """
    hi = batch_size if hi is None else hi
    inputs = np.zeros((hi - lo, length), np.int32)
    targets = np.zeros((hi - lo, length), np.int32)
    index = np.full((hi - lo,), -1, np.int32)
    for r in range(lo, min(hi, len(rows))):
        i = rows[r]
        src, tgt = examples.src(i), examples.tgt(i)
        inputs[r - lo, : len(src)] = src
        targets[r - lo, : len(tgt)] = tgt
        index[r - lo] = examples.index[i]
    batch = {"inputs": inputs, "targets": targets}
    if with_index:
        batch["index"] = index
    return batch


def batch_counts(batch: Batch) -> dict[str, int]:
    """Real (non-padding) examples and tokens in a batch: throughput and loss normalizers."""
    return {
        "examples": int((batch["inputs"][:, 0] != PAD_ID).sum()),
        "src_tokens": int((batch["inputs"] != PAD_ID).sum()),
        "tgt_tokens": int((batch["targets"] != PAD_ID).sum()),
    }


def _host_rows(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """This host's contiguous row range ``[lo, hi)`` of a global batch of ``batch_size`` rows."""
    per_host = batch_size // process_count
    return process_index * per_host, (process_index + 1) * per_host


class TrainBatches:
    """Infinite, seeded, resumable iterator over this host's share of the training batches.

    Epoch ``e`` is built from ``rng = default_rng([seed, e])``: each bucket's examples are shuffled
    and cut into batches of the bucket's size (the last one topped up with padding rows), then the
    order of all the epoch's batches is shuffled. ``state()`` is
    ``{"epoch", "index", "num_batches"}`` (``index`` = the next batch within the epoch);
    ``restore(state)`` continues exactly where an uninterrupted iterator would. Each ``next()``
    returns ``inputs``/``targets`` of shape
    ``[B / process_count, L]`` for one of the fixed ``shapes``.
    """

    def __init__(
        self,
        examples: TokenizedPairs,
        lengths: Sequence[int],
        batch_sizes: Sequence[int],
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if len(examples) == 0:
            raise ValueError("no training examples left after dropping empty and over-long pairs")
        self.examples = examples
        self.lengths = list(lengths)
        self.batch_sizes = list(batch_sizes)
        self.seed = seed
        self.process_index, self.process_count = process_index, process_count
        bucket = assign_buckets(examples, self.lengths)
        self._members = [np.flatnonzero(bucket == b) for b in range(len(self.lengths))]
        self.num_batches = sum(
            math.ceil(len(m) / bs) for m, bs in zip(self._members, self.batch_sizes, strict=True)
        )
        self._epoch, self._index = 0, 0
        self._plan: list[tuple[int, np.ndarray]] | None = None

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Local ``(rows, length)`` of the buckets that occur in the data."""
        return [
            (bs // self.process_count, length)
            for length, bs, m in zip(self.lengths, self.batch_sizes, self._members, strict=True)
            if len(m)
        ]

    def epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """The epoch's global batches as ``(bucket, example rows)``, in iteration order."""
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for b, members in enumerate(self._members):
            shuffled = rng.permutation(members)
            size = self.batch_sizes[b]
            batches += [(b, shuffled[s : s + size]) for s in range(0, len(shuffled), size)]
        order = rng.permutation(len(batches))
        return [batches[k] for k in order]

    def state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "num_batches": self.num_batches}

    def restore(self, state: dict[str, int]) -> None:
        if "num_batches" in state and int(state["num_batches"]) != self.num_batches:
            raise ValueError(
                f"data state was saved with {int(state['num_batches'])} batches per epoch but this "
                f"data has {self.num_batches}: the data, vocabulary or batching config, or the "
                "number of devices (batches are multiples of it), changed"
            )
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._plan = None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._index >= self.num_batches:
            self._epoch, self._index, self._plan = self._epoch + 1, 0, None
        if self._plan is None:
            self._plan = self.epoch_plan(self._epoch)
        b, rows = self._plan[self._index]
        self._index += 1
        lo, hi = _host_rows(self.batch_sizes[b], self.process_index, self.process_count)
        return make_batch(self.examples, rows, self.batch_sizes[b], self.lengths[b], lo, hi)


def eval_batches(
    examples: TokenizedPairs,
    lengths: Sequence[int],
    batch_sizes: Sequence[int],
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> list[Batch]:
    """All ``examples`` as a fixed list of batches (by bucket, file order within a bucket).

    Each batch has ``inputs``/``targets [B / process_count, L]`` and ``index [B / process_count]``:
    the example's position in the split's source/reference lists (-1 for padding rows), so outputs
    can be put back in file order (:func:`restore_order`).
    """
    bucket = assign_buckets(examples, lengths)
    batches = []
    for b, (length, size) in enumerate(zip(lengths, batch_sizes, strict=True)):
        members = np.flatnonzero(bucket == b)
        lo, hi = _host_rows(size, process_index, process_count)
        for s in range(0, len(members), size):
            batches.append(make_batch(examples, members[s : s + size], size, length, lo, hi, True))
    return batches


def restore_order(batches: Sequence[Batch], outputs: Sequence[Sequence[Any]], n: int) -> list[Any]:
    """Puts per-row ``outputs`` (one sequence per batch, one item per row) back in file order.

    ``n`` is the number of examples; padding rows (index -1) are dropped. On several hosts, gather
    the rows (or the ``index`` arrays with them) from every host first.
    """
    ordered: list[Any] = [None] * n
    for batch, out in zip(batches, outputs, strict=True):
        for i, item in zip(batch["index"], out, strict=False):
            if i >= 0:
                ordered[int(i)] = item
    return ordered
