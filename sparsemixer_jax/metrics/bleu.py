"""BLEU for WMT'14 En-De: detokenized SacreBLEU, and tokenized BLEU with compound splitting.

* :func:`sacre_bleu` -- corpus BLEU from sacrebleu on detokenized, cased text with its default
  ``13a`` tokenizer: the comparable, signature-backed number.
* :func:`tokenized_bleu` -- the number most WMT'14 En-De papers print (tensor2tensor's
  ``get_ende_bleu.sh``, fairseq's ``compound_split_bleu.sh``): tokenize with Moses'
  ``tokenizer.perl -l de`` (here its port ``sacremoses``, default options: no aggressive hyphen
  splitting, HTML-escaping on), split hyphenated compounds ``a-b`` into ``a ##AT##-##AT## b``,
  then BLEU on the tokens as ``multi-bleu.perl`` computes it.
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


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """``tokenizer.perl -l {lang}`` on each detokenized line (sacremoses, default options)."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line, return_str=True) for line in lines]


def compound_split(text: str) -> str:
    """Splits hyphenated compounds of tokenized text like the Perl rule (checked against perl).

    ``"state-of-the-art"`` -> ``"state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"``;
    matches do not overlap, so ``"a-b-c"`` -> ``"a ##AT##-##AT## b-c"``.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def tokenized_bleu(
    hypotheses: Sequence[str],
    references: Sequence[str],
    *,
    lang: str = "de",
    tokenize: bool = True,
) -> float:
    """Corpus BLEU (0-100) on Moses-tokenized, compound-split text (WMT'14 En-De convention).

    ``lang`` is the target language, for the tokenizer's rules. With ``tokenize=False`` the inputs
    are taken as already tokenized and only the compound split is applied. The BLEU itself is
    sacrebleu's with ``tokenize="none"``, which keeps the tokens as given (cased, like
    ``multi-bleu.perl`` without ``-lc``).
    """
    from sacrebleu.metrics import BLEU

    _check(hypotheses, references)
    if tokenize:
        hypotheses, references = moses_tokenize(hypotheses, lang), moses_tokenize(references, lang)
    hyps = [compound_split(h) for h in hypotheses]
    refs = [compound_split(r) for r in references]
    return float(BLEU(tokenize="none").corpus_score(hyps, [refs]).score)
