"""A fine-tuning run of the chat fine-tuning study (docs/lm.md): the base of
``configs/lm_chat_base.py``, exported, fine-tuned on GLUE's SST-2, MRPC and RTE written as
conversations (``python -m lab.studies.chat_sft data`` writes the rows), routed by the router
section (``init_router = "config"``: the study's arms set the router).

    python -m experiments.lm --config configs/lm_chat_sft.py --workdir runs/chat_sft/one

The file's last 900 rows are the held-out rows (the GLUE dev samples): the held-out loss is on
their answers, and ``python -m lab.studies.chat_sft score`` scores each label's answer on them.
The routing against the base (churn, load) is logged at each evaluation.
"""

from configs import lm_quickstart


def get_config():
    c = lm_quickstart.get_config()
    c.init_from = "runs/chat_sft/base_hf"
    c.init_router = "config"
    c.data.format = "chat"
    c.data.train = "runs/chat_sft/data/glue_chat.jsonl"
    c.data.valid_articles = 900  # the held-out rows at the end of the file
    c.data.train_articles = 0
    c.data.wikitext = ""
    c.data.seq_len = 256
    c.data.batch_size = 8
    c.data.eval_batch_size = 32
    c.optim.peak_lr = 1e-3
    c.optim.warmup_steps = 20
    c.train_steps = 240
    c.optim.decay_steps = 240
    c.eval_every = 240  # once, at the end: the held-out loss and the routing against the base
    c.checkpoint_every = 240
    c.log_every = 20
    c.sample.tokens = 0
    return c
