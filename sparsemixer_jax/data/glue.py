"""GLUE tasks from a directory in the GLUE download layout, and their encoder inputs.

The layout is the one ``download_glue_data.py`` writes (and ``../shared/data/glue`` keeps, gzipped):
``{glue_dir}/{CoLA,SST-2,MRPC,STS-B,QQP,MNLI,QNLI,RTE}/{train,dev}.tsv[.gz]``, MNLI with
``dev_matched`` and ``dev_mismatched`` instead of ``dev``. Files are read as UTF-8 and split on tabs
with no quote handling (SST-2, MRPC and RTE contain bare ``"``). Columns are found by header name,
so a copy with extra or reordered columns still reads; CoLA has no header and is read by position.

Inputs for the encoder are ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` with segment ids 0 up to
and including the first ``[SEP]`` and 1 after it (BERT's format); a pair that does not fit
``max_len`` loses tokens from the end of its longer sentence first.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np

from sparsemixer_jax.data.tokenizer import Tokenizer
from sparsemixer_jax.token_ids import CLS_ID, PAD_ID, SEP_ID

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """How one GLUE task is stored and scored.

    Attributes:
      name: the task's GLUE name, also its directory name.
      dev_splits: the labelled evaluation files (without ``.tsv``).
      text_columns: one column (single sentence) or two (sentence pair): header names, or column
        positions for a task whose files have no header.
      label_column: header name or position of the label.
      labels: the class names in class-id order; ``None`` for regression (a float target).
      metrics: the standard GLUE dev metrics of the task (names in ``glue_metrics.METRICS``).
      score_metric: the metric the paper's Table 2 reports, used to choose the best grid point
        (averaged over ``dev_splits`` for MNLI, as the paper averages MNLI-m and -mm).
      has_header: whether the first line of each file is a header.
    """

    name: str
    dev_splits: tuple[str, ...]
    text_columns: tuple[str, ...] | tuple[int, ...]
    label_column: str | int
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    score_metric: str
    has_header: bool = True

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_outputs(self) -> int:
        """Width of the classifier's output: classes, or 1 for regression."""
        return 1 if self.labels is None else len(self.labels)


_NLI2 = ("entailment", "not_entailment")
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("CoLA", ("dev",), (3,), 1, ("0", "1"), ("matthews",), "matthews",
                 has_header=False),
        TaskSpec("SST-2", ("dev",), ("sentence",), "label", ("0", "1"), ("accuracy",), "accuracy"),
        TaskSpec("MRPC", ("dev",), ("#1 String", "#2 String"), "Quality", ("0", "1"),
                 ("accuracy", "f1"), "accuracy"),
        TaskSpec("STS-B", ("dev",), ("sentence1", "sentence2"), "score", None,
                 ("pearson", "spearman"), "spearman"),
        TaskSpec("QQP", ("dev",), ("question1", "question2"), "is_duplicate", ("0", "1"),
                 ("accuracy", "f1"), "accuracy"),
        TaskSpec("MNLI", ("dev_matched", "dev_mismatched"), ("sentence1", "sentence2"),
                 "gold_label", ("contradiction", "entailment", "neutral"), ("accuracy",),
                 "accuracy"),
        TaskSpec("QNLI", ("dev",), ("question", "sentence"), "label", _NLI2, ("accuracy",),
                 "accuracy"),
        TaskSpec("RTE", ("dev",), ("sentence1", "sentence2"), "label", _NLI2, ("accuracy",),
                 "accuracy"),
    )
}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def task_spec(name: str) -> TaskSpec:
    """The spec of a task named in any case, with or without the dash (``sts-b``, ``stsb``)."""
    by_key = {_key(n): spec for n, spec in TASKS.items()}
    if _key(name) not in by_key:
        raise ValueError(f"unknown GLUE task {name!r}; known tasks: {', '.join(TASKS)}")
    return by_key[_key(name)]


@dataclasses.dataclass(frozen=True)
class Example:
    """One labelled example: ``text_b`` is None for single-sentence tasks; ``label`` is a class
    id, or a float for regression."""

    text_a: str
    text_b: str | None
    label: int | float


@dataclasses.dataclass(frozen=True)
class GlueTask:
    spec: TaskSpec
    train: list[Example]
    dev: dict[str, list[Example]]  # split name -> examples, in file order
    # file -> rows left out as malformed (only with skip_bad_rows; every file read is listed)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)


