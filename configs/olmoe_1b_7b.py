"""OLMoE-1B-7B's shapes (about 6.9 B parameters, 1.3 B active per token).

Sizes from the ``config.json`` of allenai/OLMoE-1B-7B-0924 on the Hugging Face Hub
(``model_type`` olmoe): hidden_size 2048, num_hidden_layers 16, num_attention_heads 16,
num_key_value_heads 16 (head_dim 128), intermediate_size 1024 (each expert), num_experts 64,
num_experts_per_tok 8, norm_topk_prob false, vocab_size 50304, rope_theta 10000, rms_norm_eps
1e-5, RMSNorm of the whole query and key projections, clip_qkv null, tie_word_embeddings false,
max_position_embeddings 4096, router_aux_loss_coef 0.01. Routing is the checkpoint's own
(softmax top-8, gates not renormalised).

Compile it for a target (docs/tpu.md, docs/gpu.md: what fits where)::

    python -m experiments.compile --config configs/olmoe_1b_7b.py:tpu --target tpu:v5e:4x4
    python -m experiments.compile --config configs/olmoe_1b_7b.py:h100 --target h100:1x1x8

On a TPU v5e 4x4 slice experts and model width split 4 ways each, on one host of 8 H100s
experts 8 ways; one sequence per device per micro-batch (256 sequences per update on the TPU
slice, 128 on the GPUs). Variants, dispatch, rematerialisation and
fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs.lm_sizes import Layout, real_size_config
from sparsemixer_jax.training.config import router_config

MODEL = dict(
    hf_type="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16,
    num_kv_heads=16, head_dim=0, mlp_dim=1024, num_experts=64, rope_theta=10000.0,
    norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=4096)

LAYOUTS = {
    # TPU v5e 4x4 (16 chips of 16 GiB): experts 4 ways, model width 4 ways; 256 sequences per
    # update in micro-batches of one sequence per chip.
    "tpu": Layout(fsdp=4, expert=4, batch_size=256, micro_batch_size=16, dispatch="ragged"),
    # One host of 8 H100s: experts 8 ways; 128 sequences per update.
    "h100": Layout(fsdp=1, expert=8, batch_size=128, micro_batch_size=8, dispatch="grouped"),
}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    router = router_config("switch", top_k=8,
                           jitter_eps=0.0, normalize_top_k=False, balance_weight=0.01)
    return real_size_config(MODEL, router, LAYOUTS, variant)
