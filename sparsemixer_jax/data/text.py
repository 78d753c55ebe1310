"""Pretraining text: readers, the SentencePiece vocabulary, packing, MLM-masked batches.

Readers take a file or a directory of files (``.gz`` or plain, read in sorted path order) in one
of three formats, detected per file from its first non-blank line:

* WikiExtractor (``<doc ...>`` ... ``</doc>``, e.g. ``../shared/data/wikipedia``): the ``<doc>``
  lines and the title line after them are dropped, as are empty articles;
* WikiText (`` = Title = `` lines, e.g. ``../shared/data/wikitext``): heading lines are dropped
  and the ``@-@``, ``@,@``, ``@.@`` escapes are undone;
* plain text: every non-blank line is a paragraph.

Vocabulary: SentencePiece trained on the text, ``pad = 0``, ``eos = 1``, ``unk = 2`` and the
user-defined pieces ``[CLS] = 3``, ``[SEP] = 4``, ``[MASK] = 5``.

Packing: the paragraphs' token ids are laid end to end (across documents, like RoBERTa's
FULL-SENTENCES) and cut into sequences of ``seq_len - 3`` text tokens (all but the last); one is
``[CLS] a [SEP]`` or, with probability ``pair_prob`` when it holds pieces of at least two
paragraphs, ``[CLS] a [SEP] b [SEP]`` split at a random paragraph boundary (a single segment
leaves the last position as padding). Segment ids are 0
for ``[CLS] a [SEP]`` and 1 for ``b [SEP]``: the layout GLUE's sentence pairs use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from sparsemixer_jax.data.sources import iter_lines, read_lines, resolve_data_dir
from sparsemixer_jax.data.tokenizer import Tokenizer, train_tokenizer, vocabulary_sample
from sparsemixer_jax.section import cast, check_positive, read_fields
from sparsemixer_jax.token_ids import CLS_ID, FIRST_WORD_ID, MASK_ID, SEP_ID

logger = logging.getLogger(__name__)

SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]")  # ids CLS_ID, SEP_ID, MASK_ID, in this order

_WIKITEXT_HEADING = re.compile(r"^ ?(= )+[^=].* (= ?)+$")
_WIKITEXT_ESCAPES = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))


# ------------------------------------------------------------------------------------ readers


def text_files(path: str) -> list[str]:
    """``path`` itself, or every regular file below the directory ``path`` (sorted, no README)."""
    resolved = resolve_data_dir(path)
    if os.path.isfile(resolved):
        return [resolved]
    if not os.path.isdir(resolved):
        raise FileNotFoundError(f"pretraining text {path!r}: no such file or directory")
    files = []
    for root, dirs, names in os.walk(resolved):
        dirs.sort()
        for name in sorted(names):
            if name.startswith(".") or name.upper().startswith(("README", "LICENSE")):
                continue
            files.append(os.path.join(root, name))
    if not files:
        raise FileNotFoundError(f"pretraining text directory {path!r} holds no files")
    return files


def check_pretraining_text(data: TextDataConfig) -> None:
    """The training and validation text of the data section ``data`` are there, and the
    validation text is UTF-8 (intact, for ``.gz``) and holds text; raises the one-line error
    reading them would.

    The run calls this before it writes anything or trains its vocabulary, so that a bad
    validation file stops it at once. The training text (gigabytes for Wikipedia) is only looked
    for: it is read first in any case, before the vocabulary is trained.
    """
    text_files(data.train)
    path = data.valid
    if not any(line.strip() for file in text_files(path)
               for line in iter_lines(file, universal_newlines=True)):
        raise ValueError(f"pretraining text {path!r} holds no text")


def detect_format(lines: Sequence[str]) -> str:
    """``"wikiextractor"``, ``"wikitext"`` or ``"plain"`` from the first non-blank line."""
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("<doc "):
            return "wikiextractor"
        if _WIKITEXT_HEADING.match(line.rstrip("\n")):
            return "wikitext"
        return "plain"
    return "plain"


def _wikiextractor_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    doc: list[str] | None = None
    expect_title = False
    for line in lines:
        line = line.strip()
        if line.startswith("<doc ") and line.endswith(">"):
            doc, expect_title = [], True
        elif line == "</doc>":
            if doc:
                yield doc
            doc = None
        elif doc is not None and line:
            if expect_title:  # the first line repeats the title
                expect_title = False
                continue
            doc.append(line)


def _wikitext_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    doc: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        if _WIKITEXT_HEADING.match(line.rstrip("\n")):
            if stripped.startswith("= ") and not stripped.startswith("= ="):  # an article title
                if doc:
                    yield doc
                doc = []
            continue
        for escaped, plain in _WIKITEXT_ESCAPES:
            stripped = stripped.replace(escaped, plain)
        doc.append(stripped)
    if doc:
        yield doc


def read_documents(path: str) -> list[list[str]]:
    """Documents (lists of paragraphs, no blank ones) of the file or directory ``path``."""
    documents: list[list[str]] = []
    for file in text_files(path):
        lines = read_lines(file, universal_newlines=True)
        fmt = detect_format(lines)
        if fmt == "wikiextractor":
            docs = list(_wikiextractor_documents(lines))
        elif fmt == "wikitext":
            docs = list(_wikitext_documents(lines))
        else:
            paragraphs = [line.strip() for line in lines if line.strip()]
            docs = [paragraphs] if paragraphs else []
        logger.info("%s: %s format, %d documents", file, fmt, len(docs))
        documents.extend(docs)
    if not documents:
        raise ValueError(f"pretraining text {path!r} holds no text")
    return documents


# --------------------------------------------------------------------------------- vocabulary


@dataclasses.dataclass(frozen=True)
class TextDataConfig:
    """``config.data`` of a pretraining run (schema and meaning of each field:
    ``configs/electra.py``), with the run's ``seed`` (vocabulary sample, packing, masking)."""

    train: str
    valid: str
    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int
    valid_sequences: int = 0
    vocab_sample_sentences: int = 2_000_000
    spm_model_type: str = "bpe"
    character_coverage: float = 0.9995
    pair_prob: float = 0.5
    micro_batch_size: int = 0
    mask_prob: float = 0.15
    mask_token_prob: float = 0.85

    @classmethod
    def from_config(cls, config: Any, where: str = "config.data.") -> TextDataConfig:
        """``config.data`` (and ``config.seed``) of the experiment config ``config``, checked:
        one-line ValueErrors naming the first bad field."""
        d = cls(seed=cast(int, config.seed, "config.seed"),
                **read_fields(cls, config.data, where, skip=("seed",)))
        check_positive(where, vocab_size=d.vocab_size, batch_size=d.batch_size)
        if d.seq_len < 8:
            raise ValueError(f"{where}seq_len must be >= 8, got {d.seq_len}")
        if d.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"{where}vocab_size must exceed {FIRST_WORD_ID} special ids")
        if d.micro_batch_size < 0 or d.batch_size % d.micro:
            raise ValueError(f"{where}micro_batch_size={d.micro_batch_size} must divide "
                             f"{where}batch_size={d.batch_size} (0 = no accumulation)")
        for name in ("mask_prob", "mask_token_prob", "pair_prob"):
            if not 0.0 <= getattr(d, name) <= 1.0:
                raise ValueError(f"{where}{name} must lie in [0, 1], got {getattr(d, name)}")
        if not d.mask_prob > 0:
            raise ValueError(f"{where}mask_prob must be > 0: nothing would be replaced")
        return d

    @property
    def micro(self) -> int:
        """Sequences per accumulation micro-step."""
        return self.micro_batch_size or self.batch_size


