"""Moonlight-16B-A3B's shapes (about 16 B parameters, 3 B active per token), DeepSeek-V3's
architecture.

Sizes from the ``config.json`` of moonshotai/Moonlight-16B-A3B on the Hugging Face Hub
(``model_type`` deepseek_v3): hidden_size 2048, num_hidden_layers 27 of which the first
(first_k_dense_replace 1) has a dense MLP of intermediate_size 11264 and the others
n_routed_experts 64 experts of moe_intermediate_size 1408 with n_shared_experts 2,
num_experts_per_tok 6, multi-head latent attention with num_attention_heads 16 (and
num_key_value_heads 16), q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim 128,
qk_rope_head_dim 64, v_head_dim 128, vocab_size 163840, rope_theta 50000 (no rope_scaling),
rms_norm_eps 1e-5, tie_word_embeddings false, max_position_embeddings 8192; routing by
scoring_func sigmoid with topk_method noaux_tc (the selection bias), n_group 1, topk_group 1,
norm_topk_prob true, routed_scaling_factor 2.446, aux_loss_alpha 0.001 with seq_aux true (a
balance loss counted per sequence). Latent attention is computed by the ``einsum`` attention
only (``model.attention_impl``, the default).

Compile it for a target (docs/gpu.md, docs/tpu.md: what fits where)::

    python -m experiments.compile --config configs/moonlight_16b_a3b.py:h100 --target h100:1x1x8
    python -m experiments.compile --config configs/moonlight_16b_a3b.py:tpu --target tpu:v5p:2x2x2

On one host of 8 H100s or a TPU v5p 2x2x2 slice (8 chips; ``configs/lm_sizes.py``:
``HOST_LAYOUTS``): experts split 8 ways; 128 sequences per update, one per device per
micro-batch. Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import HOST_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="deepseek_v3", vocab_size=163840, hidden_size=2048, num_layers=27, num_heads=16,
    num_kv_heads=16, mlp_dim=1408, num_experts=64, rope_theta=50000.0, norm_eps=1e-5,
    tie_embeddings=False, max_position_embeddings=8192,
    hf_keys=dict(intermediate_size=11264, first_k_dense_replace=1, n_shared_experts=2,
                 q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128))


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=6, jitter_eps=0.0,
                           score="sigmoid", routed_scaling_factor=2.446,
                           balance_weight=0.001, balance_scope="sequence")
    return real_size_config(MODEL, router, HOST_LAYOUTS, variant)
