"""GLUE: the loader on fixture files of every task layout and on the shared data, encoder inputs,
batches, and (below) fine-tuning end to end on a tiny encoder."""

import gzip
import os

import numpy as np
import pytest

from sparsemixer_jax.data import glue
from sparsemixer_jax.data.text import CLS_ID, SEP_ID

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_GLUE = os.environ.get(
    "SPARSEMIXER_GLUE_DIR", os.path.join(REPO, "..", "shared", "data", "glue")
)


def write_tsv(path, lines, *, compress=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(line + "\n" for line in lines)
    if compress:
        with gzip.open(f"{path}.gz", "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


# Two rows per split in each task's own layout (header names, column order, label spelling).
FIXTURES = {
    "CoLA": (None, ["gj04\t1\t\tOur friends won't buy this analysis.",
                    "gj04\t0\t*\tThey drank the pub."]),
    "SST-2": ("sentence\tlabel", ['it \'s a "charming" journey . \t1', "dull . \t0"]),
    "MRPC": ("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
             ["1\t11\t12\the said , \" yes . \"\the agreed .", "0\t13\t14\tone\ttwo"]),
    "STS-B": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
              "\tscore",
              ["0\tmain\tf\t2012\t1\tnone\tnone\tA plane takes off.\tA plane takes off.\t5.000",
               "1\tmain\tf\t2012\t4\tnone\tnone\tA man plays.\tA dog runs.\t0.250"]),
    "QQP": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            ["1\t1\t2\tHow do I learn?\tHow can I learn?\t1", "2\t3\t4\tWhy?\tWhen?\t0"]),
    "MNLI": ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse"
             "\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
             ["0\t1\t1n\tgov\t(\t(\t(\t(\tA cat sat.\tAn animal sat.\tentailment\tentailment",
              "1\t2\t2c\tgov\t(\t(\t(\t(\tIt rains.\tIt is dry.\tneutral\tcontradiction"]),
    "QNLI": ("index\tquestion\tsentence\tlabel",
             ["0\tWho?\tBob did.\tentailment", "1\tWhen?\tIn a box.\tnot_entailment"]),
    "RTE": ("index\tsentence1\tsentence2\tlabel",
            ["0\tBob sleeps.\tBob is asleep.\tentailment", "1\tA.\tB.\tnot_entailment"]),
}
EXPECTED_LABELS = {"CoLA": [1, 0], "SST-2": [1, 0], "MRPC": [1, 0], "STS-B": [5.0, 0.25],
                   "QQP": [1, 0], "MNLI": [1, 0], "QNLI": [0, 1], "RTE": [0, 1]}


def write_glue(root, tasks=tuple(FIXTURES)):
    for i, name in enumerate(tasks):
        header, rows = FIXTURES[name]
        lines = ([header] if header else []) + rows
        for split in ("train", *glue.TASKS[name].dev_splits):
            # Alternate gzip and plain files: the loader takes either.
            write_tsv(root / name / f"{split}.tsv", lines, compress=i % 2 == 0)
    return str(root)


def test_every_task_layout_reads(tmp_path):
    root = write_glue(tmp_path)
    assert glue.available_tasks(root) == list(glue.TASKS)
    for name in glue.TASKS:
        task = glue.load_task(root, name.lower())
        assert task.spec.name == name
        assert set(task.dev) == set(task.spec.dev_splits)
        for split in (task.train, *task.dev.values()):
            assert [e.label for e in split] == EXPECTED_LABELS[name]
            assert (split[0].text_b is None) == (len(task.spec.text_columns) == 1)
    rte = glue.load_task(root, "RTE").train[0]
    assert (rte.text_a, rte.text_b) == ("Bob sleeps.", "Bob is asleep.")
    sst = glue.load_task(root, "sst2").train[0]
    assert sst.text_a == 'it \'s a "charming" journey . '  # bare quotes and spaces kept
    mrpc = glue.load_task(root, "MRPC").train[0]
    assert (mrpc.text_a, mrpc.text_b) == ('he said , " yes . "', "he agreed .")
    assert glue.load_task(root, "CoLA").train[1].text_a == "They drank the pub."


def test_missing_task_names_where_it_looked(tmp_path):
    root = write_glue(tmp_path, ("RTE", "CoLA"))
    assert glue.available_tasks(root) == ["CoLA", "RTE"]
    with pytest.raises(FileNotFoundError) as err:
        glue.load_task(root, "mnli")
    message = str(err.value)
    assert os.path.join(root, "MNLI", "train.tsv") in message and "CoLA, RTE" in message
    with pytest.raises(FileNotFoundError, match="does not exist"):
        glue.load_task(str(tmp_path / "nowhere"), "RTE")
    with pytest.raises(ValueError, match="unknown GLUE task 'wnli'"):
        glue.task_spec("wnli")


