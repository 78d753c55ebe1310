"""Translation sources: raw (source, target) text pairs from TFDS, text files or the synthetic pair.

Chosen by ``config.data.source`` (schema: ``configs/wmt.py``):

* ``tfds``      -- a TFDS translation dataset (``wmt14_translate/de-en``); the fields named by
                   ``config.data.src`` / ``config.data.tgt`` are read, so the direction never
                   depends on the dataset's ``supervised_keys`` (for de-en: ``("de", "en")``).
* ``text``      -- line-aligned files ``{dir}/{prefix}.{lang}`` or ``{dir}/{prefix}.{lang}.gz``.
* ``synthetic`` -- a generated language pair (:mod:`sparsemixer_jax.data.synthetic`).

TensorFlow / TFDS are imported only inside :func:`read_tfds`.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import os
import socket
import zlib
from collections.abc import Iterator
from typing import Any

from sparsemixer_jax.data import Pair
from sparsemixer_jax.data.synthetic import synthetic_pairs, synthetic_split_sizes
from sparsemixer_jax.section import cast, check_positive, read_fields

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
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -----------------------------------------------------------------------------------------------
# The config section.
# -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``config.data`` of a translation run (schema and meaning of each field:
    ``configs/wmt.py``), with the run's ``seed`` (vocabulary sample, synthetic pair, batch order).
    """

    source: str
    src: str
    tgt: str
    train_prefix: str
    valid_prefix: str
    test_prefix: str
    vocab_size: int
    vocab_sample_sentences: int
    max_len: int
    max_tokens: int
    seed: int
    dir: str = ""
    tfds_name: str = ""
    synthetic_size: int = 0
    bucket_step: int = 8
    character_coverage: float = 0.9995
    spm_model_type: str = "unigram"

    @classmethod
    def from_config(cls, config: Any, where: str = "config.data.") -> DataConfig:
        """``config.data`` (and ``config.seed``) of the experiment config ``config``, checked:
        one-line ValueErrors naming every missing field, or the first bad one."""
        if "data" not in config:
            raise ValueError("config has no `data` section (see configs/wmt.py for the schema)")
        data = config.data
        if "source" not in data:
            raise ValueError("config.data is missing field 'source' (one of tfds, text, "
                             "synthetic)")
        if data.source not in SOURCES:
            raise ValueError(f"unknown config.data.source {data.source!r}: expected one of "
                             f"{', '.join(SOURCES)}")
        needed = _COMMON_FIELDS + _SOURCE_FIELDS[data.source]
        missing = [f for f in needed if f not in data]
        if "seed" not in config:
            missing.append("seed (top level)")
        if missing:
            raise ValueError(f"config.data is missing fields for source {data.source!r}: "
                             f"{missing} (see configs/wmt.py for the schema)")
        section = cls(seed=cast(int, config.seed, "config.seed"),
                      **read_fields(cls, data, where, skip=("seed",)))
        if section.max_len < 2:
            raise ValueError(f"{where}max_len must be >= 2 (text + EOS), got {section.max_len}")
        if section.bucket_step < 1:
            raise ValueError(f"{where}bucket_step must be >= 1, got {section.bucket_step}")
        check_positive(where, vocab_size=section.vocab_size, max_tokens=section.max_tokens)
        return section


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


def first_non_utf8(path: str) -> str:
    """Where the first byte that is not UTF-8 lies in ``path`` (plain or ``.gz``):
    ``"{path}, line {n}, byte {b}: 0x.. is not UTF-8"`` (``b`` counts bytes from 1 within the
    line), for an error message."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}, line {number}, byte {e.start + 1}: 0x{raw[e.start]:02x} is not "
                        "UTF-8 (convert the file, e.g. iconv -f latin1 -t utf-8)")
    return f"{path}: not UTF-8 text"


def iter_lines(path: str, *, universal_newlines: bool = False) -> Iterator[str]:
    """The lines of a UTF-8 text file, plain or gzip-compressed (``.gz``), without line endings,
    one at a time (:func:`read_lines` reads them all).

    Lines end at ``\n`` only (a ``\r`` before it goes too): a stray carriage return inside a
    line of a parallel file must not split it in two, or the two files would seem misaligned
    or, worse, align wrongly. ``universal_newlines`` ends them at ``\r`` as well.

    Raises ``ValueError`` on one line naming the file: for a byte that is not UTF-8 (and its
    line), a truncated or corrupt ``.gz`` file, or a file that cannot be read.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8",
                    newline=None if universal_newlines else "\n") as f:
            # Only the line ending goes: a line's own spaces are kept until the shared check.
            for line in f:
                yield line.removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise ValueError(first_non_utf8(path)) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # the stream ends early, bad data
        raise ValueError(f"{path}: truncated or corrupt gzip file ({e}); download or "
                         "compress it again") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_lines(path: str, *, universal_newlines: bool = False) -> list[str]:
    """All the lines of :func:`iter_lines` (same line endings, same one-line errors)."""
    return list(iter_lines(path, universal_newlines=universal_newlines))


