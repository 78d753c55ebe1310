"""The base model of the chat fine-tuning study (docs/lm.md): the quickstart's architecture
(Mixtral-style, 8 experts, top-2 routed as Mixtral routes) trained from scratch on the Wikipedia
sample for longer, with a byte-level BPE vocabulary and a ChatML chat template.

    python -m experiments.lm --config configs/lm_chat_base.py --workdir runs/chat_sft/base
    python -m experiments.lm_export --workdir runs/chat_sft/base --out runs/chat_sft/base_hf

The export is the Hugging Face directory every fine-tuning run of the study starts from
(``configs/lm_chat_sft.py``): its ``tokenizer.json`` and ``tokenizer_config.json`` (special
tokens, the ChatML template) come from the run's workdir. Rows of 256 tokens, so that the
fine-tuning's conversations (up to 256 tokens) keep within the distances the base has seen.
"""

from configs import lm_quickstart
from sparsemixer_jax.training.config import router_config


def get_config():
    c = lm_quickstart.get_config()
    c.data.tokenizer = "bpe"
    c.data.vocab_size = 2048
    c.data.vocab_sample_sentences = 4000  # documents the vocabulary is trained on
    c.data.train_articles = 8000
    c.data.valid_articles = 300
    c.data.seq_len = 256
    c.data.batch_size = 8  # the quickstart's tokens per update, in rows twice as long
    c.data.eval_batch_size = 32
    # Top-2 as Mixtral routes: no jitter, the two gates renormalised.
    c.router = router_config("switch", top_k=2, jitter_eps=0.0, normalize_top_k=True)
    c.train_steps = 1500
    c.optim.decay_steps = 1500
    c.eval_every = 500
    c.checkpoint_every = 250
    c.log_every = 50
    c.sample.tokens = 30
    return c
