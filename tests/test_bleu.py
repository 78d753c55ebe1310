"""BLEU wrappers: known values, hand-computed n-gram precisions, the compound-split rule."""

import math

import pytest

from sparsemixer_jax.metrics.bleu import compound_split, moses_tokenize, sacre_bleu, tokenized_bleu


def _bleu_by_hand(matches: list[int], totals: list[int], hyp_len: int, ref_len: int) -> float:
    """BLEU from hand-counted n-gram matches (no smoothing needed: every count is > 0)."""
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * bp * math.exp(log_p)


def test_identical_text_scores_100():
    text = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee, nicht wahr?"]
    assert sacre_bleu(text, text) == pytest.approx(100.0)
    assert tokenized_bleu(text, text) == pytest.approx(100.0)


def test_sacre_bleu_hand_computed():
    # hyp "the cat sat on the mat" vs ref "the cat sat on a mat": 1-grams 5/6 (only "the"#2 misses),
    # 2-grams 3/5 (the cat, cat sat, sat on), 3-grams 2/4, 4-grams 1/3; equal lengths, BP = 1.
    expected = _bleu_by_hand([5, 3, 2, 1], [6, 5, 4, 3], 6, 6)
    score = sacre_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert score == pytest.approx(expected)


def test_sacre_bleu_brevity_penalty():
    # Every n-gram of the 5-token hypothesis matches; only the brevity penalty exp(1 - 6/5) remains.
    score = sacre_bleu(["the cat sat on the"], ["the cat sat on the mat"])
    assert score == pytest.approx(100 * math.exp(1 - 6 / 5))


def test_sacre_bleu_is_cased_and_uses_13a():
    # 13a separates the final period and comma, so a detokenized hypothesis scores 100 ...
    assert sacre_bleu(["Hello, world."], ["Hello , world ."]) == pytest.approx(100.0)
    # ... and case matters.
    assert sacre_bleu(["hello, world."], ["Hello, world."]) < 100.0


def test_compound_split_concrete_strings():
    assert compound_split("ein gut-bekannter Mann") == "ein gut ##AT##-##AT## bekannter Mann"
    assert compound_split("state-of-the-art") == (
        "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"
    )
    # The Perl rule's matches do not overlap: a one-letter middle part keeps its second hyphen.
    assert compound_split("a-b-c") == "a ##AT##-##AT## b-c"
    # A free-standing dash (no non-space on one side) is not a compound.
    assert compound_split("x - y -z") == "x - y -z"


def test_moses_tokenize_like_tokenizer_perl():
    # tokenizer.perl -l de: punctuation split off, word-internal hyphens kept (no -a), the
    # apostrophe split on both sides outside en/fr/it, and &, ", ' HTML-escaped.
    lines = ["A well-known man, (really).", 'Er sagte: "Peter\'s Haus-Boot & mehr"?']
    assert moses_tokenize(lines, "de") == [
        "A well-known man , ( really ) .",
        "Er sagte : &quot; Peter &apos; s Haus-Boot &amp; mehr &quot; ?",
    ]


def test_tokenized_bleu_hand_computed():
    # After splitting: hyp "x y a @ b z w", ref "x y a @ c z w" (@ = ##AT##-##AT##), 7 tokens each.
    # 1-grams 6/7; 2-grams 4/6 (x y, y a, a @, z w); 3-grams 2/5 (x y a, y a @); 4-grams 1/4.
    expected = _bleu_by_hand([6, 4, 2, 1], [7, 6, 5, 4], 7, 7)
    assert tokenized_bleu(["x y a-b z w"], ["x y a-c z w"]) == pytest.approx(expected)


def test_tokenized_bleu_pretokenized_input():
    # tokenize=False only splits compounds: "world." stays one token and fails to match "world".
    ref = ["hello to the big world ."]
    assert tokenized_bleu(["hello to the big world ."], ref, tokenize=False) == pytest.approx(100)
    assert tokenized_bleu(["hello to the big world."], ref, tokenize=False) < 100
    assert tokenized_bleu(["hello to the big world."], ref) == pytest.approx(100)


def test_length_mismatch_and_single_string_rejected():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        sacre_bleu(["a", "b"], ["a"])
    with pytest.raises(TypeError, match="lists of strings"):
        tokenized_bleu("a b", "a b")
