"""Quickstart language model: a small decoder-only MoE (Mixtral-style, 8 experts, top-2,
SparseMixer-v2* routing) trained from scratch on the Wikipedia sample on a CPU in a few minutes.

    python -m experiments.lm --config configs/lm_quickstart.py --workdir runs/lm_quickstart

The last 1,000 articles of the sample are the validation text, WikiText-2's test file a second
held-out set; ``results.json`` holds the validation perplexity, the unigram baseline's
(``unigram_ppl``: the training tokens' unigram model on the same text), bits per byte and a
generated sample (also in ``sample.txt``). On 2 busy CPU cores: validation perplexity 136.9
against 337.8 for the unigram model, in about 6 minutes (docs/lm.md). Fine-tune a converted
checkpoint instead with ``--config.init_from=<Hugging Face dir>`` (its shapes and tokenizer).
"""

import ml_collections

from sparsemixer_jax.training.config import (
    mesh_config,
    moe_model_fields,
    optim_config,
    router_config,
    runtime_config,
)


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.task = "lm"
    c.seed = 0
    c.init_from = ""  # a Hugging Face model directory to fine-tune ("" = from scratch)
    c.init_router = "checkpoint"  # fine-tuning routes as the checkpoint does | "config": c.router
    # A warning names an MoE layer whose busiest expert takes at least collapse_share of the
    # validation tokens at collapse_evals evaluations in a row (router collapse).
    c.collapse_share = 0.9
    c.collapse_evals = 3

    c.data = ml_collections.ConfigDict()
    c.data.train = "../shared/data/wikipedia/enwiki_sample.txt.gz"
    # What data.train holds: "text" (documents) | "chat" (JSON lines {"messages": [{"role",
    # "content"}, ...]}: the checkpoint's chat template, the loss on the assistant's tokens) |
    # "prompt_completion" (JSON lines {"prompt", "completion"}: the loss on the completion).
    # The last two fine-tune a checkpoint (init_from): docs/lm.md.
    c.data.format = "text"
    c.data.on_bad_row = "skip"  # a row that cannot be trained on: "skip" (counted) | "error"
    c.data.valid_articles = 1000  # the last documents (rows) of data.train, held out
    c.data.train_articles = 3000  # the first training documents (rows) kept (0 = all)
    # A second held-out set: a file, or a directory whose every file is evaluated on its own (the
    # directory ../shared/data/wikitext/wikitext-2-raw adds WikiText-2's validation file).
    c.data.wikitext = "../shared/data/wikitext/wikitext-2-raw/wiki.test.raw.gz"
    # From scratch: "spm" (SentencePiece) | "bpe" (byte-level BPE with a ChatML template, written
    # as tokenizer.json / tokenizer_config.json); a checkpoint brings its own tokenizer.
    c.data.tokenizer = "spm"
    c.data.vocab_size = 1024
    c.data.vocab_sample_sentences = 20_000
    c.data.spm_model_type = "unigram"
    c.data.character_coverage = 0.9995
    c.data.seq_len = 128
    c.data.batch_size = 16
    c.data.micro_batch_size = 0  # 0 = batch_size: no accumulation
    c.data.eval_batch_size = 64

    c.model = moe_model_fields(ml_collections.ConfigDict())
    c.model.hf_type = "mixtral"  # the architecture family (a Hugging Face model_type)
    c.model.hidden_size = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 0  # 0 = hidden_size / num_heads
    c.model.mlp_dim = 128  # each expert's width
    c.model.num_experts = 8
    c.model.moe_every = 1
    c.model.shared_expert_dim = 0
    c.model.tie_embeddings = False
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.initializer_range = 0.02
    c.model.max_position_embeddings = 4096
    # The language model has no dropout, SwiGLU experts and its type's normal initialisation.
    c.model.dropout = 0.0
    c.model.attention_dropout = 0.0
    c.model.activation_dropout = 0.0
    c.model.activation = "silu"
    c.model.init = "normal"
    # What the scanned layers' backward pass recomputes: "none" | "full" | a jax.checkpoint_policies
    # name ("dots_saveable", "nothing_saveable", ...): memory for compute, same numbers.
    c.model.remat = "none"
    # How cuDNN's attention (attention_impl="cudnn") takes packed documents: "bias" (the mask, as
    # an additive bias) | "offsets" (cuDNN's packed layout, at most max_segments_per_row each).
    c.model.cudnn_document_mask = "bias"
    c.model.max_segments_per_row = 64

    c.router = router_config("sparsemixer_v2star", top_k=2, jitter_eps=0.1)
    c.optim = optim_config("linear", peak_lr=3e-3, warmup_steps=30, decay_steps=300,
                           b2=0.98, weight_decay=0.01, weight_decay_mask="matrices",
                           clip_norm=1.0)
    c.runtime = runtime_config()
    c.mesh = mesh_config(data=1)

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "The city|In 1990,"  # one sample per "|"-separated prompt
    c.sample.tokens = 40
    c.sample.temperature = 0.8
    c.sample.top_k = 40

    c.train_steps = 300
    c.eval_every = 300  # validation (1,000 articles) once, at the end
    c.checkpoint_every = 100
    c.log_every = 20
    return c