@pytest.mark.parametrize(
    "task, row, message",
    [
        ("RTE", "2\tonly two", "2 tab-separated fields, header has 4"),
        ("RTE", "2\tA.\tB.\tmaybe", "label 'maybe' is not one of"),
        ("RTE", "2\t \tB.\tentailment", "empty sentence"),
        ("STS-B", "2\tm\tf\t2012\t1\tn\tn\tA.\tB.\tfive", "score 'five' is not a finite"),
        ("STS-B", "2\tm\tf\t2012\t1\tn\tn\tA.\tB.\tnan", "score 'nan' is not a finite"),
        ("CoLA", "gj04\t1", "2 tab-separated fields, GLUE task CoLA needs at least 4"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, task, row, message):
    header, rows = FIXTURES[task]
    lines = ([header] if header else []) + rows + [row]
    write_tsv(tmp_path / task / "dev.tsv", lines)
    path = str(tmp_path / task / "dev.tsv")
    with pytest.raises(ValueError, match=f"{path}:{len(lines)}: .*{message}"):
        glue.read_split(path, glue.TASKS[task])


def test_header_without_task_columns_is_named(tmp_path):
    write_tsv(tmp_path / "RTE" / "dev.tsv", ["index\tpremise\thypothesis\tlabel", "0\tA\tB\t1"])
    with pytest.raises(ValueError, match=r"dev.tsv:1: header lacks column\(s\) \['sentence1'"):
        glue.read_split(str(tmp_path / "RTE" / "dev.tsv"), glue.TASKS["RTE"])


# The row and label counts of ../shared/data/glue/README.md (the published GLUE statistics).
SHARED_COUNTS = {
    "CoLA": (8551, {"dev": (1043, {1: 721, 0: 322})}),
    "SST-2": (67349, {"dev": (872, {1: 444, 0: 428})}),
    "MRPC": (3668, {"dev": (408, {1: 279, 0: 129})}),
    "STS-B": (5749, {"dev": (1500, None)}),
    "RTE": (2490, {"dev": (277, {0: 146, 1: 131})}),
}


@pytest.mark.skipif(not os.path.isdir(SHARED_GLUE), reason=f"GLUE not found at {SHARED_GLUE}")
@pytest.mark.parametrize("name", sorted(SHARED_COUNTS))
def test_shared_glue_counts(name):
    if name not in glue.available_tasks(SHARED_GLUE):
        pytest.skip(f"{name} not in {SHARED_GLUE}")
    task = glue.load_task(SHARED_GLUE, name)
    train_rows, dev = SHARED_COUNTS[name]
    assert len(task.train) == train_rows
    for split, (rows, counts) in dev.items():
        assert len(task.dev[split]) == rows
        labels = np.asarray([e.label for e in task.dev[split]])
        if counts is None:  # STS-B: scores in [0, 5], dev mean 2.364 (README)
            assert labels.min() >= 0 and labels.max() <= 5
            assert labels.mean() == pytest.approx(2.364, abs=5e-4)
        else:
            assert dict(zip(*np.unique(labels, return_counts=True), strict=True)) == counts


# ----- encoder inputs ---------------------------------------------------------------------------
def reference_truncation(a, b, budget):
    """BERT's _truncate_seq_pair: pop from the longer list until the pair fits."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()
    return a, b


def test_pack_pair_format_and_truncation():
    tokens, segments = glue.pack_pair([10, 11], [20, 21, 22], max_len=16)
    assert tokens == [CLS_ID, 10, 11, SEP_ID, 20, 21, 22, SEP_ID]
    assert segments == [0, 0, 0, 0, 1, 1, 1, 1]
    tokens, segments = glue.pack_pair([10, 11, 12], None, max_len=4)
    assert tokens == [CLS_ID, 10, 11, SEP_ID] and segments == [0, 0, 0, 0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = list(range(100, 100 + rng.integers(1, 30)))
        b = list(range(200, 200 + rng.integers(1, 30)))
        max_len = int(rng.integers(5, 50))
        tokens, segments = glue.pack_pair(a, b, max_len)
        ra, rb = reference_truncation(a, b, max_len - 3)
        assert tokens == [CLS_ID, *ra, SEP_ID, *rb, SEP_ID]
        assert segments == [0] * (len(ra) + 2) + [1] * (len(rb) + 1)
        assert len(tokens) <= max_len
    with pytest.raises(ValueError, match="no room"):
        glue.pack_pair([1], [2], max_len=4)


class WordTokenizer:
    """Whitespace words to ids 10, 11, ... (enough of Tokenizer for glue.encode)."""

    def __init__(self):
        self.ids = {}

    def encode_batch(self, texts):
        return [[self.ids.setdefault(w, 10 + len(self.ids)) for w in t.split()] for t in texts]


def test_encode_and_batches():
    examples = [glue.Example(" ".join(["w"] * n), "x y", n % 3) for n in range(1, 12)]
    data = glue.encode(examples, WordTokenizer(), max_len=12, regression=False)
    assert data.tokens.shape == (11, 12) and data.labels.dtype == np.int32
    assert list(data.lengths) == [min(n + 5, 12) for n in range(1, 12)]
    epoch = list(glue.batches(data, 4, length_step=4, rng=np.random.default_rng(1)))
    assert len(epoch) == 3
    seen = []
    for batch in epoch:
        assert batch["tokens"].shape[0] == 4 and batch["tokens"].shape[1] % 4 == 0
        assert batch["tokens"].shape == batch["segments"].shape
        real = batch["weights"] > 0
        # Every row fits its batch's width; the width is the longest row rounded up to 4.
        lengths = (batch["tokens"] != 0).sum(1)
        assert batch["tokens"].shape[1] == min(12, -(-lengths.max() // 4) * 4)
        seen += [tuple(np.trim_zeros(row, "b")) for row in batch["tokens"][real]]
    assert sorted(seen) == sorted(tuple(np.trim_zeros(row, "b")) for row in data.tokens)
    assert sum(int(b["weights"].sum()) for b in epoch) == 11
    in_order = list(glue.batches(data, 4, length_step=12))
    assert np.array_equal(in_order[0]["labels"], data.labels[:4])
