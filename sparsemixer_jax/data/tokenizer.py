"""Joint SentencePiece vocabulary: ``pad = 0``, ``eos = 1``, ``unk = 2``, no BOS.

The model's teacher-forcing shift inserts its own start symbol, so there is no BOS.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sparsemixer_jax.data import Pair
from sparsemixer_jax.token_ids import EOS_ID, PAD_ID, UNK_ID

if TYPE_CHECKING:  # sources imports this module's users
    from sparsemixer_jax.data.sources import DataConfig

logger = logging.getLogger(__name__)


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
    sentences: Iterable[str],
    model_path: str,
    vocab_size: int,
    *,
    seed: int,
    character_coverage: float = 0.9995,
    model_type: str = "unigram",
    user_defined_symbols: Sequence[str] = (),
) -> None:
    """Trains a SentencePiece model on ``sentences`` and writes ``model_path``.

    ``user_defined_symbols`` become single pieces with the ids right after ``unk``
    (3, 4, ...), in order.

    Several hosts may race on a shared workdir: each trains into a unique temporary file and links
    it into place only if no model is there yet, so all hosts end up loading the same file.
    Raises ``ValueError`` with a suggested size when the text cannot support ``vocab_size``
    (SentencePiece's hard vocabulary limit is kept: the vocabulary size is exactly the config's).
    """
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)  # SentencePiece samples sentences with its own RNG
    sentences = list(sentences)
    tmp_path = f"{model_path}.tmp-{uuid.uuid4().hex}"
    with open(tmp_path, "wb") as f:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_writer=f,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                pad_id=PAD_ID,
                eos_id=EOS_ID,
                unk_id=UNK_ID,
                bos_id=-1,
                user_defined_symbols=list(user_defined_symbols),
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
            if too_small:  # SentencePiece's "N vs M": M = distinct characters + special pieces
                raise ValueError(
                    f"config.data.vocab_size={vocab_size} is too small for the training text: its "
                    f"characters alone need {too_small.group(1)} pieces: set a larger "
                    f"config.data.vocab_size >= {too_small.group(1)}"
                ) from e
            if "sentences_.empty()" in str(e):
                raise ValueError(
                    "the training text for the vocabulary is empty (no pair with two non-empty "
                    "sides): check config.data.source and config.data.train_prefix"
                ) from e
            if "Vocabulary size too high" in str(e):
                limit = str(e).rsplit("<=", 1)[-1].strip(" .") if "<=" in str(e) else "?"
                raise ValueError(
                    f"config.data.vocab_size={vocab_size} is too large for the training text "
                    f"({len(sentences)} sentences): SentencePiece can build at most {limit} "
                    "pieces; set a smaller config.data.vocab_size"
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


def vocabulary_sample(items: Sequence[Any], limit: int, seed: int) -> list[Any]:
    """At most ``limit`` of ``items`` in their order: a seeded random sample, not the head (WMT's
    train split is ordered by sub-corpus, a text corpus by document)."""
    if len(items) <= limit:
        return list(items)
    rows = np.sort(np.random.default_rng([seed, 17]).choice(len(items), limit, replace=False))
    return [items[i] for i in rows]


def get_tokenizer(data: DataConfig, workdir: str, train_pairs: Sequence[Pair]) -> Tokenizer:
    """Loads ``{workdir}/spm.model`` or trains it on (a seeded sample of) ``train_pairs``, as
    the data section ``data`` says. Raises ``ValueError`` if a cached model's size differs from
    ``data.vocab_size``.
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "spm.model")
    if not os.path.exists(path):
        pairs = vocabulary_sample(train_pairs, data.vocab_sample_sentences, data.seed)
        pairs = [p for p in pairs if p[0].strip() and p[1].strip()]
        logger.info(
            "training a %d-piece SentencePiece model on %d pairs -> %s",
            data.vocab_size,
            len(pairs),
            path,
        )
        train_tokenizer(
            (s for pair in pairs for s in pair),
            path,
            data.vocab_size,
            seed=data.seed,
            character_coverage=data.character_coverage,
            model_type=data.spm_model_type,
        )
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size != data.vocab_size:
        raise ValueError(
            f"cached vocabulary {path} has {tokenizer.vocab_size} pieces but "
            f"config.data.vocab_size is {data.vocab_size}: delete the file to retrain, or use a "
            "fresh workdir"
        )
    return tokenizer
