"""ELECTRA-style pretraining at a size that fits one accelerator (one GPU, a few hours).

ELECTRA-Small's discriminator shape (Clark et al., 2020: 12 layers, 256 wide, 4 heads, FFN 1024,
sequences of 128, batch 128) with the paper's recipe otherwise: a 4-layer generator, MoE on every
other FFN (N = 4), loss weight 50, Adam (0.9, 0.98), weight decay 0.01, linear warm-up and decay.
Pretrains on the Wikipedia sample (105,279 packed sequences of 128: 40k updates are about 49
passes) and validates on WikiText-2's validation text. Change the budget
with ``--config.train_steps=N --config.optim.decay_steps=N``; the Switch baseline with
``--config.router.name=switch``, the dense one with ``--config.model.num_experts=0``.
"""

from configs import electra


def get_config():
    c = electra.get_config()
    c.data.vocab_size = 16000
    c.data.seq_len = 128
    c.data.batch_size = 128

    c.model.num_layers = 12
    c.model.emb_dim = 256
    c.model.mlp_dim = 1024
    c.model.num_heads = 4
    c.model.num_experts = 4

    c.optim.peak_lr = 5e-4
    c.optim.warmup_steps = 2000
    c.optim.decay_steps = 40_000

    c.train_steps = 40_000
    c.eval_every = 2000
    c.checkpoint_every = 2000
    c.log_every = 100
    return c
