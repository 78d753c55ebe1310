"""gpt-oss-120b's shapes (about 116.8 B parameters, 5.1 B active per token).

Sizes from the ``config.json`` of openai/gpt-oss-120b on the Hugging Face Hub (``model_type``
gpt_oss): as gpt-oss-20b's (``configs/gpt_oss_20b.py``: hidden_size 2880, 64 query heads and 8
key/value heads of 64, experts 2880 wide, top-4, vocab_size 201088, sliding_window 128 on every
other layer, swiglu_limit 7.0, the same YaRN rope, router_aux_loss_coef 0.9) but with
num_hidden_layers 36 and num_local_experts 128. Attention sinks are computed by the ``einsum``
attention only (``model.attention_impl``, the default).

Compile it for a target (docs/gpu.md, docs/tpu.md: what fits where)::

    python -m experiments.compile --config configs/gpt_oss_120b.py:h100 --target h100:1x8x8
    python -m experiments.compile --config configs/gpt_oss_120b.py:tpu --target tpu:v5p:4x4x4

On 8 hosts of 8 H100s or a 64-chip TPU slice (``configs/lm_sizes.py``: ``POD_LAYOUTS``): experts
split 8 ways and the model width 8 ways; 256 sequences per update on the TPU slice, 128 on the
GPUs. Variants, dispatch, rematerialisation and fine-tuning: ``configs/lm_sizes.py``.
"""

import ml_collections

from configs import gpt_oss_20b
from configs.lm_sizes import POD_LAYOUTS, real_size_config

MODEL = {**gpt_oss_20b.MODEL, "num_layers": 36, "num_experts": 128}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    # Attention sinks: the einsum attention's alone.
    return real_size_config(MODEL, gpt_oss_20b.router(), POD_LAYOUTS, variant, attention="einsum")
