"""Supervised fine-tuning of a Hugging Face checkpoint on chat data (docs/lm.md): JSON lines
``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the checkpoint's chat
template, the loss on the assistant's tokens.

    python -m experiments.lm --config configs/lm_sft.py --config.init_from=path/to/hf_dir \
        --config.data.train=FILE.jsonl --config.train_steps=1000 --workdir runs/sft

The schedule follows ``train_steps``: the learning rate warms up over its first twelfth and
decays linearly to 0 at its last update, and the held-out rows are evaluated (and the
checkpoint written) at each quarter of it, so ``--config.train_steps=N`` alone sets a run's
length. A field set on the command line (``--config.optim.decay_steps=...``) keeps its value:
to extend a finished run, give its ``optim.decay_steps`` and ``optim.warmup_steps`` with the new
``train_steps`` (a resumed run refuses a changed schedule).

The held-out rows are the last ``data.valid_articles`` rows of ``data.train`` (put them at the
end of the file); there is no WikiText-2 evaluation. The peak learning rate is the chat
fine-tuning study's (docs/lm.md), 1e-3, a third of the peak its base was pre-trained at (3e-3);
a checkpoint pre-trained at a smaller peak wants a proportionally smaller one
(``--config.optim.peak_lr``). The model's shapes, tokenizer and routing are the checkpoint's.
"""

import ml_collections

from configs import lm_quickstart


def get_config() -> ml_collections.ConfigDict:
    c = lm_quickstart.get_config()
    c.init_from = ""  # the Hugging Face directory to fine-tune: the command names it
    c.data.format = "chat"
    c.data.train = ""  # the chat rows (JSON lines, plain or .gz): the command names them
    c.data.valid_articles = 200  # the held-out rows, the last of data.train
    c.data.train_articles = 0  # every other row trains
    c.data.wikitext = ""  # the held-out chat rows are the only validation
    c.data.seq_len = 2048  # a longer conversation is skipped (data.on_bad_row)
    c.data.eval_batch_size = 0  # the training batch's rows
    c.sample.prompt = "Hello! What can you help me with?"  # a user turn

    # Each field below is computed from train_steps when read; setting one on the command line
    # replaces its computation only (identity(): a derived reference, not train_steps itself).
    steps = ml_collections.FieldReference(240)  # the chat study's fine-tuning length
    c.train_steps = steps
    c.optim.peak_lr = 1e-3
    c.optim.warmup_steps = steps // 12  # the chat study's 20 of 240
    c.optim.decay_steps = steps.identity()
    c.eval_every = (steps + 3) // 4  # at each quarter (rounded up: at least every update)
    c.checkpoint_every = (steps + 3) // 4
    return c
