"""Multi30k En-De (``../shared/data/multi30k``), a Switch Transformer sized for one accelerator.

    python -m experiments.wmt --config configs/multi30k.py --workdir runs/m30k

29k training pairs: a 3+3-layer, 256-wide model with 4 experts, 8k joint vocabulary, and a
shorter schedule than WMT. On a CPU, shrink it from the command line (docs/translation.md).

``configs/multi30k.py:study`` is the same model, data and optimizer for the Switch vs
SparseMixer study on one GPU (``experiments.compare`` sets the router, N, the seed and each arm's
modifiers; docs/science.md has the commands): denser validation (every 250 updates) so that
"updates to Switch's final loss" is resolved, and fewer checkpoints (a study keeps none once a
run is done). 8,000 updates: 2,500 were not enough for Switch's validation loss to flatten.
"""

from configs import wmt


def get_config(variant: str = "n4"):
    if variant not in ("n4", "study"):
        raise ValueError(f"unknown variant {variant!r}; choose one of n4, study")
    c = wmt.get_config()
    c.data.source = "text"
    c.data.dir = "../shared/data/multi30k"
    c.data.train_prefix = "train"
    c.data.valid_prefix = "val"
    c.data.test_prefix = "test_2016_flickr"
    c.data.vocab_size = 8000
    c.data.max_len = 128
    c.data.max_tokens = 8192

    c.model.encoder_layers = 3
    c.model.decoder_layers = 3
    c.model.emb_dim = 256
    c.model.mlp_dim = 1024
    c.model.num_heads = 4
    c.model.dropout = 0.3
    c.model.num_experts = 4

    c.optim.peak_lr = 1e-3
    c.optim.warmup_steps = 1000
    c.optim.tokens_per_update = 0

    c.train_steps = 8000
    c.eval_every = 500
    c.checkpoint_every = 500
    c.log_every = 50
    if variant == "study":
        c.eval_every = 250
        c.checkpoint_every = 1000
    return c
