"""ELECTRA-style pretraining, Base setting, the paper's settings (its Appendix, "Pre-training").

    python -m experiments.pretrain --config configs/electra.py:n4 --workdir runs/electra_n4

The part after ``:`` picks the discriminator: ``dense`` or ``n2``, ``n4`` (default), ``n8``
experts per MoE layer; ``electra_dense.py``, ``electra_n2.py``, ``electra_n4.py``, ``electra_n8.py``
name the same settings as files.

Discriminator: BERT-base (12 layers, 768 wide, 12 heads, FFN 3072, GELU), learned absolute
positions "further enhanced" with T5 relative position buckets (32), dropout 0.1, MoE on every
other FFN (jitter 0.1, balance loss 0.01). Generator: 4 layers (the paper: "the size of the
auxiliary model (generator) to be 4 layers", following ELECTRA and METRO; it says nothing about
its width, and the tied embeddings fix it to the discriminator's).
Adam (0.9, 0.98), weight decay 0.01, peak lr 5e-4, 10k warm-up then linear decay, discriminator
loss weight 50, 125k updates of 2,048 sequences of 512 tokens.

Not reproduced: the paper's corpus (Wikipedia + BookCorpus, 16 GB) and its 128K cased BPE vocabulary
trained on it (here: the 10M-word Wikipedia sample in ../shared/data/wikipedia, 128K is too many
pieces for it, so 32K); the paper's FFN width "3076" is read as BERT-base's 3072.
Initialisation: Admin (Liu et al., 2020), which the paper uses to stabilise post-norm training
(``model.init = "admin"``: the paper's code's fairseq draws, then a profiling pass on the first
training batch sets each sublayer's residual scale; sparsemixer_jax/initializers.py).
Every other pretraining config starts from this one.
"""

import ml_collections

from sparsemixer_jax.training.config import (
    mesh_config,
    moe_model_fields,
    optim_config,
    router_config,
    runtime_config,
)

EXPERTS = {"dense": 0, "n2": 2, "n4": 4, "n8": 8}


def get_config(variant: str = "n4") -> ml_collections.ConfigDict:
    if variant not in EXPERTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(EXPERTS)}")
    c = ml_collections.ConfigDict()
    c.task = "pretraining"

    c.data = ml_collections.ConfigDict()
    c.data.train = "../shared/data/wikipedia"
    c.data.valid = "../shared/data/wikitext/wikitext-2-raw/wiki.valid.raw.gz"
    c.data.valid_sequences = 512  # packed validation sequences evaluated (0 = all)
    c.data.vocab_size = 32000
    c.data.vocab_sample_sentences = 2_000_000  # lines used to train the SentencePiece model
    c.data.spm_model_type = "bpe"  # the paper: a cased SentencePiece BPE vocabulary
    c.data.character_coverage = 0.9995
    c.data.seq_len = 512  # tokens per packed sequence, [CLS] and [SEP]s included
    c.data.pair_prob = 0.5  # share of sequences split into two segments [CLS] a [SEP] b [SEP]
    c.data.batch_size = 2048  # sequences per update (all hosts together)
    c.data.micro_batch_size = 0  # sequences per accumulation micro-step; 0 = batch_size
    c.data.mask_prob = 0.15  # share of tokens selected for MLM
    c.data.mask_token_prob = 0.85  # of those, the share shown as [MASK] (ELECTRA); others unchanged

    c.model = ml_collections.ConfigDict()  # the discriminator (the encoder GLUE fine-tunes)
    c.model.num_layers = 12
    c.model.emb_dim = 768
    c.model.mlp_dim = 3072
    c.model.num_heads = 12
    c.model.relative_buckets = 32
    c.model.relative_max_distance = 128
    moe_model_fields(c.model)
    # BERT / ELECTRA / COCO-LM use GELU in the FFN (the translation configs keep fairseq's ReLU).
    c.model.activation = "gelu"
    # BERT's 512 learned absolute positions, kept beside the relative bias: the paper "further
    # enhanced" BERT-base with T5's relative positions (following METRO), and COCO-LM's encoder
    # keeps its learned absolute positions too. 512 also covers GLUE's 256-token inputs when
    # pretraining used shorter sequences (ELECTRA-Small pretrains at 128 with a 512 table).
    c.model.absolute_positions = 512
    c.model.num_experts = EXPERTS[variant]
    c.model.moe_every = 2  # MoE on every other FFN (layers 0, 2, ...)
    c.model.compute_dtype = "bfloat16"
    c.model.init = "admin"  # the paper's: Admin's residual scales on the fairseq draws

    c.generator = ml_collections.ConfigDict()  # overrides of c.model for the generator
    c.generator.num_layers = 4
    c.generator.num_experts = 0  # the generator stays dense: MoE is studied in the discriminator

    c.router = router_config()

    c.optim = optim_config("linear", peak_lr=5e-4, warmup_steps=10_000, decay_steps=125_000,
                           eps=1e-6, weight_decay=0.01, weight_decay_mask="matrices",
                           clip_norm=1.0)  # ELECTRA clips at 1.0
    c.optim.disc_weight = 50.0  # loss = generator MLM loss + disc_weight * discriminator loss

    c.train_steps = 125_000
    c.eval_every = 5000
    c.checkpoint_every = 5000
    c.log_every = 100
    c.seed = 0

    c.runtime = runtime_config()
    c.mesh = mesh_config()
    return c
