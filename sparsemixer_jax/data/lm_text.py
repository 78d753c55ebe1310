"""Language-modelling data: held-out splits, documents or chat rows packed with segment ids,
the batch streams, the unigram baseline and bits per byte.

``data.format`` says what ``data.train`` holds: ``text`` (documents, read as pretraining reads
them, :func:`sparsemixer_jax.data.text.read_documents`: WikiExtractor, WikiText or plain text),
or JSON-lines rows, ``chat`` or ``prompt_completion`` (:mod:`sparsemixer_jax.data.chat`, which
packs them whole and puts the loss on the assistant's tokens). The training file's last
``valid_articles`` documents (rows) are held out as validation data; ``train_articles`` (when
> 0) keeps only the first that many of the rest, for small runs.

Packing text: each document is ``[bos] + tokens of its text``: a checkpoint's tokenizer
encodes the paragraphs joined by newlines, as the source has them, as one string;
SentencePiece, which folds a newline into the word boundary that starts each paragraph anyway,
encodes each paragraph on its own (as runs from scratch always have). The documents are laid end to
end in one stream whose segment id is the document's number (1, 2, ...), and the stream is
cut into rows of ``seq_len`` tokens that overlap by one token (row ``r`` holds stream
positions ``r (seq_len - 1) .. r (seq_len - 1) + seq_len - 1``; the last row is padded with
segment 0). Position ``t >= 1`` of a row is a target when its segment equals that of position
``t - 1`` and is not 0: so every token of every document but its ``bos`` is predicted exactly
once, from the tokens of its own document before it (the model masks attention across
segments), and a document cut between rows keeps one token of context.

Every packed split carries ``targets`` bool ``[N, seq_len]``: position ``t`` is predicted from the
positions before it (the rule above for text; the assistant's tokens for chat rows).

Bits per byte: the summed negative log-likelihood of the targets divided by ``ln 2`` times the
UTF-8 bytes of the documents' text as read (paragraphs joined by newlines; WikiText's headings
dropped and its ``@-@`` escapes undone), or of the text the chat rows' targets spell. Each
row carries the bytes of the targets it holds (each document's bytes spread evenly over its
targets), so sums over any set of rows add up to the text they predict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from sparsemixer_jax.data import chat, text
from sparsemixer_jax.data.tokenizer import Tokenizer
from sparsemixer_jax.section import cast, check_choice, check_positive, read_fields
from sparsemixer_jax.token_ids import EOS_ID, FIRST_WORD_ID

logger = logging.getLogger(__name__)

TOKENIZERS = ("spm", "bpe")  # config.data.tokenizer of a run from scratch

# Bump when packing changes what it produces for the same text, settings and vocabulary.
LM_PACKING_VERSION = 2


class LMTokenizer(Protocol):
    """What the task needs of a tokenizer: SentencePiece (:class:`SentencePieceLM`) for models
    trained from scratch, a checkpoint's ``tokenizer.json`` (:class:`HFTokenizerLM`)."""

    path: str  # the vocabulary file (its content keys the packing cache)
    bos_id: int  # separates documents; the first token of each
    keeps_newlines: bool  # a document is encoded as one text (else paragraph by paragraph)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceLM:
    """The project's SentencePiece vocabulary (pretraining's): ``eos`` (1) starts documents."""

    keeps_newlines = False

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.path, self.bos_id = tokenizer, tokenizer.path, EOS_ID

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)  # stops at the first eos: the end of a document


class HFTokenizerLM:
    """A checkpoint's tokenizer (:class:`sparsemixer_jax.hf.HFTokenizer`: ``tokenizer.json``,
    its special tokens and chat template); documents start with the checkpoint's
    ``bos_token_id`` (else its ``eos_token_id``, else 0)."""

    keeps_newlines = True

    def __init__(self, hf: Any, bos_id: int):
        self.hf, self.path, self.bos_id = hf, hf.path, int(bos_id)

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.hf.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(ids)


