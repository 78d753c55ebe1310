"""GLUE: the loader on fixture files of every task layout and on the shared data, encoder inputs,
batches, and (below) fine-tuning end to end on a tiny encoder."""

import gzip
import json
import os
import types

import numpy as np
import pytest

from sparsemixer_jax.data import glue
from sparsemixer_jax.tasks import finetuning, pretraining
from sparsemixer_jax.token_ids import CLS_ID, SEP_ID
from sparsemixer_jax.training.optim import weight_decay_mask

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


# ----- fine-tuning ------------------------------------------------------------------------------
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "big", "small", "red", "blue"]


def synthetic_rows(rng, n, regression=False):
    """SST-2-like rows whose first word decides the label (STS-B-like: a score in [0, 5] that is
    the number of "good" words); a tiny encoder learns the classification in a few steps."""
    rows = []
    for _ in range(n):
        body = " ".join(rng.choice(WORDS, rng.integers(3, 8)))
        if regression:
            k = int(rng.integers(0, 6))
            rows.append(f"{' '.join(['good'] * k)} {body}\t{body}\t{k:.1f}")
        else:
            label = int(rng.integers(2))
            rows.append(f"{'good' if label else 'bad'} {body}\t{label}")
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, electra_run):
    """Pretrain -> fine-tune end to end: the tiny ELECTRA of ``tests/tiny_electra_config.py``
    (2 layers, both MoE) that the test run pretrains once (tests/conftest.py's ``electra_run``),
    loaded back with ``pretraining.load_pretrained``; a GLUE directory with a synthetic SST-2 and
    STS-B; the smoke config pointed at it."""
    from configs import glue_smoke

    root = tmp_path_factory.mktemp("glue_finetune")
    rng = np.random.default_rng(0)
    stsb_header = FIXTURES["STS-B"][0]
    for split, n in (("train", 128), ("dev", 64)):
        write_tsv(root / "glue" / "SST-2" / f"{split}.tsv",
                  ["sentence\tlabel", *synthetic_rows(rng, n)])
        write_tsv(root / "glue" / "STS-B" / f"{split}.tsv",
                  [stsb_header] + ["0\tm\tf\t2012\t0\tn\tn\t" + r
                                   for r in synthetic_rows(rng, n // 2, regression=True)])
    pretrained = electra_run.workdir  # read, never written: fine-tuning writes under root
    loaded = pretraining.load_pretrained(pretrained)  # the last checkpoint, as run_tasks
    encoder, tokenizer, pretrain_config = loaded.encoder, loaded.tokenizer, loaded.config

    config = glue_smoke.get_config()
    config.glue_dir = str(root / "glue")
    config.eval_batch_size = 32
    # 6 epochs of 8 updates. The pretraining vocabulary has no piece for "good" or "bad" (the
    # label word, spelled in characters here), and the accuracy this pretrained model reaches
    # rises steeply with the epochs: 0.55, 0.59, 0.94 after 2, 3, 4, then 1.0 after 6 and 8.
    # Two epochs past the first that reaches 0.9 leave a margin for a shift of the schedule.
    config.grid.epochs = (6,)
    return types.SimpleNamespace(
        root=str(root), pretrained=pretrained, config=config, tokenizer=tokenizer,
        encoder=encoder, pretrain_config=pretrain_config,
        settings=finetuning.settings_record(config, pretrained, "last", step=loaded.step,
                                            digest=loaded.digest),
    )


@pytest.fixture(scope="module")
def sst2_run(tiny):
    """``run_tasks``, the experiment's entry point: load the pretrained run, fine-tune SST-2."""
    workdir = os.path.join(tiny.root, "out")
    compiled = finetuning.finetuning_step._cache_size()
    summary = finetuning.run_tasks(tiny.config, tiny.pretrained, ["sst2"], workdir)
    compiled = finetuning.finetuning_step._cache_size() - compiled
    task = finetuning.load_task_data(tiny.config, "sst2", tiny.tokenizer)
    return workdir, task, summary["tasks"]["SST-2"], compiled


def test_one_grid_point_compiles_its_step_once(sst2_run):
    """Every SST-2 batch here has one shape, so its 48 updates run one executable: the fresh
    head's and optimizer's arrays are placed as the checkpoint's encoder arrays and the step's
    outputs are (a state of mixed placements compiled the step again after the first update)."""
    assert sst2_run[3] == 1


def test_finetune_learns_and_writes_results(sst2_run):
    workdir, _, summary, _ = sst2_run
    # 64 dev rows, chance 0.5 (standard error 0.0625): 0.9 is 6 standard errors above it.
    assert summary["dev"]["dev"]["accuracy"] >= 0.9
    assert summary["score"] == summary["dev"]["dev"]["accuracy"]
    assert summary["task"] == "SST-2" and summary["grid_size"] == 1
    assert summary["train_examples"] == 128 and summary["dev_examples"] == {"dev": 64}
    point = summary["points"][0]["name"]
    with open(os.path.join(workdir, "SST-2", "points", point + ".json")) as f:
        record = json.load(f)
    assert [e["epoch"] for e in record["epochs"]] == [1, 2, 3, 4, 5, 6]
    assert record["steps"] == 6 * 128 // 16
    assert record["epochs"][1]["train_loss"] < record["epochs"][0]["train_loss"]
    assert record["epochs"][0]["balance_loss"] > 0  # the MoE layer's loss is part of training
    best = max(record["epochs"], key=lambda e: e["score"])
    assert record["best_epoch"] == best["epoch"] and record["score"] == best["score"]
    with open(os.path.join(workdir, "SST-2", "results.json")) as f:
        assert json.load(f)["best"]["point"]["learning_rate"] == 1e-3


def test_rerun_skips_finished_points_and_refuses_other_settings(tiny, sst2_run, monkeypatch):
    config, encoder, pretrain_config, settings = (
        tiny.config, tiny.encoder, tiny.pretrain_config, tiny.settings)
    workdir, task, summary, _ = sst2_run

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished grid point was fine-tuned again")

    monkeypatch.setattr(finetuning, "finetune_point", must_not_run)
    again = finetuning.run_task(config, task, encoder, pretrain_config, workdir, settings)
    assert again["score"] == summary["score"] and again["points"] == summary["points"]
    other = {**settings, "max_len": settings["max_len"] + 1}
    with pytest.raises(ValueError, match="max_len=64, this run has 65"):
        finetuning.run_task(config, task, encoder, pretrain_config, workdir, other)
    skipping = {**settings, "skip_bad_rows": True}  # other data: malformed rows left out
    with pytest.raises(ValueError, match="skip_bad_rows=False, this run has True"):
        finetuning.run_task(config, task, encoder, pretrain_config, workdir, skipping)
    # A new grid point is run; the finished one is kept.
    bigger = config.copy_and_resolve_references()
    bigger.grid.learning_rate = (1e-3, 2e-3)
    with pytest.raises(AssertionError, match="fine-tuned again"):
        finetuning.run_task(bigger, task, encoder, pretrain_config, workdir, settings)


def test_regression_task_and_summary_over_tasks(tiny, sst2_run):
    from lab.studies.glue_table import comparison_table, row_from_results, summary_table

    workdir, _, _, _ = sst2_run
    stsb = finetuning.load_task_data(tiny.config, "STS-B", tiny.tokenizer)
    assert stsb.train.labels.dtype == np.float32
    config = tiny.config.copy_and_resolve_references()
    config.grid.epochs = (1,)
    result = finetuning.run_task(config, stsb, tiny.encoder, tiny.pretrain_config, workdir,
                               tiny.settings)
    assert set(result["dev"]["dev"]) == {"pearson", "spearman"}
    assert np.isfinite(result["dev"]["dev"]["pearson"])
    summary = finetuning.collect_results(workdir)
    assert list(summary["tasks"]) == ["SST-2", "STS-B"]
    table = summary_table(summary)
    assert "| SST-2 | accuracy " in table and "| STS-B | pearson " in table
    row = row_from_results(summary)
    assert row["STS-B"] == pytest.approx(100 * result["dev"]["dev"]["spearman"])
    _, data = comparison_table({"ours": row})
    assert data["average_over"] == ["SST-2", "STS-B"]
    assert data["rows"]["ours"]["AVG"] == pytest.approx((row["SST-2"] + row["STS-B"]) / 2)


def test_grid_is_the_papers():
    from configs import glue as glue_config
    from configs import glue_smoke

    config = glue_config.get_config()
    # The paper's Appendix table "fine-tune".
    assert tuple(config.grid.learning_rate) == (5e-5, 1e-4, 3e-4)
    assert tuple(config.grid.epochs) == (2, 3, 5, 10)
    assert tuple(config.grid.batch_size) == (16, 32)
    assert tuple(config.grid.weight_decay) == (0.0, 0.01)
    assert tuple(config.grid.warmup) == (0.06, 0.1)
    assert (config.max_len, config.optim.eps, config.optim.clip_norm) == (256, 1e-6, 1.0)
    assert (config.optim.b1, config.optim.b2) == (0.9, 0.98)
    points = finetuning.grid_points(config.grid)
    assert len(points) == 96 and len({p.name for p in points}) == 96
    assert len(finetuning.grid_points(glue_smoke.get_config().grid)) == 1
    bad = glue_config.get_config()
    bad.grid.warmup = (1.5,)
    with pytest.raises(ValueError, match="invalid point"):
        finetuning.check_config(bad)


def test_schedule_losses_and_decay_mask(tiny):
    import jax.numpy as jnp
    from flax import nnx

    # The paper's schedule: linear warm-up over 10% of 100 updates, then linear decay to 0 at the
    # last. Update n (optax's count n - 1) gets 1e-4 * n / 10 up to n = 10, then
    # 1e-4 * (100 - n) / 90: the first update moves the weights, the peak is reached at the end
    # of the warm-up, the last update has rate 0.
    schedule = finetuning.finetuning_schedule(1e-4, total_steps=100, warmup=0.1)
    counts = np.arange(100)
    values = np.asarray([float(schedule(c)) for c in counts])
    n = counts + 1
    want = np.where(n <= 10, 1e-4 * n / 10, 1e-4 * (100 - n) / 90)
    np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-12)  # float32
    assert values[0] == pytest.approx(1e-5) and values.argmax() == 9 and values[-1] == 0.0
    assert (np.diff(values[:10]) > 0).all() and (np.diff(values[9:]) < 0).all()
    no_warmup = finetuning.finetuning_schedule(1e-4, total_steps=4, warmup=0.0)
    assert [float(no_warmup(c)) for c in range(4)] == pytest.approx([7.5e-5, 5e-5, 2.5e-5, 0.0])

    logits = jnp.asarray([[2.0, 0.0], [0.0, 1.0]])
    expected = [np.log1p(np.exp(-2.0)), np.log1p(np.exp(-1.0))]
    np.testing.assert_allclose(finetuning.example_losses(logits, jnp.asarray([0, 1]), False),
                               expected, rtol=1e-6)
    np.testing.assert_allclose(
        finetuning.example_losses(jnp.asarray([[1.5], [0.0]]), jnp.asarray([1.0, 2.0]), True),
        [0.25, 4.0])

    model = finetuning.Classifier(tiny.encoder, 2, dropout=0.1, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat = {"/".join(map(str, k)): v for k, v in
            jax_flatten(weight_decay_mask(params)).items()}
    assert flat["dense/kernel"] and not flat["dense/bias"]
    decayed = {k.rsplit("/", 1)[-1] for k, v in flat.items() if v}
    kept = {k.rsplit("/", 1)[-1] for k, v in flat.items() if not v}
    assert decayed == {"kernel", "embedding", "wi", "wo"}
    # Admin's residual scales (the ELECTRA configs' model.init) are vectors: kept, like omega.
    assert kept == {"bias", "scale", "bi", "bo", "omega", "attn_residual_scale",
                    "ffn_residual_scale"}


def jax_flatten(tree):
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(getattr(k, "key", k) for k in path): v for path, v in leaves}


# ----- tables -----------------------------------------------------------------------------------
def fake_summary(scores):
    """A results.json summary with the given Table 2 scores (fractions); MNLI takes (m, mm)."""
    tasks = {}
    for name, score in scores.items():
        spec = glue.TASKS[name]
        values = score if isinstance(score, tuple) else (score,)
        dev = {split: {m: v for m in spec.metrics}
               for split, v in zip(spec.dev_splits, values, strict=True)}
        tasks[name] = {"dev": dev, "score": float(np.mean(values)), "grid_size": 96,
                       "points": [{}] * 3,
                       "best": {"epoch": 2, "point": {"learning_rate": 1e-4, "epochs": 3,
                                                      "batch_size": 32, "weight_decay": 0.01,
                                                      "warmup": 0.06}}}
    return {"tasks": tasks}


def test_paper_table_averages_count_mnli_once():
    from lab.studies.glue_table import COLUMNS, PAPER_TABLE2, average, paper_row

    # The paper's AVG is the mean over eight tasks with MNLI as the mean of -m and -mm: six of
    # its seven rows agree to rounding. The N=4 Switch+SparseMixer row prints 87.63 where its
    # task scores average to 87.684 (a slip in the paper; no other convention gives 87.63).
    for key, row in PAPER_TABLE2.items():
        recomputed = average(paper_row(*key), list(COLUMNS))
        if key == (4, "sparsemixer"):
            assert recomputed == pytest.approx(87.684, abs=0.001)
        else:
            assert recomputed == pytest.approx(row["AVG"], abs=0.006)


def test_comparison_and_summary_tables():
    from lab.studies.glue_table import comparison_table, row_from_results, summary_table

    ours = row_from_results(fake_summary({"RTE": 0.7, "MRPC": 0.8, "MNLI": (0.6, 0.5)}))
    assert ours["MNLI"] == pytest.approx((60.0, 50.0))
    assert (ours["RTE"], ours["MRPC"]) == pytest.approx((70.0, 80.0))
    theirs = row_from_results(fake_summary({"RTE": 0.5, "MRPC": 0.9}))
    markdown, data = comparison_table({"ours": ours, "theirs": theirs})
    assert data["columns"] == ["MNLI", "RTE", "MRPC"]  # Table 2's order
    assert data["average_over"] == ["RTE", "MRPC"]  # only the tasks both rows have
    assert data["rows"]["ours"]["AVG"] == pytest.approx(75.0)
    assert data["rows"]["theirs"]["AVG"] == pytest.approx(70.0)
    lines = markdown.splitlines()
    assert lines[0] == ("| Model | AVG (2 tasks) | MNLI-(m/mm) Acc. | RTE Acc. | MRPC Acc. |")
    assert lines[2] == "| ours | 75.00 | 60.00/50.00 | 70.00 | 80.00 |"
    assert lines[3] == "| theirs | 70.00 | - | 50.00 | 90.00 |"
    table = summary_table(fake_summary({"MRPC": 0.8, "STS-B": 0.5}))
    assert ("| MRPC | accuracy 80.00, f1 80.00 | lr 0.0001, 3 ep, bs 32, wd 0.01, warm-up 0.06 "
            "| 2 | 3/96 |") in table
    assert "| STS-B | pearson 50.00, spearman 50.00 |" in table


def test_task_selection_names_missing_tasks(tmp_path, caplog):
    from configs import glue_smoke

    config = glue_smoke.get_config()
    config.glue_dir = write_glue(tmp_path / "glue", ("RTE", "CoLA"))
    with caplog.at_level("WARNING"):
        assert finetuning.resolve_tasks(config, ["all", "rte"]) == ["CoLA", "RTE"]
    assert "skipped: SST-2, MRPC, STS-B, QQP, MNLI, QNLI" in caplog.text
    # A named task that is not there stops the run before the pretrained model is loaded.
    with pytest.raises(FileNotFoundError, match=r"GLUE task MNLI: no train split.*has: CoLA, RTE"):
        finetuning.run_tasks(config, str(tmp_path / "no_pretraining"), ["cola", "mnli"],
                           str(tmp_path / "out"))


def test_rerun_refuses_points_from_another_checkpoint(tiny, sst2_run, tmp_path):
    """A grid point records the step and content digest of its pretrained checkpoint; points
    from another checkpoint make ``run_task`` and ``run_tasks`` refuse (one line naming both)
    before anything is fine-tuned."""
    import shutil

    workdir, task, _, _ = sst2_run
    point = os.listdir(os.path.join(workdir, "SST-2", "points"))[0]
    with open(os.path.join(workdir, "SST-2", "points", point)) as f:
        record = json.load(f)
    assert record["settings"]["checkpoint"] == "last"
    step = tiny.pretrain_config.train_steps  # the pretrained run's last checkpoint
    assert record["settings"]["checkpoint_step"] == step
    digest = record["settings"]["checkpoint_digest"]
    assert len(digest) == 64 and digest == tiny.settings["checkpoint_digest"]
    other = {**tiny.settings, "checkpoint_step": step + 2, "checkpoint_digest": "ab" * 32}
    with pytest.raises(ValueError, match=(
            rf"fine-tuned from the last checkpoint step {step} \(sha256 {digest[:12]}\), this "
            rf"run loads the last checkpoint step {step + 2} \(sha256 abababababab\)")):
        finetuning.run_task(tiny.config, task, tiny.encoder, tiny.pretrain_config, workdir, other)
    # The same refusal from the entry point, for points whose digest differs from the one on disk.
    copy = str(tmp_path / "glue")
    shutil.copytree(workdir, copy)
    path = os.path.join(copy, "SST-2", "points", point)
    record["settings"]["checkpoint_digest"] = "cd" * 32
    with open(path, "w") as f:
        json.dump(record, f)
    with pytest.raises(ValueError, match=r"sha256 cdcdcdcdcdcd.*mix two pretrained models"):
        finetuning.run_tasks(tiny.config, tiny.pretrained, ["sst2"], copy)


def test_best_point_averages_mnli_matched_and_mismatched(tiny, tmp_path, monkeypatch):
    """MNLI's score is the mean of -m and -mm accuracy, for the best epoch of a point and the
    best point of the grid: scripted dev results where -m alone would pick another point and
    epoch. Training is stubbed out (the pick is what is tested)."""
    import jax.numpy as jnp

    examples = [glue.Example("A cat sat.", "An animal sat.", 1),
                glue.Example("It rains.", "It is dry.", 0)] * 4
    encoded = glue.encode(examples, tiny.tokenizer, 16, regression=False)
    task = finetuning.GlueData(glue.TASKS["MNLI"], encoded,
                               {"dev_matched": encoded, "dev_mismatched": encoded})
    # (matched, mismatched) per call: point lr 1e-3 epochs 1, 2; then point lr 2e-3 epochs 1, 2.
    scripted = iter([(0.90, 0.40), (0.70, 0.68), (0.80, 0.70), (0.85, 0.50)])

    def fake_evaluate(*args):
        m, mm = next(scripted)
        return {"dev_matched": {"accuracy": m}, "dev_mismatched": {"accuracy": mm}}

    def fake_step(graphdef, settings, state, *args):
        zero = jnp.zeros((), jnp.float32)
        return state, {"loss": zero, "balance_loss": zero, "grad_norm": zero}

    monkeypatch.setattr(finetuning, "evaluate_dev", fake_evaluate)
    monkeypatch.setattr(finetuning, "finetuning_step", fake_step)
    config = tiny.config.copy_and_resolve_references()
    config.grid.learning_rate, config.grid.epochs = (1e-3, 2e-3), (2,)
    summary = finetuning.run_task(config, task, tiny.encoder, tiny.pretrain_config,
                                  str(tmp_path), tiny.settings)
    assert summary["best"]["point"]["learning_rate"] == 2e-3 and summary["best"]["epoch"] == 1
    assert summary["score"] == pytest.approx(0.75)
    assert [p["score"] for p in summary["points"]] == pytest.approx([0.69, 0.75])
    assert summary["dev"] == {"dev_matched": {"accuracy": 0.80},
                              "dev_mismatched": {"accuracy": 0.70}}


QQP_BAD = "3\t5\t6\tA question?\t1"  # a field short
MNLI_BAD = FIXTURES["MNLI"][1][0].replace("\tentailment\tentailment", "\tentailment\tmaybe")


def test_bad_rows_strict_by_default_and_skipped_on_request(tmp_path, caplog):
    """QQP and MNLI files with one malformed row each: strict reading names file:line; with
    ``skip_bad_rows`` the row is left out, counted per file and logged."""
    root = tmp_path / "glue"
    write_glue(root, ("QQP", "MNLI"))  # QQP gzipped, MNLI plain
    qqp_header, qqp_rows = FIXTURES["QQP"]
    write_tsv(root / "QQP" / "train.tsv", [qqp_header, qqp_rows[0], QQP_BAD, qqp_rows[1]],
              compress=True)
    mnli_header, mnli_rows = FIXTURES["MNLI"]
    write_tsv(root / "MNLI" / "dev_mismatched.tsv", [mnli_header, *mnli_rows, MNLI_BAD],
              compress=True)
    qqp_train = str(root / "QQP" / "train.tsv.gz")
    with pytest.raises(ValueError, match=rf"{qqp_train}:3: 5 tab-separated fields, header has 6"):
        glue.load_task(str(root), "qqp")
    mm = str(root / "MNLI" / "dev_mismatched.tsv.gz")
    with pytest.raises(ValueError, match=rf"{mm}:4: label 'maybe' is not one of"):
        glue.load_task(str(root), "mnli")
    with caplog.at_level("WARNING"):
        qqp = glue.load_task(str(root), "qqp", skip_bad_rows=True)
        mnli = glue.load_task(str(root), "mnli", skip_bad_rows=True)
    assert [e.label for e in qqp.train] == [1, 0]
    assert qqp.skipped == {qqp_train: 1, str(root / "QQP" / "dev.tsv.gz"): 0}
    assert len(mnli.dev["dev_mismatched"]) == 2 and len(mnli.dev["dev_matched"]) == 2
    assert mnli.skipped[mm] == 1 and sum(mnli.skipped.values()) == 1
    assert f"{qqp_train}: skipped 1 malformed row(s) of 3 (first: {qqp_train}:3:" in caplog.text
    assert f"{mm}: skipped 1 malformed row(s) of 3" in caplog.text
    write_tsv(root / "QQP" / "dev.tsv", [qqp_header, QQP_BAD], compress=True)  # none good left
    with pytest.raises(ValueError, match=r"dev.tsv.gz: no examples \(1 malformed rows skipped"):
        glue.load_task(str(root), "qqp", skip_bad_rows=True)


def test_glue_command_errors_are_one_line(tiny, tmp_path):
    """``experiments.glue`` answers an empty ``--pretrained`` directory, an unknown
    ``--glue_task`` and a refused rerun with one ``error:`` line and exit code 2 (``--task``, the
    flag's earlier name, is read the same)."""
    import subprocess
    import sys

    empty = tmp_path / "empty"
    empty.mkdir()
    workdir = str(tmp_path / "out")
    os.makedirs(os.path.join(workdir, "SST-2", "points"), exist_ok=True)
    with open(os.path.join(workdir, "SST-2", "points", "lr0.001_ep2_bs16_wd0.01_wu0.1.json"),
              "w") as f:
        json.dump({"settings": {**tiny.settings, "checkpoint_digest": "ef" * 32}}, f)
    base = [sys.executable, "-m", "experiments.glue", "--config", "configs/glue_smoke.py",
            f"--config.glue_dir={tiny.config.glue_dir}", "--workdir", workdir]
    cases = [
        (["--pretrained", str(empty), "--task", "sst2"], "config.json not found"),
        (["--pretrained", str(empty), "--glue_task", "wnli"], "unknown GLUE task 'wnli'"),
        (["--pretrained", tiny.pretrained, "--task", "sst2", "--skip-bad-rows"],
         "sha256 efefefefefef"),
    ]
    for args, message in cases:
        done = subprocess.run(base + args, cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
