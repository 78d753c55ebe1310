"""A tiny ELECTRA config and a generated plain-text corpus for the pretraining tests.

``get_config()`` points at ``tests/.../corpus`` files written by :func:`write_corpus`; tests
call ``kit.tiny_config("pretraining", corpus, **overrides)`` to get a config reading their own
copy. One sequence shape,
so each step function compiles once per process.
"""

import os

import numpy as np

from configs import electra_smoke

_TEXT = (
    "the a one two three red green blue small large old new river city house road garden "
    "king queen soldier farmer teacher student writer painter engine station harbour bridge "
    "walked built painted crossed found wrote opened carried followed watched near under over "
    "through beside before after quickly slowly often never always because while although"
)
_WORDS = _TEXT.split(" ")


def write_corpus(directory: str, lines: int = 300, seed: int = 0) -> str:
    """Writes ``train.txt`` and ``valid.txt`` of random sentences; returns ``directory``."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for name, count in (("train.txt", lines), ("valid.txt", lines // 5)):
        with open(os.path.join(directory, name), "w") as f:
            for _ in range(count):
                sentences = []
                for _ in range(rng.integers(1, 4)):
                    words = rng.choice(_WORDS, size=rng.integers(4, 12))
                    sentences.append(" ".join(words).capitalize() + ".")
                f.write(" ".join(sentences) + "\n")
    return directory


def get_config(corpus: str = "tests/corpus"):
    c = electra_smoke.get_config()
    c.data.train = os.path.join(corpus, "train.txt")
    c.data.valid = os.path.join(corpus, "valid.txt")
    c.data.valid_sequences = 8
    c.data.vocab_size = 120
    c.data.vocab_sample_sentences = 1000
    c.data.seq_len = 16
    c.data.batch_size = 8
    c.data.micro_batch_size = 4  # two micro-batches per update
    c.model.num_layers = 2
    c.model.emb_dim = 16
    c.model.mlp_dim = 32
    c.model.num_heads = 2
    c.model.num_experts = 2
    c.model.moe_every = 1
    c.model.relative_buckets = 8
    c.model.relative_max_distance = 16
    c.generator.num_layers = 1
    c.generator.num_experts = 0
    c.optim.peak_lr = 3e-3
    c.optim.warmup_steps = 2
    c.optim.decay_steps = 6
    c.train_steps = 6
    c.eval_every = 3
    c.checkpoint_every = 3
    c.log_every = 2
    return c