def hf_bos_id(hf_config: dict[str, Any]) -> int:
    """The id that starts a document for a checkpoint: ``bos_token_id``, else ``eos_token_id``
    (the first of a list), else 0."""
    for key in ("bos_token_id", "eos_token_id"):
        value = hf_config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


# ------------------------------------------------------------------------------- the section


@dataclasses.dataclass(frozen=True)
class LMDataConfig:
    """``config.data`` of a language-modelling run (schema: ``configs/lm_quickstart.py``) with
    the run's ``seed`` (vocabulary sample, batch order).

    Attributes:
      train: the training data (file or directory); its last ``valid_articles`` documents
        (rows) are the validation data.
      format: what ``train`` holds: ``text`` (documents), ``chat`` (JSON lines with
        ``messages``) or ``prompt_completion`` (JSON lines with ``prompt`` and ``completion``);
        the last two need a checkpoint's tokenizer (``config.init_from``).
      on_bad_row: a chat or prompt-completion row that cannot be trained on (not JSON, no or an
        empty conversation, a message without a role, no assistant tokens, longer than
        ``seq_len``) is counted and skipped (``skip``) or refused (``error``).
      valid_articles: documents (rows) held out at the end of ``train``.
      train_articles: training documents (rows) kept (the first ones; 0 = all).
      wikitext: a second held-out set evaluated at the end (file or directory: every file is
        evaluated on its own, e.g. WikiText-2's validation and test files); "" = none.
      tokenizer: the vocabulary of a run from scratch (a checkpoint brings its own tokenizer):
        ``spm`` (SentencePiece, ``spm.model``) or ``bpe`` (a byte-level BPE with ChatML special
        tokens and chat template, written as ``tokenizer.json`` and ``tokenizer_config.json``:
        :mod:`sparsemixer_jax.data.bpe`).
      vocab_size, vocab_sample_sentences: the vocabulary's size and the training paragraphs
        (``bpe``: documents) sampled to train it; spm_model_type, character_coverage:
        SentencePiece's settings.
      seq_len: tokens per packed row; batch_size: rows per update; micro_batch_size: rows per
        accumulation micro-step (0 = batch_size); eval_batch_size: rows per evaluation batch
        (0 = micro-batch size).
    """

    train: str
    seq_len: int
    batch_size: int
    seed: int
    format: str = "text"
    on_bad_row: str = "skip"
    valid_articles: int = 1000
    train_articles: int = 0
    wikitext: str = ""
    tokenizer: str = "spm"
    vocab_size: int = 8000
    vocab_sample_sentences: int = 200_000
    spm_model_type: str = "unigram"
    character_coverage: float = 0.9995
    micro_batch_size: int = 0
    eval_batch_size: int = 0

    @classmethod
    def from_config(cls, config: Any, where: str = "config.data.") -> LMDataConfig:
        """``config.data`` (and ``config.seed``) checked: one-line ValueErrors naming the
        first bad field."""
        d = cls(seed=cast(int, config.seed, "config.seed"),
                **read_fields(cls, config.data, where, skip=("seed",)))
        check_positive(where, batch_size=d.batch_size, valid_articles=d.valid_articles,
                       vocab_size=d.vocab_size)
        check_choice(where, "format", d.format, chat.FORMATS)
        check_choice(where, "on_bad_row", d.on_bad_row, chat.BAD_ROW_POLICIES)
        check_choice(where, "tokenizer", d.tokenizer, TOKENIZERS)
        if d.seq_len < 4:
            raise ValueError(f"{where}seq_len must be >= 4, got {d.seq_len}")
        if d.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"{where}vocab_size must exceed {FIRST_WORD_ID} special ids")
        if d.train_articles < 0 or d.eval_batch_size < 0:
            raise ValueError(f"{where}train_articles and eval_batch_size must be >= 0 (0 = all "
                             f"/ the micro-batch size), got {d.train_articles}, "
                             f"{d.eval_batch_size}")
        if d.micro_batch_size < 0 or d.batch_size % d.micro:
            raise ValueError(f"{where}micro_batch_size={d.micro_batch_size} must divide "
                             f"{where}batch_size={d.batch_size} (0 = no accumulation)")
        return d

    @property
    def micro(self) -> int:
        """Rows per accumulation micro-step."""
        return self.micro_batch_size or self.batch_size

    @property
    def eval_rows(self) -> int:
        return self.eval_batch_size or self.micro

    @property
    def unit(self) -> str:
        """What ``valid_articles`` counts: documents or rows."""
        return "documents" if self.format == "text" else "rows"

    def check_files(self) -> None:
        """The data files are there (a one-line FileNotFoundError otherwise)."""
        text.text_files(self.train)
        if self.wikitext:
            text.text_files(self.wikitext)


