"""Pretraining text: readers, vocabulary ids, packing, MLM masking, the resumable batch stream."""

import gzip

import numpy as np
import pytest

from sparsemixer_jax.data import text
from tests import tiny_electra_config

WIKIEXTRACTOR = """<doc id="1" url="?curid=1" title="Stub">
Stub

</doc>
<doc id="2" url="?curid=2" title="Jarred Shaw">
Jarred Shaw

Jarred Shaw is a basketball player.
Professional career.
He signed for a club.

</doc>
"""

# As in the real files: every line starts and ends with a space, blank lines are a space.
WIKITEXT = "\n".join(f" {line} " if line else " " for line in [
    "",
    "= Homarus gammarus =",
    "",
    "Homarus gammarus is a lobster , 60 @-@ 70 cm long and 2 @.@ 5 kg .",
    "",
    "= = Description = =",
    "",
    "It has 1 @,@ 000 eggs .",
    "= Second article =",
    "Another paragraph .",
]) + "\n"


def test_readers_detect_and_parse_each_format(tmp_path):
    (tmp_path / "a_wiki.gz").write_bytes(gzip.compress(WIKIEXTRACTOR.encode()))
    (tmp_path / "b_wikitext.txt").write_text(WIKITEXT)
    (tmp_path / "c_plain.txt").write_text("First line.\n\n  Second line.  \n")
    (tmp_path / "README.md").write_text("not text to train on")
    docs = text.read_documents(str(tmp_path))
    assert docs == [
        ["Jarred Shaw is a basketball player.", "Professional career.", "He signed for a club."],
        ["Homarus gammarus is a lobster , 60-70 cm long and 2.5 kg .", "It has 1,000 eggs ."],
        ["Another paragraph ."],
        ["First line.", "Second line."],
    ]


