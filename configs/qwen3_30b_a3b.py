"""Qwen3-30B-A3B's shapes (about 30.5 B parameters, 3.3 B active per token).

Sizes from the ``config.json`` of Qwen/Qwen3-30B-A3B on the Hugging Face Hub (``model_type``
qwen3_moe): hidden_size 2048, num_hidden_layers 48, num_attention_heads 32, num_key_value_heads
4, head_dim 128, moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8,
norm_topk_prob true, decoder_sparse_step 1 with no mlp_only_layers (every layer routed),
vocab_size 151936, rope_theta 1e6, rms_norm_eps 1e-6, per-head RMSNorm of queries and keys,
tie_word_embeddings false, max_position_embeddings 40960, router_aux_loss_coef 0.001. Routing is
the checkpoint's own (softmax top-8, gates renormalised).

Compile it for a target (docs/tpu.md, docs/gpu.md: what fits where)::

    python -m experiments.compile --config configs/qwen3_30b_a3b.py:tpu --target tpu:v5p:4x4x4
    python -m experiments.compile --config configs/qwen3_30b_a3b.py:h100 --target h100:1x8x8

On a 64-chip TPU slice or 64 H100s (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts split
8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the GPUs.
Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import POD_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
    num_kv_heads=4, head_dim=128, mlp_dim=768, num_experts=128, rope_theta=1e6, norm_eps=1e-6,
    tie_embeddings=False, max_position_embeddings=40960)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=8,
                           jitter_eps=0.0, normalize_top_k=True, balance_weight=0.001)
    return real_size_config(MODEL, router, POD_LAYOUTS, variant)