def split_documents(data: LMDataConfig, documents: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(train, valid)``: all but the last ``valid_articles`` documents or rows (the first
    ``train_articles`` of them when > 0), and those last ones."""
    held = data.valid_articles
    if len(documents) <= held:
        raise ValueError(f"{data.train!r} holds {len(documents)} {data.unit}; holding out "
                         f"config.data.valid_articles={held} leaves none to train on")
    train = documents[:-held]
    if data.train_articles:
        train = train[: data.train_articles]
    return train, documents[-held:]


def held_out_name(path: str) -> str:
    """A short name for a held-out file: ``valid`` / ``test`` for WikiText's files, else the
    file name before its first dot."""
    base = os.path.basename(path)
    for name in ("valid", "test", "train"):
        if f".{name}." in f".{base}":
            return name
    return base.split(".")[0]


# ------------------------------------------------------------------------------------ packing


def document_bytes(documents: Sequence[Sequence[str]]) -> np.ndarray:
    """UTF-8 bytes of each document's text, paragraphs joined by newlines: int64 ``[D]``."""
    return np.asarray([len("\n".join(doc).encode("utf-8")) for doc in documents], np.int64)


def encode_documents(tokenizer: LMTokenizer, documents: Sequence[Sequence[str]],
                     chunk: int = 10_000) -> list[np.ndarray]:
    """``[bos] + tokens`` of every document (int32): its paragraphs joined by newlines and
    encoded as one text (``tokenizer.keeps_newlines``), else each encoded on its own."""
    if tokenizer.keeps_newlines:
        pieces = [["\n".join(doc)] for doc in documents]
    else:
        pieces = [list(doc) for doc in documents]
    flat = [p for doc in pieces for p in doc]
    ids: list[list[int]] = []
    for start in range(0, len(flat), chunk):
        ids.extend(tokenizer.encode_batch(flat[start: start + chunk]))
    out, i = [], 0
    for doc in pieces:
        out.append(np.asarray([tokenizer.bos_id, *(t for p in ids[i: i + len(doc)] for t in p)],
                              np.int32))
        i += len(doc)
    return out


def pack_documents(encoded: Sequence[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, segments)`` int32 ``[N, seq_len]``: the documents laid end to end, cut into
    rows that overlap by one token (module docstring); segment ``d + 1`` is document ``d``,
    0 is padding."""
    if not encoded:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy()
    stream = np.concatenate(encoded).astype(np.int32)
    segment = np.repeat(np.arange(1, len(encoded) + 1, dtype=np.int32),
                        [len(e) for e in encoded])
    step = seq_len - 1
    rows = max(1, math.ceil((len(stream) - 1) / step))
    tokens = np.zeros((rows, seq_len), np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    for r in range(rows):
        piece = slice(r * step, r * step + seq_len)
        n = len(stream[piece])
        tokens[r, :n], segments[r, :n] = stream[piece], segment[piece]
    return tokens, segments


def target_mask(segments: np.ndarray) -> np.ndarray:
    """bool ``[N, seq_len - 1]``: position ``t + 1`` of a row is a target (same segment as
    position ``t``, not padding)."""
    return (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)


def text_targets(segments: np.ndarray) -> np.ndarray:
    """bool ``[N, seq_len]``: the targets of packed text (:func:`target_mask`; position 0 of a
    row never is one)."""
    out = np.zeros(segments.shape, bool)
    out[:, 1:] = target_mask(segments)
    return out


def row_bytes(targets: np.ndarray, segments: np.ndarray, doc_bytes: np.ndarray) -> np.ndarray:
    """float32 ``[N]``: the text bytes of each row's targets (bool ``[N, seq_len]``; each
    document's bytes spread evenly over its targets; the rows' sum is the documents' bytes)."""
    targets = targets[:, 1:]
    seg = segments[:, 1:]
    per_doc = np.bincount(seg[targets], minlength=len(doc_bytes) + 1)[1:]
    weight = np.zeros(len(doc_bytes) + 1, np.float64)
    weight[1:] = doc_bytes / np.maximum(per_doc, 1)
    return np.where(targets, weight[seg], 0.0).sum(axis=1).astype(np.float32)


def lm_packing_key(data: LMDataConfig, split: str, files: Sequence[str],
                   tokenizer: LMTokenizer, fmt: str) -> str:
    """A SHA-256 of everything the packed rows of ``split`` depend on: the data files'
    contents, the vocabulary file's, the format (and for rows the chat template, special
    tokens and bad-row policy: an ``error`` run re-reads rows a ``skip`` run packed), the split
    and its article counts, the row length."""
    base = text.packing_key(files, tokenizer.path, seq_len=data.seq_len, pair_prob=0.0, seed=0)
    hf = getattr(tokenizer, "hf", None)
    record = {"base": base, "version": LM_PACKING_VERSION, "split": split, "format": fmt,
              "bos": tokenizer.bos_id, "valid_articles": data.valid_articles,
              "train_articles": data.train_articles,
              "tokenizer_config": "" if fmt == "text" or hf is None else hf.config_text,
              "on_bad_row": "" if fmt == "text" else data.on_bad_row}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class PackedSplit:
    """A packed split: ``tokens``, ``segments`` int32 ``[N, seq_len]``, ``targets`` bool
    ``[N, seq_len]``, ``row_bytes`` float32 ``[N]`` and statistics (documents or rows, tokens,
    bytes, sequences)."""

    tokens: np.ndarray
    segments: np.ndarray
    targets: np.ndarray
    row_bytes: np.ndarray
    stats: dict[str, Any]


def _pack(data: LMDataConfig, tokenizer: LMTokenizer, fmt: str, source: list[Any]
          ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, stats)`` of documents (``fmt="text"``) or of ``(where, line)`` rows."""
    if fmt == "text":
        doc_bytes = document_bytes(source)
        tokens, segments = pack_documents(encode_documents(tokenizer, source), data.seq_len)
        targets = text_targets(segments)
        stats = {"documents": len(source)}
    else:
        examples, bad = chat.read_examples(tokenizer.hf, source, fmt, data.seq_len,
                                           data.on_bad_row)
        if not examples:
            raise ValueError(f"{data.train!r}: none of {len(source)} rows can be trained on "
                             "(the warning above names the first bad ones)")
        doc_bytes = np.asarray([e.nbytes for e in examples], np.int64)
        tokens, segments, targets = chat.pack_examples(examples, data.seq_len)
        stats = {"rows": len(source), "bad_rows": bad, "examples": len(examples)}
    stats.update(sequences=len(tokens), targets=int(targets.sum()), bytes=int(doc_bytes.sum()),
                 doc_bytes=doc_bytes.tolist())
    return {"tokens": tokens, "segments": segments, "targets": targets}, stats


def pack_split(data: LMDataConfig, cache_dir: str, split: str, files: Sequence[str],
               tokenizer: LMTokenizer, source: Any, write: bool = True,
               fmt: str | None = None) -> PackedSplit:
    """The packed rows of ``split``, read from ``{cache_dir}/{split}-{key}.npz`` when an equal
    packing is cached, else packed from ``source()`` (a callable returning the documents or
    rows: read only when needed) and cached (when ``write``). ``fmt``: ``data.format``
    unless given (the second held-out set is always text)."""
    fmt = fmt or data.format
    key = lm_packing_key(data, split, files, tokenizer, fmt)
    cached = text.load_packed(cache_dir, split, key)
    if cached is not None:
        arrays, stats = cached
        logger.info("%s: %d packed rows read from the cache (%s)", split,
                    len(arrays["tokens"]), cache_dir)
    else:
        arrays, stats = _pack(data, tokenizer, fmt, source())
        if write:
            text.save_packed(cache_dir, split, key, arrays, stats)
    stats = {k: v for k, v in stats.items() if k != "key"}
    tokens, segments, targets = arrays["tokens"], arrays["segments"], arrays["targets"]
    bytes_per_row = row_bytes(targets, segments, np.asarray(stats.pop("doc_bytes"), np.int64))
    return PackedSplit(tokens, segments, targets, bytes_per_row, stats)


# ------------------------------------------------------------------------------------ batches


def _batch(tokens: np.ndarray, segments: np.ndarray, targets: np.ndarray,
           nbytes: np.ndarray) -> dict[str, np.ndarray]:
    return {"tokens": tokens.astype(np.int32), "segments": segments.astype(np.int32),
            "targets": targets.astype(bool), "bytes": nbytes.astype(np.float32)}


class LMBatches:
    """Endless, resumable stream of packed rows: every epoch visits them in a fresh order drawn
    from ``(seed, epoch)``, so the stream is a function of the seed and its position
    (:meth:`state` / :meth:`restore`): exact resumption. Each of several processes keeps its
    rows ``[process_index * rows, (process_index + 1) * rows)`` of every global batch."""

    def __init__(self, split: PackedSplit, batch_size: int, *, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if batch_size % process_count:
            raise ValueError(f"batch size {batch_size} is not divisible by the {process_count} "
                             "processes")
        if len(split.tokens) < batch_size:
            raise ValueError(f"the training text packs into {len(split.tokens)} rows, fewer "
                             f"than one batch of {batch_size}: use more text "
                             "(config.data.train_articles), or a smaller batch or seq_len")
        self.split, self.batch_size, self.seed = split, batch_size, seed
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.batches_per_epoch = len(split.tokens) // batch_size  # the last partial one dropped
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 41, epoch]).permutation(len(self.split.tokens))

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)

    def __iter__(self) -> LMBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        rows = self._order[self.index * self.batch_size: (self.index + 1) * self.batch_size]
        self.index += 1
        s = self.split
        batch = _batch(s.tokens[rows], s.segments[rows], s.targets[rows], s.row_bytes[rows])
        return {k: v[self.rows] for k, v in batch.items()}


def eval_batches(split: PackedSplit, batch_size: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """Fixed batches over every row of ``split`` (the last padded with empty rows)."""
    batches = []
    rows = batch_size // process_count
    own = slice(process_index * rows, (process_index + 1) * rows)
    s = split
    for start in range(0, len(s.tokens), batch_size):
        parts = [a[start: start + batch_size] for a in (s.tokens, s.segments, s.targets,
                                                         s.row_bytes)]
        pad = batch_size - len(parts[0])
        if pad:  # empty rows: zeros of each array's shape and type
            parts = [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in parts]
        batches.append({k: v[own] for k, v in _batch(*parts).items()})
    return batches


# --------------------------------------------------------------------------- unigram baseline


def unigram_log_probs(train: PackedSplit, vocab_size: int) -> np.ndarray:
    """float64 ``[V]``: log-probabilities of the unigram model of the training targets
    (add-one smoothed, so every token has a probability)."""
    targets = train.tokens[train.targets]
    counts = np.bincount(targets, minlength=vocab_size)[:vocab_size].astype(np.float64) + 1.0
    return np.log(counts / counts.sum())


def unigram_metrics(log_probs: np.ndarray, split: PackedSplit, prefix: str) -> dict[str, float]:
    """``{prefix}_ppl`` and ``{prefix}_bits_per_byte`` of the unigram model on ``split``."""
    targets = split.tokens[split.targets]
    nll = -float(np.sum(log_probs[targets]))
    return {f"{prefix}_ppl": math.exp(nll / max(len(targets), 1)),
            f"{prefix}_bits_per_byte": nll / (math.log(2) * max(float(split.row_bytes.sum()),
                                                                1.0))}
