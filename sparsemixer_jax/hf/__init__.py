"""Hugging Face interop for the decoder-only MoE language model.

::

    from sparsemixer_jax import hf
    model, config = hf.load_pretrained(path)    # config.json + *.safetensors (sharded too)
    logits = model(input_ids)                   # [B, T, V], float32; the model is in eval mode
    hf.save_pretrained(model, config, out_dir)  # loads in transformers' AutoModelForCausalLM
    tokenizer = hf.load_tokenizer(path)         # tokenizer.json, special tokens, chat template

Types: ``mixtral``, ``qwen3_moe``, ``olmoe``, ``qwen2_moe``, ``phimoe``, ``glm4_moe``,
``gpt_oss`` (MXFP4 experts dequantized on load), ``deepseek_v3`` (``kimi_k2`` read as it;
block-FP8 weights dequantized on load; docs/lm.md; one record each in
:mod:`sparsemixer_jax.hf.families`). Needs the ``safetensors`` package (``tokenizers`` for
:func:`load_tokenizer`, ``jinja2`` to render chat templates): ``pip install
'sparsemixer-jax[hf]'``; torch is never imported.
"""

from sparsemixer_jax.hf.checkpoint import load_pretrained, read_config, save_pretrained
from sparsemixer_jax.hf.config import from_hf, to_hf
from sparsemixer_jax.hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFTokenizer", "from_hf", "load_pretrained", "load_tokenizer", "read_config",
           "save_pretrained", "to_hf"]
