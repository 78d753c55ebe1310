"""A generated language pair that a small Transformer learns in a few hundred steps.

Deterministic from the seed; the quickstart and the tests train on it, so neither needs downloads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparsemixer_jax.data import Pair

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
