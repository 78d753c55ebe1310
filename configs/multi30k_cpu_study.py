"""Multi30k En-De, the CPU-sized router study (Switch vs SparseMixer, N = 4; docs/science.md).

Smaller than ``configs/multi30k_compare.py`` so that a few arms x seeds finish in about half an
hour on 2 shared CPU cores (docs/science.md): 2+2 layers, 64 wide, a 1k joint vocabulary, 2048
tokens per update, 400 updates, validation every 50, no test BLEU (the study compares
validation loss; the beam search would cost more than the training). The model is far too small
and too briefly trained to settle the paper's claim; it exercises the study driver and the
router diagnostics, and says what happens early in training.
"""

from configs import multi30k_compare


def get_config():
    c = multi30k_compare.get_config()
    c.data.vocab_size = 1000
    c.model.emb_dim = 64
    c.model.mlp_dim = 256
    c.model.num_heads = 4
    c.optim.peak_lr = 3e-3
    c.optim.warmup_steps = 100
    c.train_steps = 400
    c.eval_every = 50
    c.checkpoint_every = 200
    c.log_every = 25
    c.decode.test_bleu = False
    return c