def test_reader_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        text.read_documents(str(tmp_path / "nowhere"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no text"):
        text.read_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"bad\.gz"):
        text.read_documents(str(tmp_path / "bad.gz"))


def test_pack_sequences_hand_example():
    paragraphs = [[10, 11, 12], [13, 14], [15, 16, 17, 18, 19, 20, 21]]
    # seq_len 8: 5 tokens of text per sequence ([CLS], [SEP], [SEP] take the rest).
    tokens, segments = text.pack_sequences(paragraphs, 8, pair_prob=0.0,
                                           rng=np.random.default_rng(0))
    np.testing.assert_array_equal(tokens, [[3, 10, 11, 12, 13, 14, 4, 0],
                                           [3, 15, 16, 17, 18, 19, 4, 0],
                                           [3, 20, 21, 4, 0, 0, 0, 0]])
    np.testing.assert_array_equal(segments, np.zeros((3, 8)))
    # pair_prob 1: a sequence with pieces of two paragraphs is split at their boundary.
    tokens, segments = text.pack_sequences(paragraphs, 8, pair_prob=1.0,
                                           rng=np.random.default_rng(0))
    np.testing.assert_array_equal(tokens[0], [3, 10, 11, 12, 4, 13, 14, 4])
    np.testing.assert_array_equal(segments[0], [0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(tokens[1], [3, 15, 16, 17, 18, 19, 4, 0])  # one piece: no split


def test_packing_keeps_every_token_in_order():
    rng = np.random.default_rng(1)
    paragraphs = [list(rng.integers(6, 100, size=rng.integers(0, 40))) for _ in range(50)]
    tokens, segments = text.pack_sequences(paragraphs, 32, pair_prob=0.5, rng=rng)
    words = tokens[tokens >= text.FIRST_WORD_ID]
    np.testing.assert_array_equal(words, np.concatenate(paragraphs))
    # Every sequence but the last is full, but for the second [SEP] a single segment leaves out.
    assert (tokens[:-1, :-1] != 0).all()
    assert (tokens[:-1, -1] == 0).sum() == (segments[:-1].max(axis=1) == 0).sum()
    assert (tokens[:, 0] == text.CLS_ID).all()
    pairs = segments.max(axis=1) == 1
    assert 0 < pairs.sum() < len(tokens)
    for row, seg in zip(tokens[pairs], segments[pairs], strict=True):
        first_b = np.argmax(seg)
        assert row[first_b - 1] == text.SEP_ID  # a [SEP] ends segment 0 ...
        assert row[seg == 1][-1] == text.SEP_ID  # ... and segment 1
        assert (seg[first_b:][row[first_b:] != 0] == 1).all()


def test_mask_tokens_selects_15_percent_of_words_only():
    rng = np.random.default_rng(2)
    tokens = rng.integers(6, 50, size=(400, 40)).astype(np.int32)
    tokens[:, 0], tokens[:, 20], tokens[:, 30:] = text.CLS_ID, text.SEP_ID, 0
    inputs, selected = text.mask_tokens(tokens, rng, mask_prob=0.15, mask_token_prob=0.85)
    words = tokens >= text.FIRST_WORD_ID
    assert not (selected & ~words).any()
    np.testing.assert_array_equal(selected.sum(axis=1), round(0.15 * 28))  # 28 words per row
    np.testing.assert_array_equal(inputs[~selected], tokens[~selected])
    shown = inputs[selected] == text.MASK_ID
    kept = inputs[selected] == tokens[selected]
    assert (shown | kept).all()
    # Share shown as [MASK]: 0.85 expected, standard error sqrt(.85 * .15 / 1600) = 0.009.
    assert abs(shown.mean() - 0.85) < 4 * np.sqrt(0.85 * 0.15 / shown.size)


def test_rows_with_few_words_still_get_one_prediction():
    tokens = np.array([[3, 7, 4, 0], [3, 4, 0, 0]], np.int32)
    _, selected = text.mask_tokens(tokens, np.random.default_rng(0), mask_prob=0.15,
                                   mask_token_prob=1.0)
    np.testing.assert_array_equal(selected, [[0, 1, 0, 0], [0, 0, 0, 0]])


def _stream(process_index=0, process_count=1, n=20):
    tokens = np.arange(n * 8, dtype=np.int32).reshape(n, 8) + 6
    return text.PretrainBatches(tokens, np.zeros_like(tokens), 4, seed=3, mask_prob=0.3,
                                mask_token_prob=0.8, process_index=process_index,
                                process_count=process_count)


def test_batch_stream_epochs_resume_and_processes():
    stream = _stream()
    first_epoch = [next(stream) for _ in range(5)]
    seen = np.concatenate([b["tokens"][:, 0] for b in first_epoch])
    assert sorted(seen) == list(range(6, 6 + 20 * 8, 8))  # every sequence once per epoch
    state = stream.state()
    ahead = [next(stream) for _ in range(3)]
    assert stream.epoch == 1
    resumed = _stream()
    resumed.restore(state)
    for a, b in zip(ahead, [next(resumed) for _ in range(3)], strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # Two processes hold the two halves of the same global batch.
    halves = [next(_stream(i, 2)) for i in range(2)]
    whole = next(_stream())
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])


def test_too_little_text_for_a_batch_is_an_error():
    tokens = np.full((3, 8), 7, np.int32)
    with pytest.raises(ValueError, match="fewer than one batch"):
        text.PretrainBatches(tokens, tokens, 4, seed=0, mask_prob=0.15, mask_token_prob=0.85)


def test_vocabulary_has_the_special_pieces(tmp_path):
    corpus = tiny_electra_config.write_corpus(str(tmp_path / "corpus"))
    config = tiny_electra_config.get_config(corpus)
    paragraphs = [p for doc in text.read_documents(config.data.train) for p in doc]
    data = text.TextDataConfig.from_config(config)
    tokenizer = text.get_text_tokenizer(data, str(tmp_path / "work"), paragraphs)
    assert tokenizer.vocab_size == config.data.vocab_size
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(6)]
    assert pieces == ["<pad>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
    assert text.MASK_ID in tokenizer.encode("the king [MASK] walked")
    config.data.vocab_size = 100
    with pytest.raises(ValueError, match="delete the file to retrain"):
        text.get_text_tokenizer(text.TextDataConfig.from_config(config), str(tmp_path / "work"),
                                paragraphs)
