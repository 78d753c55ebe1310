"""Hugging Face interop for the decoder-only MoE language model.

::

    from sparsemixer_jax import hf
    model, config = hf.load_pretrained(path)    # config.json + *.safetensors (sharded too)
    logits = model(input_ids)                   # [B, T, V], float32; the model is in eval mode
    hf.save_pretrained(model, config, out_dir)  # loads in transformers' AutoModelForCausalLM;
                                                # config.json records the routing (ROUTING_KEY)
    tokenizer = hf.load_tokenizer(path)         # tokenizer.json, special tokens, chat template

:func:`check_checkpoint` finds what loading would refuse from the safetensors headers alone.
:func:`routes_from_vllm` and :func:`routes_from_sglang` turn the expert ids an inference engine
routed a rollout to into int32 ``[tokens, MoE layers, top_k]`` (numpy only).

Types: ``mixtral``, ``qwen3_moe``, ``olmoe``, ``qwen2_moe``, ``phimoe``, ``glm4_moe``,
``gpt_oss`` (MXFP4 experts dequantized on load), ``deepseek_v3`` (``kimi_k2`` read as it;
block-FP8 weights dequantized on load), the Gated DeltaNet hybrids ``qwen3_next`` and
``qwen3_5_moe_text`` (``qwen3_5_moe``'s image-text-to-text directories read as their text
model), ``glm4_moe_lite``, ``minimax_m2`` (block-FP8 weights dequantized on load),
``llama4_text`` (docs/lm.md; one record each in :mod:`sparsemixer_jax.hf.families`). Needs the
``safetensors`` package (``tokenizers`` for :func:`load_tokenizer`, ``jinja2`` to render chat
templates): ``pip install 'sparsemixer-jax[hf]'``; torch is never imported.
"""

from sparsemixer_jax.hf.checkpoint import (
    check_checkpoint,
    load_pretrained,
    read_config,
    save_pretrained,
)
from sparsemixer_jax.hf.config import ROUTING_KEY, from_hf, to_hf, without_routing_record
from sparsemixer_jax.hf.routes import routes_from_sglang, routes_from_vllm
from sparsemixer_jax.hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["ROUTING_KEY", "HFTokenizer", "check_checkpoint", "from_hf", "load_pretrained",
           "load_tokenizer", "read_config", "routes_from_sglang", "routes_from_vllm",
           "save_pretrained", "to_hf", "without_routing_record"]
