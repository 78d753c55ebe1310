"""Input pipeline: readers, errors, SentencePiece cache, bucketing, resumable order, hosts, eval."""

import collections
import gzip
import logging
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

from configs.wmt import get_config
from sparsemixer_jax.data import batching, sources, synthetic, translation
from sparsemixer_jax.data import tokenizer as tokenization

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.path.join(REPO, "..", "shared", "data", "multi30k")


def data_section(config) -> sources.DataConfig:
    """The typed data section of an experiment config, as the task builds it."""
    return sources.DataConfig.from_config(config)


def synthetic_config(size: int = 400, vocab: int = 120, max_len: int = 64, max_tokens: int = 1024):
    c = get_config()
    c.data.source = "synthetic"
    c.data.synthetic_size = size
    c.data.vocab_size = vocab
    c.data.vocab_sample_sentences = 300
    c.data.max_len = max_len
    c.data.max_tokens = max_tokens
    return c


def text_config(directory: str, **overrides):
    c = get_config()
    c.data.source = "text"
    c.data.dir = str(directory)
    c.data.train_prefix, c.data.valid_prefix, c.data.test_prefix = "train", "valid", "test"
    c.data.vocab_size = 25
    c.data.max_len = 64
    c.data.max_tokens = 256
    for k, v in overrides.items():
        c.data[k] = v
    return c


def write_pair(directory, prefix: str, src: list[str], tgt: list[str], gz: bool = False):
    for lang, lines in (("en", src), ("de", tgt)):
        path = os.path.join(directory, f"{prefix}.{lang}" + (".gz" if gz else ""))
        opener = gzip.open if gz else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


