"""GLUE fine-tuning smoke test for a CPU: one grid point, 256 training and 128 dev examples,
sequences of at most 64 tokens. Checks the pipeline, not the paper's numbers.

    python -m experiments.glue --config configs/glue_smoke.py --pretrained runs/electra_smoke \
        --task all
"""

from configs import glue


def get_config():
    c = glue.get_config()
    c.max_len = 64
    c.length_step = 64  # one padded length: one compilation per step function
    c.train_limit = 256
    c.dev_limit = 128
    c.grid.learning_rate = (1e-3,)
    c.grid.epochs = (2,)
    c.grid.batch_size = (16,)
    c.grid.weight_decay = (0.01,)
    c.grid.warmup = (0.1,)
    return c
