"""Mixtral-8x7B's shapes (about 46.7 B parameters, 12.9 B active per token).

Sizes from the ``config.json`` of mistralai/Mixtral-8x7B-v0.1 on the Hugging Face Hub
(``model_type`` mixtral): hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
num_key_value_heads 8 (head_dim 128), intermediate_size 14336 (each expert), num_local_experts 8,
num_experts_per_tok 2, vocab_size 32000, rope_theta 1e6, rms_norm_eps 1e-5,
tie_word_embeddings false, max_position_embeddings 32768, router_aux_loss_coef 0.02. Routing is
the checkpoint's own (softmax top-2, gates renormalised); ``--config.router.name`` trains with
another estimator.

Compile it for a target (docs/tpu.md, docs/gpu.md: what fits where)::

    python -m experiments.compile --config configs/mixtral_8x7b.py:tpu --target tpu:v5p:4x4x4
    python -m experiments.compile --config configs/mixtral_8x7b.py:h100 --target h100:1x8x8

On a 64-chip TPU slice or 64 H100s (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts split
8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the GPUs.
Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import POD_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, mlp_dim=14336, num_experts=8, rope_theta=1e6, norm_eps=1e-5,
    tie_embeddings=False, max_position_embeddings=32768)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=2,
                           jitter_eps=0.0, normalize_top_k=True, balance_weight=0.02)
    return real_size_config(MODEL, router, POD_LAYOUTS, variant)