def get_text_tokenizer(data: TextDataConfig, workdir: str, paragraphs: Sequence[str]
                       ) -> Tokenizer:
    """Loads ``{workdir}/spm.model`` or trains it on a seeded sample of ``paragraphs``, as the
    data section ``data`` says. Raises ``ValueError`` if the model's size differs from
    ``data.vocab_size`` or its special pieces are not ``[CLS] = 3, [SEP] = 4, [MASK] = 5``.
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "spm.model")
    if not os.path.exists(path):
        sample = vocabulary_sample(list(paragraphs), data.vocab_sample_sentences, data.seed)
        logger.info(
            "training a %d-piece SentencePiece model on %d paragraphs -> %s",
            data.vocab_size, len(sample), path,
        )
        train_tokenizer(
            sample,
            path,
            data.vocab_size,
            seed=data.seed,
            character_coverage=data.character_coverage,
            model_type=data.spm_model_type,
            user_defined_symbols=SPECIAL_PIECES,
        )
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size != data.vocab_size:
        raise ValueError(
            f"cached vocabulary {path} has {tokenizer.vocab_size} pieces but "
            f"config.data.vocab_size is {data.vocab_size}: delete the file to retrain, or use a "
            "fresh workdir"
        )
    check_special_pieces(tokenizer)
    return tokenizer


def check_special_pieces(tokenizer: Tokenizer) -> None:
    """Raises ValueError unless ``[CLS]``, ``[SEP]``, ``[MASK]`` have ids 3, 4, 5."""
    ids = [tokenizer.sp.piece_to_id(p) for p in SPECIAL_PIECES]
    if ids != [CLS_ID, SEP_ID, MASK_ID]:
        raise ValueError(
            f"{tokenizer.path}: pieces {SPECIAL_PIECES} have ids {ids}, expected "
            f"{[CLS_ID, SEP_ID, MASK_ID]}: not a pretraining vocabulary (delete it to retrain)"
        )


# ------------------------------------------------------------------------------------ packing


def pack_sequences(
    paragraphs: Iterable[Sequence[int]],
    seq_len: int,
    *,
    pair_prob: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Packs tokenized paragraphs into ``[CLS] a [SEP] (b [SEP])`` sequences (module docstring).

    Args:
      paragraphs: token ids of each paragraph (no special tokens), in reading order.
      seq_len: tokens per sequence, special tokens included (>= 5).
      pair_prob: probability that a sequence holding pieces of two or more paragraphs is split
        into two segments at one of their boundaries (drawn from ``rng``).

    Returns:
      ``tokens`` and ``segments``, int32 ``[N, seq_len]``, 0-padded (every sequence but the last
      holds ``seq_len - 3`` text tokens). Empty paragraphs are skipped; ``N = 0`` if no text.
    """
    if seq_len < 5:
        raise ValueError(f"seq_len must be >= 5 ([CLS] a [SEP] b [SEP]), got {seq_len}")
    budget = seq_len - 3  # room for [CLS], [SEP], [SEP]
    rows_tokens: list[np.ndarray] = []
    rows_segments: list[np.ndarray] = []

    def emit(pieces: list[np.ndarray]) -> None:
        if len(pieces) >= 2 and rng.random() < pair_prob:
            split = int(rng.integers(1, len(pieces)))
            a, b = np.concatenate(pieces[:split]), np.concatenate(pieces[split:])
            row = [[CLS_ID], a, [SEP_ID], b, [SEP_ID]]
            segment = [np.zeros(len(a) + 2), np.ones(len(b) + 1)]
        else:
            a = np.concatenate(pieces)
            row = [[CLS_ID], a, [SEP_ID]]
            segment = [np.zeros(len(a) + 2)]
        tokens = np.zeros(seq_len, np.int32)
        segments = np.zeros(seq_len, np.int32)
        row = np.concatenate(row)
        tokens[: len(row)] = row
        segments[: len(row)] = np.concatenate(segment)
        rows_tokens.append(tokens)
        rows_segments.append(segments)

    pieces: list[np.ndarray] = []
    filled = 0
    for paragraph in paragraphs:
        ids = np.asarray(paragraph, np.int32)
        while len(ids):
            take = min(len(ids), budget - filled)
            pieces.append(ids[:take])
            filled += take
            ids = ids[take:]
            if filled == budget:
                emit(pieces)
                pieces, filled = [], 0
    if pieces:
        emit(pieces)
    if not rows_tokens:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy()
    return np.stack(rows_tokens), np.stack(rows_segments)


