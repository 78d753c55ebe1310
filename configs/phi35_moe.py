"""Phi-3.5-MoE's shapes (about 41.9 B parameters, 6.6 B active per token), as GRIN-MoE.

Sizes from the ``config.json`` of microsoft/Phi-3.5-MoE-instruct on the Hugging Face Hub
(``model_type`` phimoe): hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
num_key_value_heads 8 (head_dim 128), intermediate_size 6400 (each expert), num_local_experts 16,
num_experts_per_tok 2, vocab_size 32064, rms_norm_eps 1e-5 (the epsilon of its LayerNorms),
attention_bias true, lm_head_bias true, router_jitter_noise 0.01 (SparseMixer-v2's mask
threshold), tie_word_embeddings false. Its rotary embedding is ``longrope`` (per-frequency
factors and scales, rope_theta 10000), which comes with the checkpoint on fine-tuning
(``--config.init_from``); from scratch this config uses default rope at theta 10000, since rope
does not change the memory or the program's shape.

Compile it for a target (docs/tpu.md, docs/gpu.md: what fits where)::

    python -m experiments.compile --config configs/phi35_moe.py:tpu --target tpu:v5p:4x4x4
    python -m experiments.compile --config configs/phi35_moe.py:h100 --target h100:1x8x8

On a 64-chip TPU slice or 64 H100s (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts split
8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the GPUs.
Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import POD_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="phimoe", vocab_size=32064, hidden_size=4096, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, mlp_dim=6400, num_experts=16, rope_theta=10000.0,
    norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=4096)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("sparsemixer_v2", top_k=2,
                           jitter_eps=0.01, balance_weight=0.0)
    return real_size_config(MODEL, router, POD_LAYOUTS, variant)
