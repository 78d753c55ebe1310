"""GLUE fine-tuning, the paper's search space (its Appendix, Table "fine-tune").

    python -m experiments.glue --config configs/glue.py --pretrained runs/electra_n4 --task rte

Sequence length 256; Adam (0.9, 0.98), eps 1e-6; linear decay after a warm-up; gradient clipping
1.0; dropout 0.1 (the encoder keeps its pretraining dropout, the paper's 0.1; the head uses
``head_dropout``); grid over peak learning rate, max epochs, batch size, weight decay and warm-up
proportion: 3 x 4 x 2 x 2 x 2 = 96 points per task. Per task the best dev score over the grid
(and over the epochs of each point) is reported, as the paper does following MT-DNN.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.task = "finetuning"
    c.glue_dir = "../shared/data/glue"  # any directory in the GLUE download layout
    c.max_len = 256  # tokens per example, [CLS] and [SEP]s included; longer pairs are truncated
    c.length_step = 32  # batches are padded to a multiple of this (fewer shapes, fewer compiles)
    c.eval_batch_size = 64
    c.head_dropout = 0.1
    c.seed = 0
    c.train_limit = 0  # fine-tune on the first N training examples only (0 = all)
    c.dev_limit = 0  # evaluate on the first N dev examples only (0 = all)

    c.grid = ml_collections.ConfigDict()
    c.grid.learning_rate = (5e-5, 1e-4, 3e-4)
    c.grid.epochs = (2, 3, 5, 10)
    c.grid.batch_size = (16, 32)
    c.grid.weight_decay = (0.0, 0.01)
    c.grid.warmup = (0.06, 0.1)  # share of the steps spent warming up

    c.optim = ml_collections.ConfigDict()
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-6
    c.optim.clip_norm = 1.0  # 0 = no clipping
    return c