def tokenize_and_pack(
    tokenizer: Tokenizer,
    paragraphs: Sequence[str],
    seq_len: int,
    *,
    pair_prob: float,
    seed: int,
    chunk: int = 10_000,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_sequences` of ``paragraphs`` encoded with ``tokenizer`` (in chunks)."""

    def encoded() -> Iterator[list[int]]:
        for start in range(0, len(paragraphs), chunk):
            yield from tokenizer.encode_batch(paragraphs[start : start + chunk])

    return pack_sequences(encoded(), seq_len, pair_prob=pair_prob,
                          rng=np.random.default_rng([seed, 23]))


# ------------------------------------------------------------------------------ packing cache

# Bump when packing changes what it produces for the same text, settings and vocabulary.
PACKING_VERSION = 1


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def packing_key(files: Sequence[str], vocabulary: str, *, seq_len: int, pair_prob: float,
                seed: int) -> str:
    """A SHA-256 naming packed sequences: of the text files' contents, the vocabulary file's
    content and the packing settings. Anything that changes the packed arrays changes it."""
    record = {
        "version": PACKING_VERSION,
        "files": [[os.path.basename(f), file_sha256(f)] for f in files],
        "vocabulary": file_sha256(vocabulary),
        "seq_len": int(seq_len), "pair_prob": float(pair_prob), "seed": int(seed),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def load_packed(cache_dir: str, split: str, key: str
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """``(arrays, stats)`` cached under ``key`` (``arrays``: ``tokens``, ``segments`` and what
    else was saved), or None (absent or unreadable)."""
    path = os.path.join(cache_dir, f"{split}-{key[:20]}.npz")
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as f:
            stats = json.loads(str(f["stats"]))
            if stats.get("key") != key:
                return None
            return {k: f[k] for k in f.files if k != "stats"}, stats
    except (OSError, ValueError, KeyError) as e:  # a truncated or foreign file: pack again
        logger.warning("packed-data cache %s is unreadable (%s); packing again", path, e)
        return None


def save_packed(cache_dir: str, split: str, key: str, arrays: dict[str, np.ndarray],
                stats: dict[str, Any]) -> str:
    """Writes the packed ``arrays`` (``tokens``, ``segments``, ...) atomically (a reader sees
    the old file or the new one); stale files of ``split`` with another key are removed."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"{split}-{key[:20]}.npz")
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, **arrays, stats=json.dumps({**stats, "key": key}))
    os.replace(tmp, path)
    for name in os.listdir(cache_dir):
        if name.startswith(f"{split}-") and name.endswith(".npz") and \
                os.path.join(cache_dir, name) != path:
            os.remove(os.path.join(cache_dir, name))
    return path


# ---------------------------------------------------------------------------------- masking


def mask_tokens(
    tokens: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_prob: float,
    mask_token_prob: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Selects MLM positions and hides most of them behind ``[MASK]``.

    In every row, ``round(mask_prob * n)`` of its ``n`` word tokens (ids >= ``FIRST_WORD_ID``;
    at least one if ``n > 0``) are selected uniformly without replacement; each selected token
    is replaced by ``[MASK]`` with probability ``mask_token_prob`` and left as it is otherwise
    (ELECTRA's recipe: 15% selected, 85% of them shown as ``[MASK]``).

    Args:
      tokens: int ``[B, L]``.

    Returns:
      ``inputs`` (int32 ``[B, L]``, the generator's input) and ``selected`` (bool ``[B, L]``).
    """
    eligible = tokens >= FIRST_WORD_ID
    count = eligible.sum(axis=1)
    wanted = np.where(count > 0, np.maximum(np.rint(mask_prob * count), 1), 0).astype(np.int64)
    scores = np.where(eligible, rng.random(tokens.shape), 2.0)  # ineligible sort last
    ranks = np.argsort(np.argsort(scores, axis=1, kind="stable"), axis=1, kind="stable")
    selected = ranks < wanted[:, None]
    shown_as_mask = selected & (rng.random(tokens.shape) < mask_token_prob)
    inputs = np.where(shown_as_mask, MASK_ID, tokens).astype(np.int32)
    return inputs, selected


def mlm_batch(
    tokens: np.ndarray,
    segments: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_prob: float,
    mask_token_prob: float,
) -> dict[str, np.ndarray]:
    """A pretraining batch: ``tokens`` (originals), ``segments``, ``inputs``, ``selected``."""
    inputs, selected = mask_tokens(
        tokens, rng, mask_prob=mask_prob, mask_token_prob=mask_token_prob
    )
    return {
        "tokens": tokens.astype(np.int32),
        "segments": segments.astype(np.int32),
        "inputs": inputs,
        "selected": selected,
    }


class PretrainBatches:
    """Endless, resumable stream of MLM batches over packed sequences.

    Every epoch visits the sequences in a fresh seeded order; a batch's masking is drawn from
    ``(seed, epoch, index)``. So the stream is a function of the seed and the position
    (:meth:`state` / :meth:`restore`), which is what makes resumption exact, and of nothing
    else: the same global batch is masked alike whatever the number of processes, each of which
    keeps its own rows ``[process_index * rows, (process_index + 1) * rows)``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        segments: np.ndarray,
        batch_size: int,
        *,
        seed: int,
        mask_prob: float,
        mask_token_prob: float,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if batch_size % process_count:
            raise ValueError(
                f"batch size {batch_size} is not divisible by the {process_count} processes"
            )
        if len(tokens) < batch_size:
            raise ValueError(
                f"the training text packs into {len(tokens)} sequences, fewer than one batch of "
                f"{batch_size}: use more text, or a smaller batch or sequence length"
            )
        self.tokens, self.segments = tokens, segments
        self.batch_size = batch_size
        self.seed = seed
        self.mask_prob, self.mask_token_prob = mask_prob, mask_token_prob
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.batches_per_epoch = len(tokens) // batch_size  # the last partial batch is dropped
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 29, epoch]).permutation(len(self.tokens))

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)

    def __iter__(self) -> PretrainBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        batch = self._batch(self._order, self.epoch, self.index)
        self.index += 1
        return batch

    def peek(self) -> dict[str, np.ndarray]:
        """The micro-batch :meth:`__next__` would return, without moving the stream."""
        if self.index == self.batches_per_epoch:
            return self._batch(self._epoch_order(self.epoch + 1), self.epoch + 1, 0)
        return self._batch(self._order, self.epoch, self.index)

    def _batch(self, order: np.ndarray, epoch: int, index: int) -> dict[str, np.ndarray]:
        """This host's rows of micro-batch ``index`` of ``epoch`` (rows in ``order``)."""
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        rng = np.random.default_rng([self.seed, 31, epoch, index])
        batch = mlm_batch(
            self.tokens[rows], self.segments[rows], rng,
            mask_prob=self.mask_prob, mask_token_prob=self.mask_token_prob,
        )
        return {k: v[self.rows] for k, v in batch.items()}


def eval_batches(
    tokens: np.ndarray,
    segments: np.ndarray,
    batch_size: int,
    *,
    seed: int,
    mask_prob: float,
    mask_token_prob: float,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Fixed masked batches over all of ``tokens`` (the last one padded with empty rows)."""
    batches = []
    rows = batch_size // process_count
    own = slice(process_index * rows, (process_index + 1) * rows)
    for index, start in enumerate(range(0, len(tokens), batch_size)):
        chunk_t, chunk_s = tokens[start : start + batch_size], segments[start : start + batch_size]
        pad = batch_size - len(chunk_t)
        if pad:
            chunk_t = np.concatenate([chunk_t, np.zeros((pad, tokens.shape[1]), np.int32)])
            chunk_s = np.concatenate([chunk_s, np.zeros((pad, tokens.shape[1]), np.int32)])
        batch = mlm_batch(chunk_t, chunk_s, np.random.default_rng([seed, 37, index]),
                          mask_prob=mask_prob, mask_token_prob=mask_token_prob)
        batches.append({k: v[own] for k, v in batch.items()})
    return batches
