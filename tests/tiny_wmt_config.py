"""A tiny config for training-loop tests: one bucket shape, two micro-batches per update.

``tiny(**overrides)`` is the config with dotted-path overrides, e.g.
``tiny(**{"model.emb_dim": 32})``.
"""

from configs import quickstart


def get_config():
    c = quickstart.get_config()
    c.data.synthetic_size = 400
    c.data.vocab_size = 128
    c.data.max_len = 64
    c.data.bucket_step = 64  # a single padded length: one compilation per step function
    c.data.max_tokens = 512  # 8 rows of 64
    c.model.encoder_layers = 1
    c.model.decoder_layers = 1
    c.model.emb_dim = 16
    c.model.mlp_dim = 32
    c.model.num_heads = 2
    c.model.num_experts = 2
    c.model.moe_every = 1
    c.optim.tokens_per_update = 1024  # two micro-batches per update
    c.optim.warmup_steps = 10
    c.train_steps = 6
    c.eval_every = 3
    c.checkpoint_every = 3
    c.log_every = 2
    c.decode.beam_size = 2
    c.decode.max_extra_len = 4
    c.mesh.data = 1  # one device, although the tests' process simulates eight
    return c


def tiny(**overrides):
    """:func:`get_config` with ``overrides`` (keys are dotted paths, e.g. ``"model.emb_dim"``)."""
    config = get_config()
    config.update_from_flattened_dict(overrides)
    return config
