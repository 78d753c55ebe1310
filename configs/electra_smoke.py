"""CPU smoke run of ELECTRA-style pretraining (about a minute on 2 cores).

Pretrains a tiny SparseMixer encoder on WikiText-2's validation text and validates on the first
sequences of its test text; the losses fall, nothing more is claimed.
"""

from configs import electra


def get_config():
    c = electra.get_config()
    c.data.train = "../shared/data/wikitext/wikitext-2-raw/wiki.valid.raw.gz"
    c.data.valid = "../shared/data/wikitext/wikitext-2-raw/wiki.test.raw.gz"
    c.data.valid_sequences = 64
    c.data.vocab_size = 2000
    c.data.spm_model_type = "unigram"  # trains faster than BPE
    c.data.seq_len = 64
    c.data.batch_size = 16

    c.model.num_layers = 2
    c.model.emb_dim = 64
    c.model.mlp_dim = 128
    c.model.num_heads = 4
    c.model.num_experts = 4
    c.model.compute_dtype = "float32"
    c.generator.num_layers = 1

    c.optim.peak_lr = 2e-3
    c.optim.warmup_steps = 20
    c.optim.decay_steps = 200
    c.optim.disc_weight = 50.0

    c.train_steps = 200
    c.eval_every = 100
    c.checkpoint_every = 100
    c.log_every = 20
    c.mesh.data = 1
    return c
