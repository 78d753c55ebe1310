"""Translation input pipeline: raw text pairs -> joint SentencePiece ids -> length-bucketed batches.

Three sources, chosen by ``config.data.source`` (schema: ``configs/wmt_base.py``):

* ``tfds``      -- a TFDS translation dataset (``wmt14_translate/de-en``); the fields named by
                   ``config.data.src`` / ``config.data.tgt`` are read, so the direction never
                   depends on the dataset's ``supervised_keys`` (for de-en: ``("de", "en")``).
* ``text``      -- line-aligned files ``{dir}/{prefix}.{lang}`` or ``{dir}/{prefix}.{lang}.gz``.
* ``synthetic`` -- a generated language pair (see :func:`synthetic_pairs`), deterministic from the
                   seed, that a small Transformer learns in a few hundred steps.

Token ids (joint SentencePiece model, cached as ``{workdir}/spm.model``): ``pad = 0``, ``eos = 1``,
``unk = 2``; no BOS (the model's teacher-forcing shift inserts its own start symbol).

Batches are dicts of numpy ``int32`` arrays, ``inputs [B, L]`` and ``targets [B, L]``, 0-padded,
both sides ending with EOS. ``L`` is a bucket length and ``B`` the bucket's batch size, chosen so
that ``B * L <= max_tokens``; the set of shapes is small and fixed, so ``jit`` compiles once per
bucket. One exception: evaluation keeps sentences longer than ``max_len`` in extra, longer
buckets, and a batch never has fewer rows than the batch multiple (the device count), so a
validation or test sentence longer than ``max_tokens / multiple`` makes a batch over
``max_tokens`` (the training split drops such pairs).
A batch whose bucket ran short is filled with all-padding rows (every id 0): the loss must weight
tokens by ``targets != 0`` -- which it does anyway -- and attention must survive fully masked rows.

Multi-host: every host builds the same *global* batch (same seed, same data) and keeps rows
``[p * B / P, (p + 1) * B / P)`` where ``p = process_index`` and ``P = process_count``. The global
batch (hence training) is therefore identical whatever the number of hosts; batch sizes are
multiples of ``lcm(batch_multiple, process_count)`` so every host gets the same number of rows.

TensorFlow / TFDS are imported only inside :func:`read_tfds`.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

SOURCES = ("tfds", "text", "synthetic")
# Fields every source needs, then the extra ones each source reads.
_COMMON_FIELDS = (
    "source",
    "src",
    "tgt",
    "train_prefix",
    "valid_prefix",
    "test_prefix",
    "vocab_size",
    "vocab_sample_sentences",
    "max_len",
    "max_tokens",
)
_SOURCE_FIELDS = {"tfds": ("tfds_name", "dir"), "text": ("dir",), "synthetic": ("synthetic_size",)}

# The repository root, against which relative data paths such as ``../shared/data/multi30k`` are
# resolved when they do not exist relative to the working directory.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Pair = tuple[str, str]
Batch = dict[str, np.ndarray]


# -----------------------------------------------------------------------------------------------
# Config checks.
# -----------------------------------------------------------------------------------------------
def check_config(config: Any) -> None:
    """Raises ``ValueError`` naming every missing ``config.data`` field, or an unknown source."""
    if "data" not in config:
        raise ValueError("config has no `data` section (see configs/wmt_base.py for the schema)")
    data = config.data
    if "source" not in data:
        raise ValueError("config.data is missing field 'source' (one of tfds, text, synthetic)")
    if data.source not in SOURCES:
        raise ValueError(
            f"unknown config.data.source {data.source!r}: expected one of {', '.join(SOURCES)}"
        )
    needed = _COMMON_FIELDS + _SOURCE_FIELDS[data.source]
    missing = [f for f in needed if f not in data]
    if "seed" not in config:
        missing.append("seed (top level)")
    if missing:
        raise ValueError(
            f"config.data is missing fields for source {data.source!r}: {missing} "
            "(see configs/wmt_base.py for the schema)"
        )
    if data.max_len < 2:
        raise ValueError(f"config.data.max_len must be >= 2 (text + EOS), got {data.max_len}")


# -----------------------------------------------------------------------------------------------
# Readers: one per source, each returning a list of raw (src, tgt) string pairs.
# -----------------------------------------------------------------------------------------------
def resolve_data_dir(path: str) -> str:
    """``path`` if it exists (absolute or relative to the cwd), else relative to the repo root.

    Configs name the shared data as ``../shared/data/multi30k`` relative to the repository root;
    this keeps that working from any working directory (tests, experiments/, notebooks).
    """
    path = os.path.expanduser(path)
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.normpath(os.path.join(REPO_ROOT, path))


def _find_text_file(directory: str, prefix: str, lang: str) -> str:
    plain = os.path.join(directory, f"{prefix}.{lang}")
    for candidate in (plain, plain + ".gz"):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"no text file for prefix {prefix!r}, language {lang!r}: tried {plain} and {plain}.gz"
    )


def _read_lines(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    # newline="\n": a stray carriage return inside a line must not split it in two (universal
    # newlines would, and the two files would then seem misaligned or, worse, align wrongly).
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        # Only the line ending goes: a line's own spaces are kept until the shared empty check.
        return [line.removesuffix("\n").removesuffix("\r") for line in f]


def read_text(directory: str, prefix: str, src: str, tgt: str) -> list[Pair]:
    """Reads line-aligned ``{directory}/{prefix}.{src|tgt}[.gz]`` into ``[(src_line, tgt_line)]``.

    Raises ``FileNotFoundError`` naming both paths tried, ``ValueError`` naming both files and both
    line counts when they are not aligned.
    """
    directory = resolve_data_dir(directory)
    src_path = _find_text_file(directory, prefix, src)
    tgt_path = _find_text_file(directory, prefix, tgt)
    src_lines, tgt_lines = _read_lines(src_path), _read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise ValueError(
            f"misaligned parallel files: {src_path} has {len(src_lines)} lines but {tgt_path} has "
            f"{len(tgt_lines)} lines"
        )
    return list(zip(src_lines, tgt_lines, strict=True))


def read_tfds(name: str, split: str, src: str, tgt: str, data_dir: str = "") -> list[Pair]:
    """Reads a TFDS translation split as ``[(example[src], example[tgt])]``.

    The fields are picked by name (``src="en", tgt="de"`` for English->German on
    ``wmt14_translate/de-en``, whose supervised keys are ``("de", "en")``), so the direction is the
    config's, not the dataset's. TensorFlow is imported here and only here.
    """
    import tensorflow as tf
    import tensorflow_datasets as tfds

    # TF must not grab accelerators that JAX owns.
    tf.config.set_visible_devices([], "GPU")
    builder = tfds.builder(name, data_dir=data_dir or None)
    features = set(builder.info.features.keys())
    for lang in (src, tgt):
        if lang not in features:
            raise ValueError(
                f"TFDS dataset {name!r} has no feature {lang!r} (has {sorted(features)})"
            )
    builder.download_and_prepare()
    ds = builder.as_dataset(split=split, shuffle_files=False)
    return [(ex[src].decode("utf-8"), ex[tgt].decode("utf-8")) for ex in tfds.as_numpy(ds)]


# ----- synthetic language -----------------------------------------------------------------------
# A fixed lexicon (independent of the run's seed, so changing the seed changes the sentences, not
# the language). Source: SVO, adjectives before the noun, determiners without gender. Target: SOV
# (verb last), adjectives after the noun, and agreement: every target noun has a gender that picks
# the determiner and the adjective ending; a plural source noun (suffix "-i") takes a plural
# determiner and the noun suffix "-en". So translation needs a dictionary, reordering and agreement.
_LEXICON_SEED = 1234
_SRC_SYLLABLES = [c + v for c in "bdgklmnprst" for v in "aeiou"]
_TGT_SYLLABLES = [c + v for c in "fhjvwzcxqy" for v in "aeiouy"]
_TGT_DET = {  # (definite, gender or "pl") -> target determiner
    (True, 0): "le",
    (True, 1): "la",
    (True, "pl"): "lesu",
    (False, 0): "un",
    (False, 1): "una",
    (False, "pl"): "uni",
}
_SRC_DET = {True: "ta", False: "mo"}  # definite, indefinite
_ADJ_SUFFIX = {0: "o", 1: "a", "pl": "os"}


@dataclasses.dataclass(frozen=True)
class _Lexicon:
    nouns: list[tuple[str, str, int]]  # (source, target stem, gender)
    adjectives: list[tuple[str, str]]  # (source, target stem)
    verbs: list[tuple[str, str]]
    preps: list[tuple[str, str]]


def _make_words(
    rng: np.random.Generator, syllables: list[str], n: int, taken: set[str]
) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        w = "".join(rng.choice(syllables, size=rng.integers(2, 4)))
        if w not in taken:
            taken.add(w)
            words.append(w)
    return words


def _lexicon() -> _Lexicon:
    rng = np.random.default_rng(_LEXICON_SEED)
    src_taken = set(_SRC_DET.values())
    tgt_taken = set(_TGT_DET.values())
    sizes = {"nouns": 40, "adjectives": 20, "verbs": 20, "preps": 6}
    src = {k: _make_words(rng, _SRC_SYLLABLES, n, src_taken) for k, n in sizes.items()}
    tgt = {k: _make_words(rng, _TGT_SYLLABLES, n, tgt_taken) for k, n in sizes.items()}
    genders = rng.integers(0, 2, size=sizes["nouns"])
    return _Lexicon(
        nouns=[(s, t, int(g)) for s, t, g in zip(src["nouns"], tgt["nouns"], genders, strict=True)],
        adjectives=list(zip(src["adjectives"], tgt["adjectives"], strict=True)),
        verbs=list(zip(src["verbs"], tgt["verbs"], strict=True)),
        preps=list(zip(src["preps"], tgt["preps"], strict=True)),
    )


def _noun_phrase(
    rng: np.random.Generator, lex: _Lexicon, max_adj: int
) -> tuple[list[str], list[str]]:
    """One noun phrase: source ``DET ADJ* NOUN[-i]``, target ``DET' NOUN'[-en] ADJ'+agreement*``."""
    src_noun, tgt_noun, gender = lex.nouns[rng.integers(len(lex.nouns))]
    definite = bool(rng.integers(2))
    plural = rng.random() < 0.3
    agree: int | str = "pl" if plural else gender
    adjs = [
        lex.adjectives[i] for i in rng.integers(len(lex.adjectives), size=rng.integers(max_adj + 1))
    ]
    src = [_SRC_DET[definite], *(a for a, _ in adjs), src_noun + ("i" if plural else "")]
    tgt = [_TGT_DET[(definite, agree)], tgt_noun + ("en" if plural else "")]
    tgt += [t + _ADJ_SUFFIX[agree] for _, t in adjs]
    return src, tgt


