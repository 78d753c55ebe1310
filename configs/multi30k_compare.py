"""Multi30k En-De, a small model for the Switch / SparseMixer / dense convergence study on CPU.

``experiments/compare.py`` runs this config for each arm (``router.name``, ``num_experts``) and
seed. Sized so that 9 runs (3 arms x 3 seeds, N=4) finish in about an hour on 2 shared CPU
cores: 2+2 layers, 128 wide, 2k joint vocabulary, 2048 tokens per update, 500 updates, and a
short beam search (beam 4, at most 10 tokens past the source length) on the 1000-sentence test
set.
"""

from configs import multi30k


def get_config():
    c = multi30k.get_config()
    c.data.vocab_size = 2000
    c.data.max_len = 64  # Multi30k pairs are short; fewer buckets, fewer compilations
    c.data.max_tokens = 2048  # more updates per second of CPU: the study counts updates

    c.model.encoder_layers = 2
    c.model.decoder_layers = 2
    c.model.emb_dim = 128
    c.model.mlp_dim = 512
    c.model.num_heads = 4
    c.model.dropout = 0.1
    c.model.num_experts = 4

    c.optim.peak_lr = 2e-3
    c.optim.warmup_steps = 150
    c.optim.tokens_per_update = 0

    c.train_steps = 500
    c.eval_every = 50
    c.checkpoint_every = 250
    c.log_every = 25

    c.decode.beam_size = 4
    c.decode.max_extra_len = 10
    return c
