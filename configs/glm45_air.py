"""GLM-4.5-Air's shapes (about 106 B parameters, 12 B active per token).

Sizes from the ``config.json`` of zai-org/GLM-4.5-Air on the Hugging Face Hub (``model_type``
glm4_moe): hidden_size 4096, num_hidden_layers 46 of which the first (first_k_dense_replace 1)
has a dense MLP of intermediate_size 10944 and the others n_routed_experts 128 experts of
moe_intermediate_size 1408 with n_shared_experts 1, num_experts_per_tok 8,
num_attention_heads 96, num_key_value_heads 8, head_dim 128, partial_rotary_factor 0.5,
attention_bias true, use_qk_norm false, vocab_size 151552, rope_theta 1e6 (rope_scaling null),
rms_norm_eps 1e-5, tie_word_embeddings false, max_position_embeddings 131072; routing by sigmoid
scores with the selection bias (e_score_correction_bias), n_group 1, topk_group 1,
norm_topk_prob true, routed_scaling_factor 1.0. Its one multi-token prediction layer
(num_nextn_predict_layers 1, past the 46) is not built, as transformers skips it.

Compile it for a target (docs/gpu.md, docs/tpu.md: what fits where)::

    python -m experiments.compile --config configs/glm45_air.py:tpu --target tpu:v5p:4x4x4
    python -m experiments.compile --config configs/glm45_air.py:h100 --target h100:1x8x8

On a 64-chip TPU slice or 64 H100s (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts split
8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the GPUs.
Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import POD_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
    num_kv_heads=8, head_dim=128, mlp_dim=1408, num_experts=128, rope_theta=1e6,
    norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=131072,
    hf_keys=dict(intermediate_size=10944, first_k_dense_replace=1, n_shared_experts=1,
                 partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False))


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=8, jitter_eps=0.0,
                           score="sigmoid", balance_weight=0.0)
    return real_size_config(MODEL, router, POD_LAYOUTS, variant)