# -----------------------------------------------------------------------------------------------
# Reading.
# -----------------------------------------------------------------------------------------------
def split_path(glue_dir: str, spec: TaskSpec, split: str) -> str:
    """``{glue_dir}/{task}/{split}.tsv.gz`` or ``.tsv``; ``FileNotFoundError`` names both and the
    tasks the directory does have."""
    base = os.path.join(glue_dir, spec.name, split + ".tsv")
    for path in (base + ".gz", base):
        if os.path.isfile(path):
            return path
    present = available_tasks(glue_dir) if os.path.isdir(glue_dir) else []
    raise FileNotFoundError(
        f"GLUE task {spec.name}: no {split} split, looked for {base}.gz and {base}. "
        + (f"{glue_dir} has: {', '.join(present) or 'no GLUE task'}."
           if os.path.isdir(glue_dir) else f"{glue_dir} does not exist.")
    )


def available_tasks(glue_dir: str) -> list[str]:
    """The tasks (in ``TASKS`` order) whose train and dev files are all present in ``glue_dir``."""
    def has(spec: TaskSpec, split: str) -> bool:
        base = os.path.join(glue_dir, spec.name, split + ".tsv")
        return os.path.isfile(base + ".gz") or os.path.isfile(base)

    return [n for n, s in TASKS.items() if all(has(s, x) for x in ("train", *s.dev_splits))]


def _open_text(path: str):
    # newline="\n": a stray carriage return stays inside its field instead of splitting the row.
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="\n")
    return open(path, encoding="utf-8", newline="\n")


class BadRow(ValueError):
    """A malformed data row (not a header error): ``{file}:{line}: what is wrong``."""


def read_split(path: str, spec: TaskSpec, *, skip_bad_rows: bool = False) -> list[Example]:
    """Reads one TSV file of ``spec``'s task (:func:`read_split_counted` without the count)."""
    return read_split_counted(path, spec, skip_bad_rows=skip_bad_rows)[0]


def read_split_counted(path: str, spec: TaskSpec, *, skip_bad_rows: bool = False
                       ) -> tuple[list[Example], list[str]]:
    """Reads one TSV file of ``spec``'s task: its examples and the messages of skipped rows.

    Strict by default: raises ``ValueError`` naming the file and line of the first malformed
    row (a wrong number of fields, an empty sentence, an unknown label, a non-numeric or
    non-finite score). With ``skip_bad_rows`` such rows are left out and each is reported as
    ``"{path}:{line}: ..."`` in the second return value. A header without the task's columns,
    or a file without one good row, always raises.
    """
    examples: list[Example] = []
    skipped: list[str] = []
    label_ids = {name: i for i, name in enumerate(spec.labels or ())}
    with _open_text(path) as f:
        width = None
        columns = (*spec.text_columns, spec.label_column)
        if spec.has_header:
            header = f.readline().rstrip("\n").lstrip("\ufeff").split("\t")
            missing = [c for c in columns if c not in header]
            if missing:
                raise ValueError(
                    f"{path}:1: header lacks column(s) {missing} of GLUE task {spec.name} "
                    f"(header: {header})"
                )
            width = len(header)
            positions = [header.index(c) for c in columns]
            first_line = 2
        else:
            positions = list(columns)
            first_line = 1
        for line_no, line in enumerate(f, start=first_line):
            line = line.rstrip("\n")
            if not line:
                continue
            try:
                examples.append(_parse_row(line, f"{path}:{line_no}", spec, width, positions,
                                           label_ids))
            except BadRow as err:
                if not skip_bad_rows:
                    raise
                skipped.append(str(err))
    if not examples:
        raise ValueError(f"{path}: no examples" + (f" ({len(skipped)} malformed rows skipped, "
                                                   f"first: {skipped[0]})" if skipped else ""))
    return examples, skipped


def _parse_row(line: str, where: str, spec: TaskSpec, width: int | None,
               positions: list[int], label_ids: dict[str, int]) -> Example:
    """One data row as an :class:`Example`; :class:`BadRow` (``where`` first) if malformed."""
    fields = line.split("\t")
    if width is not None and len(fields) != width:
        raise BadRow(f"{where}: {len(fields)} tab-separated fields, header has {width}")
    if width is None and len(fields) <= max(positions):
        raise BadRow(
            f"{where}: {len(fields)} tab-separated fields, GLUE task {spec.name} needs "
            f"at least {max(positions) + 1}"
        )
    *texts, raw_label = (fields[p] for p in positions)
    if not all(t.strip() for t in texts):
        raise BadRow(f"{where}: empty sentence")
    label: int | float
    if spec.labels is None:
        try:
            label = float(raw_label)
        except ValueError:
            label = float("nan")
        if not np.isfinite(label):
            raise BadRow(f"{where}: score {raw_label!r} is not a finite number")
    elif raw_label in label_ids:
        label = label_ids[raw_label]
    else:
        raise BadRow(
            f"{where}: label {raw_label!r} is not one of {list(spec.labels)}"
        )
    return Example(texts[0], texts[1] if len(texts) > 1 else None, label)