def read_text(directory: str, prefix: str, src: str, tgt: str) -> list[Pair]:
    """Reads line-aligned ``{directory}/{prefix}.{src|tgt}[.gz]`` into ``[(src_line, tgt_line)]``.

    Raises ``FileNotFoundError`` naming both paths tried, ``ValueError`` naming both files and both
    line counts when they are not aligned, or naming the file (and line) that is not UTF-8 text
    or a truncated ``.gz`` (:func:`read_lines`).
    """
    directory = resolve_data_dir(directory)
    src_path = _find_text_file(directory, prefix, src)
    tgt_path = _find_text_file(directory, prefix, tgt)
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    _check_aligned(src_path, len(src_lines), tgt_path, len(tgt_lines))
    return list(zip(src_lines, tgt_lines, strict=True))


def _check_aligned(src_path: str, src_count: int, tgt_path: str, tgt_count: int) -> None:
    if src_count != tgt_count:
        raise ValueError(
            f"misaligned parallel files: {src_path} has {src_count} lines but {tgt_path} has "
            f"{tgt_count} lines"
        )


def check_text_files(config: Any) -> None:
    """For ``config.data.source == "text"``: every split's two files are there, are UTF-8 text
    (intact, for ``.gz``), have as many lines as each other and hold a pair with text on both
    sides; raises the one-line error reading the split would raise later.

    The run calls this before it writes anything or trains its vocabulary, so that a bad
    validation or test file stops it at once instead of after the vocabulary is trained (and
    leaves no workdir behind). Each file is read once more, a line at a time (constant memory).
    """
    data = config.data
    if data.source != "text":  # TFDS checks its own files; the synthetic pair has none
        return
    directory = resolve_data_dir(data.dir)
    for split in ("train", "valid", "test"):
        prefix = data[f"{split}_prefix"]
        src_path = _find_text_file(directory, prefix, data.src)
        tgt_path = _find_text_file(directory, prefix, data.tgt)
        src_count = tgt_count = 0
        usable = False
        for src, tgt in itertools.zip_longest(iter_lines(src_path), iter_lines(tgt_path)):
            src_count += src is not None
            tgt_count += tgt is not None
            usable = usable or bool(src and tgt and src.strip() and tgt.strip())
        _check_aligned(src_path, src_count, tgt_path, tgt_count)
        if not usable:
            raise ValueError(
                f"the {split} split has no usable pairs ({src_count} read, all with an empty "
                f"side): check config.data.{split}_prefix and config.data.source"
            )


def download_servers_reachable(name: str, timeout: float = 5.0) -> bool:
    """Whether a TCP connection opens, within ``timeout`` seconds, to a server a TFDS download of
    ``name`` needs: the Cloud Storage bucket where TFDS mirrors datasets, or for WMT the
    statmt.org servers every WMT builder downloads from. Without this check an offline machine
    spends minutes in TFDS's download retries before failing."""
    hosts = [("storage.googleapis.com", 443)]
    if name.startswith("wmt"):
        hosts.append(("www.statmt.org", 80))
    for host, port in hosts:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError:
            continue
        return True
    return False


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
    if not builder.is_prepared() and not download_servers_reachable(name):
        raise FileNotFoundError(
            f"TFDS dataset {name!r} is not prepared in {builder.data_dir} and its download "
            "servers cannot be reached from this machine; prepare it on a machine with network "
            "access and copy it over, then point config.data.dir (or TFDS_DATA_DIR) at the copy "
            "(docs/translation.md, 'WMT'14 without network')"
        )
    builder.download_and_prepare()
    ds = builder.as_dataset(split=split, shuffle_files=False)
    return [(ex[src].decode("utf-8"), ex[tgt].decode("utf-8")) for ex in tfds.as_numpy(ds)]


def read_split(data: DataConfig, split: str) -> list[Pair]:
    """Raw pairs of ``split`` in {"train", "valid", "test"} from the source the data section
    ``data`` names."""
    prefix = getattr(data, f"{split}_prefix")
    if data.source == "text":
        return read_text(data.dir, prefix, data.src, data.tgt)
    if data.source == "tfds":
        return read_tfds(data.tfds_name, prefix, data.src, data.tgt, data.dir)
    if data.source == "synthetic":
        index = ("train", "valid", "test").index(split)
        size = synthetic_split_sizes(data.synthetic_size)[index]
        return synthetic_pairs(size, data.seed, index)
    raise ValueError(f"unknown config.data.source {data.source!r}: expected one of {SOURCES}")
