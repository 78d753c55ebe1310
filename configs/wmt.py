"""WMT'14 En-De, Transformer-base Switch, the paper's settings (its Appendix, Table 5).

    python -m experiments.wmt --config configs/wmt_n4.py --workdir runs/wmt_n4

The part after ``:`` picks the model: ``dense`` (no experts) or ``n2``, ``n4`` (default), ``n6``,
``n8``, ``n16`` experts per MoE layer; ``wmt_dense.py``, ``wmt_n2.py`` ... ``wmt_n16.py`` name
the same settings as files (``configs/wmt_n4.py`` is ``configs/wmt.py:n4``). Every translation
config starts from this one; docs/config.md documents each field.
"""

import ml_collections

from sparsemixer_jax.training.config import (
    mesh_config,
    moe_model_fields,
    optim_config,
    router_config,
    runtime_config,
)

EXPERTS = {"dense": 0, "n2": 2, "n4": 4, "n6": 6, "n8": 8, "n16": 16}


def get_config(variant: str = "n4") -> ml_collections.ConfigDict:
    if variant not in EXPERTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(EXPERTS)}")
    c = ml_collections.ConfigDict()
    c.task = "translation"

    c.data = ml_collections.ConfigDict()
    c.data.source = "tfds"  # "tfds" | "text" | "synthetic"
    c.data.dir = ""  # tfds: data_dir ("" = TFDS default); text: the directory of the files
    c.data.tfds_name = "wmt14_translate/de-en"
    c.data.src = "en"
    c.data.tgt = "de"
    c.data.train_prefix = "train"  # text: {dir}/{prefix}.{lang}[.gz]; tfds: split name
    c.data.valid_prefix = "validation"
    c.data.test_prefix = "test"
    c.data.vocab_size = 32000  # joint SentencePiece vocabulary, trained on the training text
    c.data.vocab_sample_sentences = 2_000_000  # sentence pairs used to train the vocabulary
    c.data.max_len = 256  # tokens per side; longer pairs are skipped and counted
    c.data.max_tokens = 4096  # tokens (source or target, padded) per batch per update micro-step
    c.data.bucket_step = 8  # padded lengths are multiples of this (fewer buckets = fewer compiles)
    c.data.synthetic_size = 20000  # sentence pairs for data.source = "synthetic"

    c.model = ml_collections.ConfigDict()
    c.model.encoder_layers = 6
    c.model.decoder_layers = 6
    c.model.emb_dim = 512
    c.model.mlp_dim = 2048
    c.model.num_heads = 8
    moe_model_fields(c.model)
    c.model.num_experts = EXPERTS[variant]
    c.model.moe_every = 2  # Switch's layout: MoE replaces every other FFN (layers 0, 2, 4)

    c.router = router_config()

    # Adam (0.9, 0.98), inverse-sqrt schedule from 1e-7 to 7e-4 over 8000 updates (fairseq).
    c.optim = optim_config("inverse_sqrt", peak_lr=7e-4, init_lr=1e-7, warmup_steps=8000)
    c.optim.label_smoothing = 0.1
    c.optim.tokens_per_update = 2**17  # target tokens per update, reached by accumulation

    c.train_steps = 400_000
    c.eval_every = 2000
    c.checkpoint_every = 2000
    c.log_every = 100
    c.seed = 0

    c.decode = ml_collections.ConfigDict()
    c.decode.beam_size = 4
    c.decode.length_penalty = 0.6
    c.decode.max_extra_len = 50  # generate at most source length + this many tokens
    c.decode.test_bleu = True  # beam search + BLEU on the test split at the end of training

    c.runtime = runtime_config()
    c.mesh = mesh_config()
    return c