def load_task(glue_dir: str, name: str, *, skip_bad_rows: bool = False) -> GlueTask:
    """Reads the train split and every dev split of task ``name`` from ``glue_dir``.

    Strict unless ``skip_bad_rows`` (:func:`read_split_counted`); skipped rows are counted per
    file in ``GlueTask.skipped`` and logged, with the first one's ``file:line``, as a warning.
    """
    spec = task_spec(name)
    paths = {split: split_path(glue_dir, spec, split) for split in ("train", *spec.dev_splits)}
    read, skipped = {}, {}
    for split, path in paths.items():
        read[split], bad = read_split_counted(path, spec, skip_bad_rows=skip_bad_rows)
        skipped[path] = len(bad)
        if bad:
            logger.warning("%s: skipped %d malformed row(s) of %d (first: %s)", path, len(bad),
                           len(bad) + len(read[split]), bad[0])
    train = read.pop("train")
    return GlueTask(spec, train, read, skipped if skip_bad_rows else {})


# -----------------------------------------------------------------------------------------------
# Encoder inputs.
# -----------------------------------------------------------------------------------------------
def pack_pair(
    ids_a: Sequence[int], ids_b: Sequence[int] | None, max_len: int
) -> tuple[list[int], list[int]]:
    """``[CLS] a [SEP] (b [SEP])`` and its segment ids, truncated to at most ``max_len`` tokens.

    A pair that is too long loses tokens from the end of whichever sentence is longer at that
    moment (the end of ``b`` on a tie), one token at a time, as BERT's ``_truncate_seq_pair``.
    """
    specials = 2 if ids_b is None else 3
    if max_len < specials + (1 if ids_b is None else 2):
        raise ValueError(f"max_len={max_len} leaves no room for the text")
    a, b = list(ids_a), (list(ids_b) if ids_b is not None else [])
    keep_a, keep_b = len(a), len(b)
    while keep_a + keep_b > max_len - specials:
        if keep_a > keep_b:
            keep_a -= 1
        else:
            keep_b -= 1
    a, b = a[:keep_a], b[:keep_b]
    tokens = [CLS_ID, *a, SEP_ID]
    segments = [0] * len(tokens)
    if ids_b is not None:
        tokens += [*b, SEP_ID]
        segments += [1] * (len(b) + 1)
    return tokens, segments


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A split as arrays: ``tokens``/``segments`` int32 ``[N, max_len]`` (0-padded), ``lengths``
    int32 ``[N]``, ``labels`` int32 or float32 ``[N]``."""

    tokens: np.ndarray
    segments: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def encode(
    examples: Sequence[Example], tokenizer: Tokenizer, max_len: int, *, regression: bool
) -> Encoded:
    """Tokenizes and packs ``examples`` (see :func:`pack_pair`)."""
    ids_a = tokenizer.encode_batch([e.text_a for e in examples])
    pairs = examples[0].text_b is not None
    ids_b = tokenizer.encode_batch([e.text_b for e in examples]) if pairs else [None] * len(ids_a)
    n = len(examples)
    tokens = np.full((n, max_len), PAD_ID, np.int32)
    segments = np.zeros((n, max_len), np.int32)
    lengths = np.zeros(n, np.int32)
    for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=True)):
        row, seg = pack_pair(a, b, max_len)
        tokens[i, : len(row)], segments[i, : len(seg)], lengths[i] = row, seg, len(row)
    labels = np.asarray([e.label for e in examples], np.float32 if regression else np.int32)
    return Encoded(tokens, segments, lengths, labels)


def batches(
    data: Encoded,
    batch_size: int,
    *,
    length_step: int,
    rng: np.random.Generator | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of exactly ``batch_size`` rows, shuffled by ``rng`` (file order if None).

    Each batch is cut to its longest row rounded up to a multiple of ``length_step`` (capped at the
    arrays' width), so compiled steps see few shapes. The last batch is filled up with rows of
    ``weights`` 0; ``weights`` is 1 for real rows. Keys: ``tokens``, ``segments`` int32 ``[B, L]``,
    ``labels`` ``[B]``, ``weights`` float32 ``[B]``.
    """
    order = np.arange(len(data)) if rng is None else rng.permutation(len(data))
    width = data.tokens.shape[1]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        real = len(rows)
        # Filler rows repeat the first row (a row of padding alone could make attention's softmax
        # all-masked); their weight 0 keeps them out of the loss and the metrics.
        rows = np.concatenate([rows, np.full(batch_size - real, rows[0], rows.dtype)])
        longest = int(data.lengths[rows].max())
        length = min(width, -(-longest // length_step) * length_step)
        weights = np.zeros(batch_size, np.float32)
        weights[:real] = 1.0
        yield {
            "tokens": data.tokens[rows, :length],
            "segments": data.segments[rows, :length],
            "labels": data.labels[rows],
            "weights": weights,
        }
