"""A tiny language-modelling config and a generated corpus for the LM task's tests.

:func:`write_corpus` writes a WikiExtractor-format training file (its last documents are the
validation text) and a WikiText-format file (the second held-out set); ``get_config(corpus)`` is
``configs/lm_quickstart.py`` shrunk to a 2-layer model reading them. One row shape, so each step
function compiles once per process and the module's runs share the compilations.
"""

import os

import numpy as np

from configs import lm_quickstart
from tests.tiny_electra_config import _WORDS


def _paragraph(rng) -> str:
    sentences = []
    for _ in range(rng.integers(1, 3)):
        words = rng.choice(_WORDS, size=rng.integers(4, 10))
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def write_corpus(directory: str, documents: int = 60, seed: int = 0) -> str:
    """Writes ``wiki.txt`` (WikiExtractor: ``documents`` articles) and ``wikitext/wiki.test.raw``
    (WikiText: two articles); returns ``directory``."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(directory, "wikitext"), exist_ok=True)
    with open(os.path.join(directory, "wiki.txt"), "w") as f:
        for i in range(documents):
            f.write(f'<doc id="{i}" url="?curid={i}" title="Article {i}">\nArticle {i}\n\n')
            for _ in range(rng.integers(1, 4)):
                f.write(_paragraph(rng) + "\n")
            f.write("</doc>\n")
    with open(os.path.join(directory, "wikitext", "wiki.test.raw"), "w") as f:
        for title in ("River", "Harbour"):
            f.write(f" = {title} = \n\n")
            for _ in range(3):
                f.write(f" {_paragraph(rng)} \n\n")
    return directory


def get_config(corpus: str = "tests/corpus"):
    c = lm_quickstart.get_config()
    c.data.train = os.path.join(corpus, "wiki.txt")
    c.data.valid_articles = 6
    c.data.train_articles = 0
    c.data.wikitext = os.path.join(corpus, "wikitext")
    c.data.vocab_size = 120
    c.data.vocab_sample_sentences = 1000
    c.data.seq_len = 16
    c.data.batch_size = 8
    c.data.micro_batch_size = 0  # one micro-batch per update: the fused step
    c.data.eval_batch_size = 4
    c.model.hidden_size = 16
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.model.mlp_dim = 16
    c.model.num_experts = 4
    c.optim.warmup_steps = 2
    c.optim.decay_steps = 6
    c.sample.prompt = "The river"
    c.sample.tokens = 1  # one token: generate compiles its prefill alone
    c.train_steps = 6
    c.eval_every = 3
    c.checkpoint_every = 3
    c.log_every = 2
    return c
