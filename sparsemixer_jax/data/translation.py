"""The translation pipeline: raw text pairs -> joint SentencePiece ids -> length-bucketed batches.

:func:`load_datasets` reads the splits (:mod:`.sources`), trains or loads the vocabulary
(:mod:`.tokenizer`) and batches them (:mod:`.batching`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from sparsemixer_jax.data import Pair
from sparsemixer_jax.data.batching import (
    Batch,
    TrainBatches,
    bucket_batch_size,
    bucket_lengths,
    drop_empty,
    eval_batches,
    extend_buckets,
    tokenize_pairs,
)
from sparsemixer_jax.data.sources import DataConfig, read_split
from sparsemixer_jax.data.tokenizer import Tokenizer, get_tokenizer

logger = logging.getLogger(__name__)


# -----------------------------------------------------------------------------------------------
# Everything together.
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Datasets:
    """The tokenizer, the training iterator, eval batches and the raw eval text for BLEU.

    ``valid``/``test`` batches carry ``index`` into ``{valid,test}_sources`` / ``_references``
    (file order, empty lines removed, nothing else removed). ``stats`` holds per-split counts
    (pairs read, empty, too long, kept), the buckets and the batches per epoch.
    """

    tokenizer: Tokenizer
    train: TrainBatches
    valid: list[Batch]
    test: list[Batch]
    valid_sources: list[str]
    valid_references: list[str]
    test_sources: list[str]
    test_references: list[str]
    stats: dict[str, Any]


def _eval_split(
    tokenizer: Tokenizer,
    pairs: list[Pair],
    name: str,
    lengths: list[int],
    max_tokens: int,
    multiple: int,
    max_len: int,
    process_index: int,
    process_count: int,
    stats: dict[str, Any],
) -> tuple[list[Batch], list[str], list[str]]:
    kept, empty = drop_empty(pairs)
    if not kept:
        raise ValueError(
            f"the {name} split has no usable pairs ({len(pairs)} read, {empty} with an empty "
            f"side): check config.data.{name}_prefix and config.data.source"
        )
    examples, _ = tokenize_pairs(tokenizer, kept, max_len=None)
    longest = int(examples.lengths.max()) if len(examples) else 1
    over = int((examples.lengths > max_len).sum())
    # Eval keeps over-long pairs (BLEU is over the whole test set) in extra, longer buckets.
    # lengths[0] is the bucket step (load_datasets starts the buckets at one step).
    eval_lengths = extend_buckets(lengths, longest, step=lengths[0])
    sizes = [bucket_batch_size(n, max_tokens, multiple) for n in eval_lengths]
    batches = eval_batches(
        examples, eval_lengths, sizes, process_index=process_index, process_count=process_count
    )
    stats[name] = {
        "pairs": len(pairs),
        "empty": empty,
        "kept": len(kept),
        "over_max_len_kept": over,
        "batches": len(batches),
    }
    logger.info(
        "%s: %d pairs, %d empty skipped, %d kept (%d longer than max_len=%d, kept), %d batches",
        name,
        len(pairs),
        empty,
        len(kept),
        over,
        max_len,
        len(batches),
    )
    if empty:
        logger.warning("%s: skipped %d pairs with an empty side", name, empty)
    return batches, [p[0] for p in kept], [p[1] for p in kept]


def load_datasets(
    data: DataConfig,
    workdir: str,
    *,
    batch_multiple: int = 1,
    process_index: int | None = None,
    process_count: int | None = None,
    raw_train: list[Pair] | None = None,
) -> Datasets:
    """Reads, tokenizes and batches the train/valid/test splits that ``data`` names.

    Args:
      data: the data section (``config.data`` and ``config.seed``; configs/wmt.py).
      workdir: where the SentencePiece model is cached (``{workdir}/spm.model``).
      batch_multiple: global batch sizes are multiples of this (the data-parallel mesh size).
      process_index, process_count: this host and the number of hosts (default: from JAX). Each
        host gets rows ``[p * B / P, (p + 1) * B / P)`` of every global batch of ``B`` rows.
      raw_train: the train split as :func:`read_split` returns it, if already read.
    """
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    max_len, max_tokens = data.max_len, data.max_tokens
    multiple = math.lcm(int(batch_multiple), int(process_count))
    lengths, sizes = _buckets(data, multiple)

    if raw_train is None:
        raw_train = read_split(data, "train")
    if not any(src.strip() and tgt.strip() for src, tgt in raw_train):
        raise ValueError(
            f"the train split has no usable pairs ({len(raw_train)} read, all with an empty "
            "side): check config.data.train_prefix and config.data.source"
        )
    tokenizer = get_tokenizer(data, workdir, raw_train)
    stats: dict[str, Any] = {
        "vocab_size": tokenizer.vocab_size,
        "buckets": list(zip(lengths, sizes, strict=True)),
    }

    train, stats["train"] = _train_batches(tokenizer, raw_train, data, lengths, sizes,
                                           process_index, process_count)
    del raw_train

    evals = {}
    for name in ("valid", "test"):
        evals[name] = _eval_split(
            tokenizer,
            read_split(data, name),
            name,
            lengths,
            max_tokens,
            multiple,
            max_len,
            process_index,
            process_count,
            stats,
        )
    return Datasets(
        tokenizer=tokenizer,
        train=train,
        valid=evals["valid"][0],
        valid_sources=evals["valid"][1],
        valid_references=evals["valid"][2],
        test=evals["test"][0],
        test_sources=evals["test"][1],
        test_references=evals["test"][2],
        stats=stats,
    )


def _buckets(data: DataConfig, multiple: int) -> tuple[list[int], list[int]]:
    """The bucket lengths (``bucket_step`` apart, up to ``max_len``) and their global batch
    sizes (rows, multiples of ``multiple``, about ``max_tokens`` tokens each); a ValueError if
    ``max_tokens`` cannot hold ``multiple`` rows of the longest bucket."""
    max_len, max_tokens, step = data.max_len, data.max_tokens, data.bucket_step
    lengths = bucket_lengths(max_len, min_len=step, step=step)
    if max_tokens < multiple * lengths[-1]:
        raise ValueError(
            f"config.data.max_tokens={max_tokens} cannot hold {multiple} rows (batch multiple) of "
            f"max_len={lengths[-1]} tokens: raise max_tokens to >= {multiple * lengths[-1]} or "
            "lower max_len"
        )
    return lengths, [bucket_batch_size(n, max_tokens, multiple) for n in lengths]


def _train_batches(tokenizer: Tokenizer, raw_train: list[Pair], data: DataConfig,
                   lengths: list[int], sizes: list[int], process_index: int, process_count: int
                   ) -> tuple[TrainBatches, dict[str, Any]]:
    """The train split tokenized and bucketed (pairs with an empty side or a side over
    ``max_len`` skipped, with a warning), and its statistics."""
    max_len = data.max_len
    kept, empty = drop_empty(raw_train)
    examples, too_long = tokenize_pairs(tokenizer, kept, max_len=max_len)
    del kept
    if not len(examples):
        raise ValueError(
            f"the train split has no usable pairs: {empty} with an empty side, {too_long} with a "
            f"side over config.data.max_len={max_len} tokens (with EOS): raise "
            "config.data.max_len, or check config.data.train_prefix"
        )
    train = TrainBatches(examples, lengths, sizes, seed=data.seed,
                         process_index=process_index, process_count=process_count)
    real = int(np.diff(examples.tgt_offsets).sum())
    padded = sum(sizes[b] * lengths[b] for b, _ in train.epoch_plan(0))
    stats = {
        "pairs": len(examples) + too_long + empty,
        "empty": empty,
        "too_long": too_long,
        "kept": len(examples),
        "batches_per_epoch": train.num_batches,
        "target_padding_fraction": 1.0 - real / max(padded, 1),
    }
    logger.info("train: %s", stats)
    if empty or too_long:
        logger.warning("train: skipped %d pairs with an empty side and %d pairs with a side over "
                       "max_len=%d tokens", empty, too_long, max_len)
    return train, stats
