"""gpt-oss-20b's shapes (about 20.9 B parameters, 3.6 B active per token).

Sizes from the ``config.json`` of openai/gpt-oss-20b on the Hugging Face Hub (``model_type``
gpt_oss): hidden_size 2880, num_hidden_layers 24, num_attention_heads 64, num_key_value_heads 8,
head_dim 64, intermediate_size 2880 (each expert), num_local_experts 32, num_experts_per_tok 4
(experts_per_token 4), vocab_size 201088, attention_bias true, sliding_window 128 on the layers
``layer_types`` names ``sliding_attention`` (every other layer from the first), swiglu_limit 7.0,
rope_theta 150000 with YaRN (factor 32, beta_fast 32, beta_slow 1,
original_max_position_embeddings 4096, truncate false), rms_norm_eps 1e-5,
tie_word_embeddings false, max_position_embeddings 131072, router_aux_loss_coef 0.9. Its
attention sinks, biased router and experts and clamped SwiGLU are the type's own (``hf_type``
gpt_oss). Routing is the checkpoint's own (softmax over the top-4 router logits: softmax top-4,
gates renormalised). Attention sinks are computed by the ``einsum`` attention only
(``model.attention_impl``, the default).

Compile it for a target (docs/gpu.md, docs/tpu.md: what fits where)::

    python -m experiments.compile --config configs/gpt_oss_20b.py:h100 --target h100:1x1x8
    python -m experiments.compile --config configs/gpt_oss_20b.py:tpu --target tpu:v5p:2x2x2

On one host of 8 H100s or a TPU v5p 2x2x2 slice (8 chips; ``configs/lm_sizes.py``:
``HOST_LAYOUTS``): experts split 8 ways; 128 sequences per update, one per device per
micro-batch. Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import HOST_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
    num_kv_heads=8, head_dim=64, mlp_dim=2880, num_experts=32, rope_theta=150000.0,
    norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=131072,
    hf_keys=dict(sliding_window=128, swiglu_limit=7.0, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
        original_max_position_embeddings=4096, truncate=False)))


def router() -> ml_collections.ConfigDict:
    """gpt-oss's routing (both sizes)."""
    return router_config("switch", top_k=4,
                         jitter_eps=0.0, normalize_top_k=True, balance_weight=0.9)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return real_size_config(MODEL, router(), HOST_LAYOUTS, variant)
