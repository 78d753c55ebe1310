"""Qwen3.6-35B-A3B's text model (about 35 B parameters, 3 B active per token); Qwen3.5-35B-A3B has
the same shapes.

Sizes from the model card of Qwen/Qwen3.6-35B-A3B on the Hugging Face Hub (``model_type``
qwen3_5_moe, its text model ``qwen3_5_moe_text``): hidden size 2048, 40 layers laid out as
10 x (3 Gated DeltaNet layers, then 1 gated attention layer), each followed by a mixture of
experts; Gated DeltaNet with 16 query/key heads and 32 value heads of width 128; attention with 16
query heads and 2 key/value heads of width 256, rotary over 64 of its dimensions (partial rotary
factor 0.25); 256 experts of width 512, 8 routed and 1 shared expert of width 512 per token;
vocabulary 248,320 (padded). The rotary base 1e7 and the 262,144-token context are the Qwen3.5
family's. Routing is the checkpoint's own (softmax top-8, gates renormalised). The vision tower
and the multi-token-prediction layer are not part of the text model.

Compile it for a target (docs/tpu.md, docs/gpu.md: what fits where)::

    python -m experiments.compile --config configs/qwen36_35b_a3b.py:tpu --target tpu:v5p:4x4x4
    python -m experiments.compile --config configs/qwen36_35b_a3b.py:h100 --target h100:1x8x8

On a 64-chip TPU slice or 64 H100s (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts split
8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the GPUs.
"""

import ml_collections

from configs.lm_sizes import POD_LAYOUTS, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_layers=40,
    num_heads=16, num_kv_heads=2, head_dim=256, mlp_dim=512, shared_expert_dim=512,
    num_experts=256, rope_theta=1e7, norm_eps=1e-6, tie_embeddings=False,
    max_position_embeddings=262144,
    hf_keys=dict(full_attention_interval=4, partial_rotary_factor=0.25,
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4))


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=8,
                           jitter_eps=0.0, normalize_top_k=True, balance_weight=0.001)
    return real_size_config(MODEL, router, POD_LAYOUTS, variant)
