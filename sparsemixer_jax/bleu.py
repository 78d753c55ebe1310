"""BLEU for WMT'14 En-De: detokenized SacreBLEU, and tokenized BLEU with compound splitting.

* :func:`sacre_bleu` -- corpus BLEU from sacrebleu on detokenized, cased text with its default
  ``13a`` tokenizer: the comparable, signature-backed number.
* :func:`tokenized_bleu` -- the number most WMT'14 En-De papers print (tensor2tensor's
  ``get_ende_bleu.sh``, fairseq's ``compound_split_bleu.sh``): tokenize, split hyphenated compounds
  ``a-b`` into ``a ##AT##-##AT## b``, then BLEU on the tokens. Those scripts tokenize with Moses'
  ``tokenizer.perl``; ``sacremoses`` is not a dependency here, so this uses sacrebleu's ``13a``
  tokenizer, which (like Moses without ``-a``) keeps a hyphen inside a word and separates
  punctuation. Scores can differ from Moses-tokenized ones by a few tenths; say which you report.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# The fairseq / tensor2tensor rule, `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'`. Matches do not
# overlap, so in "a-b-c" only the first hyphen is split -- a quirk kept on purpose, since the
# published numbers were computed with it.
_COMPOUND = re.compile(r"(\S)-(\S)")


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("hypotheses and references must be lists of strings, not a single string")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: they must align"
        )


def sacre_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus SacreBLEU (0-100) of detokenized, cased ``hypotheses`` against one reference each."""
    import sacrebleu

    _check(hypotheses, references)
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def tokenize_13a(text: str) -> str:
    """sacrebleu's ``13a`` (mteval-v13a) tokenization of one detokenized line."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()(text)


def compound_split(text: str) -> str:
    """Splits hyphenated compounds of tokenized text like the Perl rule (checked against perl).

    ``"state-of-the-art"`` -> ``"state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"``;
    matches do not overlap, so ``"a-b-c"`` -> ``"a ##AT##-##AT## b-c"``.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def tokenized_bleu(
    hypotheses: Sequence[str], references: Sequence[str], *, tokenize: bool = True
) -> float:
    """Corpus BLEU (0-100) on ``13a``-tokenized, compound-split text (WMT'14 En-De convention).

    With ``tokenize=False`` the inputs are taken as already tokenized (e.g. by Moses) and only the
    compound split is applied. The final BLEU uses ``tokenize="none"`` so the tokens are kept as is.
    """
    from sacrebleu.metrics import BLEU

    _check(hypotheses, references)
    prep = (lambda s: compound_split(tokenize_13a(s))) if tokenize else compound_split
    hyps = [prep(h) for h in hypotheses]
    refs = [prep(r) for r in references]
    return float(BLEU(tokenize="none").corpus_score(hyps, [refs]).score)