def _synthetic_sentence(rng: np.random.Generator, lex: _Lexicon) -> Pair:
    """``S V [O] [PREP NP]`` -> ``S' [O'] [PREP' NP'] V'``; 3 to 15 words on each side."""
    subj = _noun_phrase(rng, lex, max_adj=2)
    src_verb, tgt_verb = lex.verbs[rng.integers(len(lex.verbs))]
    src, tgt = [*subj[0], src_verb], list(subj[1])
    if rng.random() < 0.7:  # transitive
        obj = _noun_phrase(rng, lex, max_adj=3)
        src += obj[0]
        tgt += obj[1]
    if rng.random() < 0.5:  # prepositional phrase
        src_prep, tgt_prep = lex.preps[rng.integers(len(lex.preps))]
        pp = _noun_phrase(rng, lex, max_adj=2)
        src += [src_prep, *pp[0]]
        tgt += [tgt_prep, *pp[1]]
    tgt.append(tgt_verb)
    return " ".join(src), " ".join(tgt)


def synthetic_pairs(n: int, seed: int, split: int) -> list[Pair]:
    """``n`` synthetic (source, target) pairs; split 0/1/2 = train/valid/test use disjoint streams.

    Example (source -> target)::

        ta gedu sesibi molo ne -> le hyvucy fozacu mofo
        (the ADJ NOUN VERB ...) -> (the NOUN ADJ-agreeing ... VERB)
    """
    lex = _lexicon()
    rng = np.random.default_rng([seed, split, 7919])
    return [_synthetic_sentence(rng, lex) for _ in range(n)]