def rows(batch: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The non-padding rows of a batch as (source ids, target ids) tuples without padding."""
    out = []
    for s, t in zip(batch["inputs"], batch["targets"], strict=True):
        if s[0] != tokenization.PAD_ID:
            out.append((tuple(int(x) for x in s if x), tuple(int(x) for x in t if x)))
    return out


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    config = synthetic_config()
    workdir = str(tmp_path_factory.mktemp("synth"))
    data = translation.load_datasets(
        data_section(config), workdir, batch_multiple=4, process_index=0, process_count=1
    )
    return config, workdir, data


# ----- import hygiene -------------------------------------------------------------------------
def test_import_does_not_load_tensorflow():
    code = (
        "import sys, sparsemixer_jax, sparsemixer_jax.data.translation\n"
        "import sparsemixer_jax.metrics.bleu\n"
        "bad = [m for m in ('tensorflow', 'tensorflow_datasets') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


# ----- config and reader errors ---------------------------------------------------------------
def test_unknown_source_is_named():
    c = synthetic_config()
    c.data.source = "csv"
    with pytest.raises(
        ValueError, match=r"unknown config.data.source 'csv'.*tfds, text, synthetic"
    ):
        translation.load_datasets(data_section(c), "/nonexistent", process_index=0,
                                  process_count=1)


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ("synthetic", "max_tokens"),
        ("text", "dir"),
        ("synthetic", "synthetic_size"),
        ("tfds", "tfds_name"),
    ],
)
def test_missing_config_field_is_named(source, field):
    c = synthetic_config()
    c.data.source = source
    del c.data[field]
    with pytest.raises(ValueError, match=f"missing fields .*'{field}'"):
        data_section(c)


def test_missing_text_file_names_both_paths(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        sources.read_text(str(tmp_path), "train", "en", "de")
    plain = os.path.join(str(tmp_path), "train.en")
    assert plain in str(err.value) and plain + ".gz" in str(err.value)


def test_misaligned_files_name_both_files_and_counts(tmp_path):
    write_pair(tmp_path, "train", ["a", "b", "c"], ["x", "y"])
    with pytest.raises(ValueError) as err:
        sources.read_text(str(tmp_path), "train", "en", "de")
    msg = str(err.value)
    assert "train.en has 3 lines" in msg and "train.de has 2 lines" in msg


def test_read_text_plain_and_gz_and_direction(tmp_path):
    write_pair(tmp_path, "train", ["hello", "two words"], ["hallo", "zwei Wörter"], gz=True)
    write_pair(tmp_path, "valid", ["one"], ["eins"], gz=False)
    assert sources.read_text(str(tmp_path), "train", "en", "de") == [
        ("hello", "hallo"),
        ("two words", "zwei Wörter"),
    ]
    assert sources.read_text(str(tmp_path), "valid", "de", "en") == [("eins", "one")]


def test_truncated_gz_is_one_line_naming_the_file(tmp_path):
    write_pair(tmp_path, "train", [f"sentence {i}" for i in range(2000)],
               [f"Satz {i}" for i in range(2000)], gz=True)
    path = tmp_path / "train.de.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a download cut short
    with pytest.raises(ValueError) as err:
        sources.read_text(str(tmp_path), "train", "en", "de")
    message = str(err.value)
    assert message.startswith(f"{path}: truncated or corrupt gzip file") and "\n" not in message
    path.write_bytes(b"not gzip at all\n")
    with pytest.raises(ValueError, match=r"train\.de\.gz: truncated or corrupt gzip file"):
        sources.read_text(str(tmp_path), "train", "en", "de")


@pytest.mark.parametrize("gz", [False, True])
def test_non_utf8_byte_names_the_file_and_its_line(tmp_path, gz):
    write_pair(tmp_path, "train", ["one", "two", "three"], ["eins", "zwei", "drei"], gz=gz)
    path = tmp_path / ("train.de" + (".gz" if gz else ""))
    latin1 = "eins\nzwei\nGrüße\n".encode("latin-1")  # ü is 0xfc, not UTF-8
    path.write_bytes(gzip.compress(latin1) if gz else latin1)
    with pytest.raises(ValueError) as err:
        sources.read_text(str(tmp_path), "train", "en", "de")
    assert str(err.value).startswith(f"{path}, line 3, byte 3: 0xfc is not UTF-8")
    assert "\n" not in str(err.value)


def test_pretraining_text_errors_name_the_file_and_line(tmp_path):
    from sparsemixer_jax.data import text

    (tmp_path / "a.txt").write_text("fine\n", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"ok\nalso ok\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"b\.txt, line 3, byte 5: 0xff is not UTF-8"):
        text.read_documents(str(tmp_path))
    (tmp_path / "b.txt").unlink()
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"words\n" * 1000)[:40])
    with pytest.raises(ValueError, match=r"c\.txt\.gz: truncated or corrupt gzip file"):
        text.read_documents(str(tmp_path))


# ----- synthetic language -------------------------------------------------------------------
def test_synthetic_is_seeded_and_well_formed():
    a, b, other = (
        synthetic.synthetic_pairs(300, 0, 0),
        synthetic.synthetic_pairs(300, 0, 0),
        synthetic.synthetic_pairs(300, 1, 0),
    )
    assert a == b and a != other
    assert synthetic.synthetic_pairs(300, 0, 1) != a  # valid is a different stream from train
    lengths = [len(s.split()) for s, _ in a]
    assert min(lengths) >= 3 and max(lengths) <= 15 and len(set(lengths)) >= 8
    # Word-for-word (same word count); the verb (the word after the subject NP's noun) goes last
    # and always translates the same way: a dictionary a model can learn.
    verb_translation = collections.defaultdict(set)
    lex = synthetic._lexicon()
    verbs = {s for s, _ in lex.verbs}
    for s, t in a:
        assert len(s.split()) == len(t.split())
        verb = next(w for w in s.split() if w in verbs)
        verb_translation[verb].add(t.split()[-1])
    assert all(len(v) == 1 for v in verb_translation.values())


# ----- tokenizer cache ------------------------------------------------------------------------
def test_tokenizer_ids_and_roundtrip(synth):
    _, _, data = synth
    tok = data.tokenizer
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (120, 0, 1)
    text = data.test_sources[0]
    ids = tok.encode(text)
    assert tokenization.EOS_ID not in ids and tokenization.PAD_ID not in ids
    assert tok.decode([*ids, tokenization.EOS_ID, 5, 6, 0, 0]) == text  # stops at EOS


def test_tokenizer_is_cached_and_size_checked(synth):
    config, workdir, data = synth
    path = os.path.join(workdir, "spm.model")
    mtime = os.path.getmtime(path)
    # No text: the vocabulary must come from the cache.
    again = tokenization.get_tokenizer(data_section(config), workdir, [])
    assert os.path.getmtime(path) == mtime and again.encode("ta") == data.tokenizer.encode("ta")
    bigger = synthetic_config(vocab=150)
    with pytest.raises(
        ValueError, match=r"spm.model has 120 pieces but config.data.vocab_size is 150"
    ):
        tokenization.get_tokenizer(data_section(bigger), workdir, [])


def test_vocab_too_large_fails_with_suggestion(tmp_path):
    c = synthetic_config(size=50, vocab=5000)
    with pytest.raises(ValueError, match=r"vocab_size=5000 is too large.*at most \d+ pieces"):
        tokenization.get_tokenizer(data_section(c), str(tmp_path),
                                   synthetic.synthetic_pairs(50, 0, 0))
    assert not os.path.exists(tmp_path / "spm.model")


# ----- bucketing and batches ------------------------------------------------------------------
def test_bucket_lengths_and_sizes():
    lengths = batching.bucket_lengths(256)
    assert lengths[0] == 8 and lengths[-1] == 256 and lengths == sorted(set(lengths))
    assert len(lengths) <= 16
    for length in lengths:
        size = batching.bucket_batch_size(length, 4096, 8)
        assert size % 8 == 0 and size * length <= 4096 and (size + 8) * length > 4096


def test_train_batches_respect_token_budget_and_cover_the_epoch(synth):
    config, _, data = synth
    train = data.train
    max_tokens = config.data.max_tokens
    seen = []
    shapes = set()
    for _ in range(train.num_batches):
        batch = next(train)
        assert set(batch) == {"inputs", "targets"}
        assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
        b, length = batch["inputs"].shape
        assert batch["targets"].shape == (b, length) and b * length <= max_tokens and b % 4 == 0
        shapes.add((b, length))
        for src, tgt in rows(batch):
            assert src[-1] == tokenization.EOS_ID and tgt[-1] == tokenization.EOS_ID
        seen += rows(batch)
    assert shapes <= set(train.shapes)
    assert train.state()["epoch"] == 0 and train.state()["index"] == train.num_batches
    # One epoch = every training example exactly once.
    expected = [
        (tuple(train.examples.src(i).tolist()), tuple(train.examples.tgt(i).tolist()))
        for i in range(len(train.examples))
    ]
    assert collections.Counter(seen) == collections.Counter(expected)
    stats = data.stats["train"]
    assert len(seen) == stats["kept"] == config.data.synthetic_size - stats["too_long"]
    assert stats["too_long"] < 0.05 * config.data.synthetic_size


def test_restore_replays_exactly(synth):
    _, _, data = synth
    t = data.train
    fresh = batching.TrainBatches(t.examples, t.lengths, t.batch_sizes, seed=3)
    for _ in range(t.num_batches - 2):  # stop just before an epoch boundary
        next(fresh)
    state = fresh.state()
    expected = [next(fresh) for _ in range(5)]  # crosses into epoch 1
    assert fresh.state()["epoch"] == 1
    resumed = batching.TrainBatches(t.examples, t.lengths, t.batch_sizes, seed=3)
    resumed.restore(state)
    for a, b in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    # Epochs and seeds reorder the data.
    e0 = [r for _, r in fresh.epoch_plan(0)]
    e1 = [r for _, r in fresh.epoch_plan(1)]
    other = [
        r
        for _, r in batching.TrainBatches(t.examples, t.lengths, t.batch_sizes, seed=4).epoch_plan(
            0
        )
    ]
    assert any(not np.array_equal(a, b) for a, b in zip(e0, e1, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(e0, other, strict=True))
    with pytest.raises(ValueError, match="batches per epoch"):
        resumed.restore({"epoch": 0, "index": 0, "num_batches": t.num_batches + 1})


def test_hosts_split_the_same_global_batch(synth):
    _, _, data = synth
    t = data.train
    single = batching.TrainBatches(t.examples, t.lengths, t.batch_sizes, seed=0)
    hosts = [
        batching.TrainBatches(
            t.examples, t.lengths, t.batch_sizes, seed=0, process_index=p, process_count=2
        )
        for p in range(2)
    ]
    for _ in range(t.num_batches + 1):
        whole = next(single)
        parts = [next(h) for h in hosts]
        assert parts[0]["inputs"].shape[0] == whole["inputs"].shape[0] // 2
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_eval_batches_keep_everything_in_recoverable_order(synth):
    _, _, data = synth
    tok = data.tokenizer
    n = len(data.test_sources)
    assert n == synthetic.synthetic_split_sizes(400)[2] == len(data.test_references)
    decoded_src = batching.restore_order(
        data.test, [[tok.decode(r) for r in b["inputs"]] for b in data.test], n
    )
    decoded_tgt = batching.restore_order(
        data.test, [[tok.decode(r) for r in b["targets"]] for b in data.test], n
    )
    assert decoded_src == data.test_sources and decoded_tgt == data.test_references
    assert data.test_sources == [s for s, _ in synthetic.synthetic_pairs(n, 0, 2)]
    for b in data.valid + data.test:
        assert b["inputs"].shape[0] * b["inputs"].shape[1] <= 1024
        assert ((b["index"] >= 0) == (b["inputs"][:, 0] != 0)).all()


def test_too_small_token_budget_is_rejected():
    c = synthetic_config(max_len=64, max_tokens=100)
    with pytest.raises(ValueError, match="max_tokens=100 cannot hold 2 rows"):
        translation.load_datasets(
            data_section(c), "/nonexistent", batch_multiple=2, process_index=0, process_count=1
        )


# ----- skipping, counting, logging (text source) ----------------------------------------------
def test_empty_and_long_pairs_are_skipped_counted_and_logged(tmp_path, caplog):
    words = ["the", "small", "dog", "runs", "to", "the", "big", "house", "and", "back", "again"]
    src = [" ".join(words[: 3 + i % 6]) for i in range(120)]
    tgt = [" ".join(reversed(words[: 3 + i % 6])) for i in range(120)]
    src[5] = "   "  # empty source
    tgt[9] = ""  # empty target
    src[11] = " ".join(words * 6)  # far over max_len tokens
    write_pair(tmp_path, "train", src, tgt)
    write_pair(tmp_path, "valid", ["the dog", "", " ".join(words * 6)], ["dog the", "x", "long"])
    write_pair(tmp_path, "test", ["the house"], ["house the"], gz=True)
    config = text_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="sparsemixer_jax.data.translation"):
        data = translation.load_datasets(
            data_section(config), str(tmp_path / "work"), process_index=0, process_count=1
        )
    stats = data.stats["train"]
    assert (stats["pairs"], stats["empty"], stats["too_long"], stats["kept"]) == (120, 2, 1, 117)
    assert (
        "skipped 2 pairs with an empty side and 1 pairs with a side over max_len=64" in caplog.text
    )
    # Eval drops only the empty pair and keeps the over-long one in a longer bucket.
    assert data.valid_sources == ["the dog", " ".join(words * 6)]
    assert data.stats["valid"]["over_max_len_kept"] == 1
    assert max(b["inputs"].shape[1] for b in data.valid) > config.data.max_len
    assert data.test_references == ["house the"]


def test_empty_eval_split_is_an_error_naming_the_split(tmp_path):
    words = ["the", "small", "dog", "runs", "to", "big", "house"]
    src = [" ".join(words[: 2 + i % 5]) for i in range(60)]
    write_pair(tmp_path, "train", src, src)
    write_pair(tmp_path, "valid", ["", "  "], ["x", "y"])  # every pair has an empty side
    write_pair(tmp_path, "test", ["the house"], ["house the"])
    with pytest.raises(ValueError, match=r"valid split has no usable pairs \(2 read, 2 with an"):
        translation.load_datasets(
            data_section(text_config(tmp_path)), str(tmp_path / "work"), process_index=0,
            process_count=1
        )


def _bad_valid_split(directory, kind: str) -> str:
    """Writes a good train and test split and a ``kind`` of bad valid split; the error's text."""
    words = ["the", "small", "dog", "runs", "to", "big", "house"]
    src = [" ".join(words[: 2 + i % 5]) for i in range(60)]
    write_pair(directory, "train", src, src)
    write_pair(directory, "test", ["the house"], ["house the"])
    valid = os.path.join(directory, "valid")
    if kind == "not utf-8":
        write_pair(directory, "valid", ["the dog"], ["the dog"])
        with open(valid + ".de", "wb") as f:
            f.write("the dog\nGrüße\n".encode("latin-1"))
        return f"{valid}.de, line 2, byte 3: 0xfc is not UTF-8"
    if kind == "misaligned":
        write_pair(directory, "valid", ["the dog", "a house"], ["the dog"])
        return f"misaligned parallel files: {valid}.en has 2 lines but {valid}.de has 1 lines"
    if kind == "missing":
        write_pair(directory, "valid", ["the dog"], ["the dog"])
        os.remove(valid + ".de")
        return f"no text file for prefix 'valid', language 'de': tried {valid}.de and"
    if kind == "empty":
        write_pair(directory, "valid", ["", "  "], ["x", "y"])
        return "the valid split has no usable pairs (2 read, all with an empty side)"
    assert kind == "truncated gz"
    write_pair(directory, "valid", ["the dog"] * 50, ["the dog"] * 50, gz=True)
    with open(valid + ".en.gz", "rb") as f:
        data = f.read()
    with open(valid + ".en.gz", "wb") as f:
        f.write(data[: len(data) // 2])
    return f"{valid}.en.gz: truncated or corrupt gzip file"


@pytest.mark.parametrize("kind", ["not utf-8", "misaligned", "missing", "empty", "truncated gz"])
def test_a_bad_data_file_stops_the_run_before_anything_is_trained_or_written(tmp_path, kind):
    """A bad validation file was found only after the vocabulary was trained, leaving config.json,
    the lock and spm.model behind: every split is checked first, and the workdir is never made."""
    from sparsemixer_jax.tasks import translation as translation_task

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    message = _bad_valid_split(str(data_dir), kind)
    workdir = tmp_path / "run"
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        translation_task.train_and_evaluate(text_config(data_dir), str(workdir))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
    assert not workdir.exists()


def test_carriage_return_inside_a_line_does_not_split_it(tmp_path):
    # Windows line endings are stripped; a lone \r inside a line stays part of that line.
    for lang, text in (("en", "a\rb\r\nc\r\n"), ("de", "x\ny\n")):
        with open(tmp_path / f"train.{lang}", "w", encoding="utf-8", newline="") as f:
            f.write(text)
    assert sources.read_text(str(tmp_path), "train", "en", "de") == [("a\rb", "x"), ("c", "y")]


# ----- real data ------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason=f"Multi30k not found at {MULTI30K}")
def test_multi30k_relative_dir(tmp_path):
    config = text_config(
        "../shared/data/multi30k",
        train_prefix="train",
        valid_prefix="val",
        test_prefix="test_2016_flickr",
        vocab_size=200,
        vocab_sample_sentences=1000,
        max_len=128,
        max_tokens=2048,
    )
    data = translation.load_datasets(
        data_section(config), str(tmp_path), batch_multiple=8, process_index=0, process_count=1
    )
    stats = data.stats["train"]
    assert stats["pairs"] == 29000 and stats["kept"] + stats["too_long"] + stats["empty"] == 29000
    assert stats["kept"] > 28000  # captions are short
    with gzip.open(os.path.join(MULTI30K, "test_2016_flickr.de.gz"), "rt", encoding="utf-8") as f:
        assert data.test_references == [line.rstrip("\n") for line in f]
    assert len(data.test_sources) == 1000 and data.test_sources[0].startswith("A man")
    assert sum(batching.batch_counts(b)["examples"] for b in data.test) == 1000


# ----- TFDS (mocked, offline) -----------------------------------------------------------------
def test_tfds_reads_fields_by_name_not_supervised_keys(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    c = get_config()  # wmt14_translate/de-en, src=en, tgt=de
    c.data.vocab_size = 40
    c.data.max_len = 256
    # mock_data stands in for the download and its servers.
    with tfds.testing.mock_data(num_examples=30), mock.patch.object(
            sources, "download_servers_reachable", return_value=True):
        builder = tfds.builder(c.data.tfds_name)
        assert builder.info.supervised_keys == ("de", "en")  # the trap: de first
        raw = list(tfds.as_numpy(builder.as_dataset(split="validation", shuffle_files=False)))
        pairs = sources.read_tfds(c.data.tfds_name, "validation", "en", "de")
        data = translation.load_datasets(data_section(c), str(tmp_path), process_index=0,
                                         process_count=1)
    assert pairs == [(ex["en"].decode(), ex["de"].decode()) for ex in raw]
    assert data.stats["train"]["pairs"] == 30
    assert len(data.valid_sources) + data.stats["valid"]["empty"] == 30


def test_an_unprepared_tfds_dataset_without_its_servers_is_one_error_naming_the_fix(tmp_path):
    """Offline (the servers answer no connection), WMT'14 fails at once, before TFDS writes a
    partial download that a later run would trip over."""
    pytest.importorskip("tensorflow_datasets")
    data_dir = tmp_path / "tfds"
    with mock.patch.object(sources, "download_servers_reachable", return_value=False), \
            pytest.raises(FileNotFoundError) as error:
        sources.read_tfds("wmt14_translate/de-en", "train", "en", "de", str(data_dir))
    message = str(error.value)
    assert message.startswith(
        f"TFDS dataset 'wmt14_translate/de-en' is not prepared in {data_dir}/wmt14_translate/")
    assert "config.data.dir (or TFDS_DATA_DIR)" in message
    assert not (data_dir / "downloads").exists()


# ----- errors that name the field and the fix, before any long work ---------------------------
def test_vocab_too_small_says_larger_and_the_minimum(tmp_path):
    pairs = synthetic.synthetic_pairs(200, 0, 0)
    with pytest.raises(ValueError) as error:
        tokenization.get_tokenizer(data_section(synthetic_config(vocab=10)), str(tmp_path),
                                   pairs)
    minimum = int(str(error.value).rsplit(">= ", 1)[1])
    assert "vocab_size=10 is too small" in str(error.value) and "larger" in str(error.value)
    # The minimum is exact: one piece fewer fails, the minimum trains.
    sentences = [side for pair in pairs for side in pair]
    tokenization.train_tokenizer(sentences, str(tmp_path / "ok.model"), minimum, seed=0)
    with pytest.raises(ValueError, match="too small"):
        tokenization.train_tokenizer(sentences, str(tmp_path / "no.model"), minimum - 1, seed=0)


def test_empty_training_text_is_named_before_sentencepiece(tmp_path):
    write_pair(tmp_path, "train", ["", " "], ["x", ""])
    write_pair(tmp_path, "valid", ["the dog"], ["dog the"])
    write_pair(tmp_path, "test", ["the dog"], ["dog the"])
    with pytest.raises(ValueError, match=r"train split has no usable pairs \(2 read, all with an"):
        translation.load_datasets(data_section(text_config(tmp_path)), str(tmp_path / "work"),
                                  process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"training text for the vocabulary is empty"):
        tokenization.train_tokenizer([], str(tmp_path / "spm.model"), 30, seed=0)


def test_training_data_all_over_max_len_is_named(tmp_path):
    words = ["the", "small", "dog", "runs", "to", "the", "big", "house", "and", "back"]
    src = [" ".join(words[: 5 + i % 5]) for i in range(80)]
    write_pair(tmp_path, "train", src, src)
    write_pair(tmp_path, "valid", ["the dog"], ["dog the"])
    write_pair(tmp_path, "test", ["the dog"], ["dog the"])
    with pytest.raises(ValueError, match=r"0 with an empty side, 80 with a side over "
                                         r"config\.data\.max_len=4 tokens.*raise config\.data"):
        translation.load_datasets(
            data_section(text_config(tmp_path, max_len=4, max_tokens=64, vocab_size=20)),
            str(tmp_path / "work"), process_index=0, process_count=1)


# ----- the real WMT'14 builder, offline ---------------------------------------------------------
def _wmt14_archives(root) -> dict[str, str]:
    """The four archives `wmt14_translate/de-en` downloads, as tiny extracted directories laid out
    like the real ones (paths from TFDS's translate/wmt.py)."""
    layout = {
        "training-parallel-europarl-v7.tgz": ("training/europarl-v7.de-en", "parliament"),
        "training-parallel-commoncrawl.tgz": ("commoncrawl.de-en", "web"),
        "training-parallel-nc-v9.tgz": ("training/news-commentary-v9.de-en", "commentary"),
    }
    archives = {}
    for archive, (stem, word) in layout.items():
        base = os.path.join(root, archive)
        os.makedirs(os.path.dirname(os.path.join(base, stem)), exist_ok=True)
        for lang, text in (("de", f"Das {word} Haus\nEin {word} Hund\n"),
                           ("en", f"The {word} house\nA {word} dog\n")):
            with open(os.path.join(base, f"{stem}.{lang}"), "w", encoding="utf-8") as f:
                f.write(text)
        archives[archive] = base
    dev = os.path.join(root, "dev.tgz")
    os.makedirs(os.path.join(dev, "dev"))
    for lang, text in (("de", "Ein Haus\n"), ("en", "A house\n")):
        with open(os.path.join(dev, "dev", f"newstest2013.{lang}"), "w", encoding="utf-8") as f:
            f.write(text)
    for side, lang, text in (("src", "de", "Eine Katze"), ("ref", "en", "A cat")):
        name = os.path.join(dev, "dev", f"newstest2014-deen-{side}.{lang}.sgm")
        with open(name, "w", encoding="utf-8") as f:
            f.write(f'<srcset>\n<doc docid="1">\n<seg id="1">{text}</seg>\n</doc>\n</srcset>\n')
    archives["dev.tgz"] = dev
    return archives


def test_real_wmt14_builder_prepares_offline_from_local_files(tmp_path):
    """TFDS's own `wmt14_translate/de-en` builder (not mock_data) runs download_and_prepare with
    its download manager answering from local files: a dependency the builder imports
    (importlib_resources) or a changed TFDS API fails here, not after a user's first download."""
    tfds = pytest.importorskip("tensorflow_datasets")

    archives = _wmt14_archives(str(tmp_path / "downloads"))
    requested = []

    def download_and_extract(self, url_or_urls):
        def local(url):
            requested.append(url)
            return archives[url.rsplit("/", 1)[-1]]

        if isinstance(url_or_urls, str):
            return local(url_or_urls)
        if isinstance(url_or_urls, dict):
            return {k: download_and_extract(self, v) for k, v in url_or_urls.items()}
        return [local(u) for u in url_or_urls]

    data_dir = str(tmp_path / "tfds")
    with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                           download_and_extract), mock.patch.object(
            sources, "download_servers_reachable", return_value=True):
        train = sources.read_tfds("wmt14_translate/de-en", "train", "en", "de", data_dir)
    assert {url.rsplit("/", 1)[-1] for url in requested} == set(archives)
    assert sorted(train) == sorted(
        (f"{a} {w} {b}", f"{c} {w} {d}") for w in ("parliament", "web", "commentary")
        for a, b, c, d in (("The", "house", "Das", "Haus"), ("A", "dog", "Ein", "Hund")))
    # Prepared once: the test and validation splits now read without any download.
    assert sources.read_tfds("wmt14_translate/de-en", "test", "en", "de", data_dir) == [
        ("A cat", "Eine Katze")]
    assert sources.read_tfds("wmt14_translate/de-en", "validation", "de", "en", data_dir) == [
        ("Ein Haus", "A house")]
