"""Loads each reference model of tests/data/hf with :func:`sparsemixer_jax.hf.load_pretrained`
and saves it with :func:`sparsemixer_jax.hf.save_pretrained` into ``OUT/<type>``, for
``scripts/make_hf_references.py --check OUT`` to load with transformers (the round trip back
into transformers; run by hand, CI has no torch). ``OUT/mixtral_sparsemixer`` is the Mixtral
routed by SparseMixer-v2*: its config.json records that routing (``sparsemixer_jax_routing``),
which transformers keeps and ignores, computing Mixtral's own. ``OUT/qwen3_5_moe_exported`` is
Qwen3.5-MoE's image-text-to-text directory exported as its text model (``qwen3_5_moe_text``).

    PYTHONPATH=. python scripts/hf_roundtrip_save.py /tmp/hf_saved   # this checkout's package
"""

import os
import sys

from sparsemixer_jax import hf
from sparsemixer_jax.models.lm_config import MODEL_TYPES

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf")

if __name__ == "__main__":
    out = sys.argv[1]
    # gpt_oss_mxfp4 (MXFP4) and deepseek_v3_fp8 (block FP8): quantized checkpoints, saved in
    # float32; mixtral_llama3: llama3 rope scaling
    for model_type in (*MODEL_TYPES, "gpt_oss_mxfp4", "deepseek_v3_fp8", "mixtral_llama3"):
        model, config = hf.load_pretrained(os.path.join(DATA, model_type))
        hf.save_pretrained(model, config, os.path.join(out, model_type))
        print(f"{model_type}: saved to {os.path.join(out, model_type)}")
    model, config = hf.load_pretrained(os.path.join(DATA, "mixtral"),
                                       router="sparsemixer_v2star", jitter_eps=0.1)
    hf.save_pretrained(model, config, os.path.join(out, "mixtral_sparsemixer"))
    print(f"mixtral_sparsemixer: saved to {os.path.join(out, 'mixtral_sparsemixer')}")
    model, config = hf.load_pretrained(os.path.join(DATA, "qwen3_5_moe"))
    hf.save_pretrained(model, config, os.path.join(out, "qwen3_5_moe_exported"))
    print(f"qwen3_5_moe_exported: saved to {os.path.join(out, 'qwen3_5_moe_exported')}")
