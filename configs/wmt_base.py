"""WMT'14 En-De, Transformer-base Switch, the paper's settings (its Appendix, Table 5).

Every other config starts from this one and changes a few fields; the README documents each field.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.data = ml_collections.ConfigDict()
    c.data.source = "tfds"  # "tfds" | "text" | "synthetic"
    c.data.dir = ""  # tfds: data_dir ("" = TFDS default); text: the directory of the files
    c.data.tfds_name = "wmt14_translate/de-en"
    c.data.src = "en"
    c.data.tgt = "de"
    c.data.train_prefix = "train"  # text: {dir}/{prefix}.{lang}[.gz]; tfds: split name
    c.data.valid_prefix = "validation"
    c.data.test_prefix = "test"
    c.data.vocab_size = 32000  # joint SentencePiece vocabulary, trained on the training text
    c.data.vocab_sample_sentences = 2_000_000  # sentence pairs used to train the vocabulary
    c.data.max_len = 256  # tokens per side; longer pairs are skipped and counted
    c.data.max_tokens = 4096  # tokens (source or target, padded) per batch per update micro-step
    c.data.bucket_step = 8  # padded lengths are multiples of this (fewer buckets = fewer compiles)
    c.data.synthetic_size = 20000  # sentence pairs for data.source = "synthetic"

    c.model = ml_collections.ConfigDict()
    c.model.encoder_layers = 6
    c.model.decoder_layers = 6
    c.model.emb_dim = 512
    c.model.mlp_dim = 2048
    c.model.num_heads = 8
    c.model.dropout = 0.1
    c.model.attention_dropout = 0.1
    c.model.activation_dropout = 0.1
    c.model.num_experts = 4  # 0 = dense Transformer
    c.model.moe_every = 2  # MoE replaces the FFN of layers 0, 2, 4, ...
    c.model.dispatch = "auto"  # "auto" | "ragged" | "padded"
    c.model.capacity_factor = 0.0  # 0 = dropless; > 0 = Switch-style capacity with dropping
    c.model.compute_dtype = "float32"  # "float32" | "bfloat16" (params stay float32)
    # "einsum" (the paper's attention, with attention dropout) | "xla" | "cudnn" | "auto"
    # (jax.nn.dot_product_attention; fused flash attention with "cudnn"; needs attention_dropout=0)
    c.model.attention_impl = "einsum"

    c.router = ml_collections.ConfigDict()
    c.router.name = "sparsemixer"  # see sparsemixer_jax.routing.ROUTERS
    c.router.jitter_eps = 0.1
    c.router.top_k = 1  # experts per token (the one place top-k is set; GRIN uses 2)
    c.router.balance_weight = 0.01
    # "per_token": objective = mean cross entropy + balance_weight * balance loss (Switch
    # Transformer's convention). "per_batch": balance_weight * loss is added once per micro-batch
    # to the token-summed cross entropy, as the reference code (fairseq) does, i.e. a weight of
    # balance_weight / (tokens per micro-batch) per token, ~1e-6 in the paper's runs.
    c.router.balance_normalization = "per_token"
    c.router.z_loss_weight = 0.0

    c.optim = ml_collections.ConfigDict()
    c.optim.peak_lr = 7e-4
    c.optim.init_lr = 1e-7
    c.optim.warmup_steps = 8000
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0
    c.optim.clip_norm = 0.0  # 0 = no clipping
    c.optim.label_smoothing = 0.1
    c.optim.tokens_per_update = 2**17  # target tokens per update, reached by gradient accumulation

    c.train_steps = 400_000
    c.eval_every = 2000
    c.checkpoint_every = 2000
    c.log_every = 100
    c.seed = 0

    c.decode = ml_collections.ConfigDict()
    c.decode.beam_size = 4
    c.decode.length_penalty = 0.6
    c.decode.max_extra_len = 50  # generate at most source length + this many tokens
    c.decode.test_bleu = True  # beam search + BLEU on the test split at the end of training

    # Process-wide JAX/XLA settings (sparsemixer_jax/runtime.py), applied before JAX starts.
    c.runtime = ml_collections.ConfigDict()
    c.runtime.deterministic = False  # XLA:GPU deterministic ops: bit-exact resume on GPU, slower
    c.runtime.rng_impl = "threefry2x32"  # jax_default_prng_impl: | "rbg" | "unsafe_rbg"
    c.runtime.matmul_precision = "default"  # | "highest": full float32 matmuls (no TF32 on GPU)
    c.runtime.triton_ragged_dot = False  # ragged_dot's grouped Pallas/Triton GPU lowering

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = all devices not used by the expert axis
    c.mesh.expert = 1
    return c
