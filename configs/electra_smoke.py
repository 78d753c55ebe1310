"""CPU smoke run of ELECTRA-style pretraining (about a minute on 2 cores).

Pretrains a tiny SparseMixer encoder on WikiText-2's validation text and validates on the first
sequences of its test text; the losses fall, nothing more is claimed.

The peak learning rate is the paper's 5e-4. At 2e-3 (this config's earlier value) the
discriminator collapses within about 40 updates to always answering "original", and the router
collapses with it (one expert takes 96% of the tokens; docs/pretraining.md, "Why the router
collapsed").
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

    c.optim.peak_lr = 5e-4  # the paper's; 2e-3 collapses discriminator and router at this size
    c.optim.warmup_steps = 20
    c.optim.decay_steps = 200
    c.optim.disc_weight = 50.0

    c.train_steps = 200
    c.eval_every = 100
    c.checkpoint_every = 100
    c.log_every = 20
    c.mesh.data = 1
    return c