def synthetic_split_sizes(train_size: int) -> tuple[int, int, int]:
    """(train, valid, test) sizes: eval splits are a tenth of train, between 50 and 1000 pairs."""
    eval_size = int(min(1000, max(50, train_size // 10)))
    return train_size, eval_size, eval_size


def read_split(config: Any, split: str) -> list[Pair]:
    """Raw pairs of ``split`` in {"train", "valid", "test"} from the source the config names."""
    data = config.data
    prefix = data[f"{split}_prefix"]
    if data.source == "text":
        return read_text(data.dir, prefix, data.src, data.tgt)
    if data.source == "tfds":
        return read_tfds(data.tfds_name, prefix, data.src, data.tgt, data.dir)
    if data.source == "synthetic":
        index = ("train", "valid", "test").index(split)
        size = synthetic_split_sizes(int(data.synthetic_size))[index]
        return synthetic_pairs(size, int(config.seed), index)
    raise ValueError(f"unknown config.data.source {data.source!r}: expected one of {SOURCES}")


# -----------------------------------------------------------------------------------------------
# Tokenizer: joint SentencePiece vocabulary.
# -----------------------------------------------------------------------------------------------
class Tokenizer:
    """A SentencePiece model with ``pad = 0``, ``eos = 1``, ``unk = 2`` and no BOS.

    ``encode`` returns the pieces without EOS (the pipeline appends it); ``decode`` stops at the
    first EOS and ignores padding, so it takes a raw model output row.
    """

    def __init__(self, model_path: str):
        import sentencepiece as spm

        self.path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
        self.pad_id, self.eos_id = PAD_ID, EOS_ID
        if self.sp.pad_id() != PAD_ID or self.sp.eos_id() != EOS_ID:
            raise ValueError(
                f"{model_path}: expected pad={PAD_ID}, eos={EOS_ID}, got pad={self.sp.pad_id()}, "
                f"eos={self.sp.eos_id()}; delete it to retrain"
            )

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        out: list[int] = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i != PAD_ID:
                out.append(i)
        return self.sp.decode(out)


def train_tokenizer(
    pairs: Sequence[Pair],
    model_path: str,
    vocab_size: int,
    *,
    seed: int,
    character_coverage: float = 0.9995,
    model_type: str = "unigram",
) -> None:
    """Trains a joint SentencePiece model on both sides of ``pairs`` and writes ``model_path``.

    Several hosts may race on a shared workdir: each trains into a unique temporary file and links
    it into place only if no model is there yet, so all hosts end up loading the same file.
    Raises ``ValueError`` with a suggested size when the text cannot support ``vocab_size``
    (SentencePiece's hard vocabulary limit is kept: the vocabulary size is exactly the config's).
    """
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)  # SentencePiece samples sentences with its own RNG
    sentences = (s for pair in pairs for s in pair)
    tmp_path = f"{model_path}.tmp-{uuid.uuid4().hex}"
    with open(tmp_path, "wb") as f:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences,
                model_writer=f,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                pad_id=PAD_ID,
                eos_id=EOS_ID,
                unk_id=UNK_ID,
                bos_id=-1,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            if "Vocabulary size too high" in str(e) or "Vocabulary size is smaller" in str(e):
                limit = str(e).rsplit("<=", 1)[-1].strip(" .") if "<=" in str(e) else "?"
                raise ValueError(
                    f"config.data.vocab_size={vocab_size} is too large for the training text "
                    f"({len(pairs)} pairs): SentencePiece can build at most {limit} pieces; set a "
                    "smaller config.data.vocab_size"
                ) from e
            raise
    try:
        os.link(tmp_path, model_path)  # atomic and fails if another host got there first
    except FileExistsError:
        logger.info("another process wrote %s first; using it", model_path)
    except OSError:  # a filesystem without hard links: fall back to an atomic rename
        if not os.path.exists(model_path):
            os.replace(tmp_path, model_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


def get_tokenizer(config: Any, workdir: str, train_pairs: Sequence[Pair]) -> Tokenizer:
    """Loads ``{workdir}/spm.model`` or trains it on (a seeded sample of) ``train_pairs``.

    Raises ``ValueError`` if a cached model's size differs from ``config.data.vocab_size``.
    """
    data = config.data
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "spm.model")
    if not os.path.exists(path):
        pairs = train_pairs
        limit = int(data.vocab_sample_sentences)
        if len(pairs) > limit:
            # A seeded random sample, not the head: WMT's train split is ordered by sub-corpus.
            rows = np.sort(
                np.random.default_rng([int(config.seed), 17]).choice(
                    len(pairs), limit, replace=False
                )
            )
            pairs = [pairs[i] for i in rows]
        pairs = [p for p in pairs if p[0].strip() and p[1].strip()]
        logger.info(
            "training a %d-piece SentencePiece model on %d pairs -> %s",
            data.vocab_size,
            len(pairs),
            path,
        )
        train_tokenizer(
            pairs,
            path,
            int(data.vocab_size),
            seed=int(config.seed),
            character_coverage=float(data.get("character_coverage", 0.9995)),
            model_type=str(data.get("spm_model_type", "unigram")),
        )
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size != int(data.vocab_size):
        raise ValueError(
            f"cached vocabulary {path} has {tokenizer.vocab_size} pieces but "
            f"config.data.vocab_size is {data.vocab_size}: delete the file to retrain, or use a "
            "fresh workdir"
        )
    return tokenizer


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
    config: Any,
    workdir: str,
    *,
    batch_multiple: int = 1,
    process_index: int | None = None,
    process_count: int | None = None,
    raw_train: list[Pair] | None = None,
) -> Datasets:
    """Reads, tokenizes and batches the train/valid/test splits that ``config.data`` names.

    Args:
      config: the experiment config (``config.data.*`` and ``config.seed``; configs/wmt_base.py).
      workdir: where the SentencePiece model is cached (``{workdir}/spm.model``).
      batch_multiple: global batch sizes are multiples of this (the data-parallel mesh size).
      process_index, process_count: this host and the number of hosts (default: from JAX). Each
        host gets rows ``[p * B / P, (p + 1) * B / P)`` of every global batch of ``B`` rows.
      raw_train: the train split as :func:`read_split` returns it, if already read.
    """
    check_config(config)
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    data = config.data
    max_len, max_tokens = int(data.max_len), int(data.max_tokens)
    multiple = math.lcm(int(batch_multiple), int(process_count))
    step = int(data.get("bucket_step", 8))
    if step < 1:
        raise ValueError(f"config.data.bucket_step must be >= 1, got {step}")
    lengths = bucket_lengths(max_len, min_len=step, step=step)
    if max_tokens < multiple * lengths[-1]:
        raise ValueError(
            f"config.data.max_tokens={max_tokens} cannot hold {multiple} rows (batch multiple) of "
            f"max_len={lengths[-1]} tokens: raise max_tokens to >= {multiple * lengths[-1]} or "
            "lower max_len"
        )
    sizes = [bucket_batch_size(n, max_tokens, multiple) for n in lengths]

    if raw_train is None:
        raw_train = read_split(config, "train")
    tokenizer = get_tokenizer(config, workdir, raw_train)
    stats: dict[str, Any] = {
        "vocab_size": tokenizer.vocab_size,
        "buckets": list(zip(lengths, sizes, strict=True)),
    }

    kept, empty = drop_empty(raw_train)
    examples, too_long = tokenize_pairs(tokenizer, kept, max_len=max_len)
    del raw_train, kept
    train = TrainBatches(
        examples,
        lengths,
        sizes,
        seed=int(config.seed),
        process_index=process_index,
        process_count=process_count,
    )
    real = int(np.diff(examples.tgt_offsets).sum())
    padded = sum(sizes[b] * lengths[b] for b, _ in train.epoch_plan(0))
    stats["train"] = {
        "pairs": len(examples) + too_long + empty,
        "empty": empty,
        "too_long": too_long,
        "kept": len(examples),
        "batches_per_epoch": train.num_batches,
        "target_padding_fraction": 1.0 - real / max(padded, 1),
    }
    logger.info("train: %s", stats["train"])
    if empty or too_long:
        logger.warning(
            "train: skipped %d pairs with an empty side and %d pairs with a side over "
            "max_len=%d tokens",
            empty,
            too_long,
            max_len,
        )

    evals = {}
    for name in ("valid", "test"):
        evals[name] = _eval_split(
            tokenizer,
            read_split(config, name),
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
