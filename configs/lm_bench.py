"""The language-model sizes the throughput targets are set at: an MoE and a dense model of equal
active parameters, bf16, one H100.

Both: hidden 2048, 16 layers, 16 query / 4 key-value heads (head width 128), vocabulary 32,768,
sequences of 4,096 tokens, 16 sequences (65,536 tokens) per update in micro-batches of
``data.micro_batch_size`` rows, bf16 compute, cuDNN's fused (flash) attention, Mixtral's layer
(``configs/lm_quickstart.py``'s type) and routing (softmax top-2, gates renormalised, no
jitter). On one H200 the einsum attention, which keeps every layer's float32 [4096, 4096]
probabilities in memory, made the update 2.7x (dense) and 2.2x (MoE) slower
(docs/benchmarks.md, section 7); ``--config.model.attention_impl=einsum
--config.data.micro_batch_size=1`` still selects it.

* ``:moe``: 8 SwiGLU experts of width 2048 per layer, top-2, the grouped (Mosaic GPU) dispatch.
* ``:dense``: every feed-forward sublayer one SwiGLU MLP of width 4096 (``model.num_experts =
  0``): the MoE model's active matmul parameters per token, without its routers.

Predicted on one H100 without the hardware (docs/benchmarks.md, section 7)::

    python -m experiments.compile --config configs/lm_bench.py:dense --target h100:1x1 --roofline

Measured on one H200 at these defaults (commit c06cbc4; docs/benchmarks.md, section 7): the MoE
update 944 ms (32.5% MFU), the dense one 747 ms (41.1%), MoE / dense tokens/s 0.79; the
calibrated roofline had predicted 635 and 528 ms. Top-2, one more router and the dense twin fit
one H200's memory in one process; four such models do not.
"""

import ml_collections

from configs import lm_quickstart

VARIANTS = ("moe", "dense")


def get_config(variant: str = "moe") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/lm_bench.py: variant {variant!r}; choose one of "
                         f"{', '.join(VARIANTS)}")
    c = lm_quickstart.get_config()
    # Eight rows per micro-batch: the MoE update's accumulate needs 49.9 GiB of an H100's 79.7
    # (35.7 at four rows, where it needed 58.6 before the layers recomputed their elementwise
    # operations and the loss kept no float32 [tokens, vocab] arrays), and each halving of the
    # micro-batches halves the kernel launches and gradient additions per token: predicted 734
    # ms an update on one H100 against 838 at four rows (dense twin 581 against 630; it fits
    # all 16 rows in one step, 552 ms). The einsum attention fits one row only (52 GiB of
    # saved probabilities): add --config.data.micro_batch_size=1 with it.
    c.data.update(vocab_size=32768, seq_len=4096, batch_size=16, micro_batch_size=8,
                  eval_batch_size=1)
    m = c.model
    m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads = 2048, 16, 16, 4
    m.max_position_embeddings = 4096
    m.compute_dtype, m.attention_impl = "bfloat16", "cudnn"
    # Packed documents reach cuDNN as segment offsets with its causal flag, not as a
    # [B, 1, T, T] bias (docs/benchmarks.md, section 7). The Wikipedia sample's rows hold 54
    # segments at most; the data is refused before a run where a row holds more than 64.
    m.cudnn_document_mask, m.max_segments_per_row = "offsets", 64
    # The backward pass recomputes elementwise and layout operations (norms, rope, casts,
    # SwiGLU's products) inside its own kernels instead of reading saved copies: predicted 4%
    # (MoE) and 9% (dense) faster on one H100 for a two-layer proxy (docs/benchmarks.md, section
    # 7), and less memory.
    m.remat = "elementwise"
    if variant == "moe":
        m.num_experts, m.mlp_dim, m.dispatch = 8, 2048, "grouped"
    else:
        m.num_experts, m.mlp_dim = 0, 4096
    c.router.name, c.router.top_k, c.router.jitter_eps = "switch", 2, 0.0
    c.router.normalize_top_k = True
    return c
