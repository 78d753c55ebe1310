"""Reference files for tests/test_hf.py: tiny random transformers models and their outputs.

Run under any Python with torch and transformers (not the project's environment; CI has no
torch). The committed files were made with torch 2.13.0 (CPU) and transformers 5.23.0:

    python3.11 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors
    /tmp/torchenv/bin/python scripts/make_hf_references.py            # writes tests/data/hf/

For each type it builds a tiny model with non-default settings (grouped-query attention, an odd
vocabulary, head_dim apart from hidden / heads where the type allows it, dense layers mixed in,
3 or more experts per token where the type allows it, biases, Phi-3.5-MoE's jitter and longrope
settings, GLM-4.5's groups, selection bias, shared experts and partial rotary, DeepSeek-V3's
latent attention with YaRN's mscales), redraws every norm weight away from 1 and every bias
away from 0, GLM's and DeepSeek's selection bias
(``e_score_correction_bias``) included (transformers initialises them to 1 and 0, so a loader
that dropped them would still pass), and saves into
``tests/data/hf/<type>/``: the model (``save_pretrained``: config.json + model.safetensors) and
``reference.npz`` with ``input_ids [2, 12]``, transformers' float32 ``logits [2, 12, V]``, and
greedy ``generate`` from the first 5 tokens for 8 new tokens (``generated [2, 13]``).
Two more directories hold the quantized forms the Hub ships, gpt-oss in MXFP4
(``gpt_oss_mxfp4``) and DeepSeek-V3 in block FP8 (``deepseek_v3_fp8``; see ``MXFP4`` and
``FP8`` below). The Gated DeltaNet hybrids ``qwen3_next`` and ``qwen3_5_moe`` (Qwen3.5-MoE's
image-text-to-text model, its text model that of ``qwen3_5_moe_text``) are rewritten in the
Hub's spelling with multi-token-prediction tensors added (``hub_spelling``); transformers reads
each rewritten directory back to the same weights. A Mixtral with llama3 rope scaling is saved
as ``mixtral_llama3`` (``LLAMA3``).

The round trip back into transformers (run by hand; the saved directories come from the
project's environment):

    PYTHONPATH=. python scripts/hf_roundtrip_save.py /tmp/hf_saved     # project venv, JAX
    /tmp/torchenv/bin/python scripts/make_hf_references.py --check /tmp/hf_saved

``--check`` loads each ``/tmp/hf_saved/<type>`` with ``AutoModelForCausalLM.from_pretrained``
(failing where transformers reports a tensor missing, unexpected or of another shape) and
compares its logits with the reference (1e-4 of the largest magnitude); each directory of
``ROUTED`` (an export recording another routing than the type's, or Qwen3.5's
image-text-to-text model exported as its text model) with its source's reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf")
COMMON = dict(vocab_size=97, hidden_size=16, num_attention_heads=4, initializer_range=0.08,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
CONFIGS = {
    # GQA 2, head_dim 8 (16 / 4 = 4), 6 experts top-3, sliding window 5 < the 12 tokens.
    "mixtral": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                    intermediate_size=24, num_local_experts=6, num_experts_per_tok=3,
                    sliding_window=5, router_jitter_noise=0.1,
                    rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # GQA 4 (one key/value head), per-head q/k norms, biases, a dense layer in the middle,
    # renormalised top-3 of 5, tied embeddings.
    "qwen3_moe": dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=8,
                      intermediate_size=24, moe_intermediate_size=16, num_experts=5,
                      num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                      attention_bias=True, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    # Full-width q/k norms, clip_qkv that clips, biases, top-4 of 6 without renormalising.
    "olmoe": dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=24,
                  num_experts=6, num_experts_per_tok=4, norm_topk_prob=False, clip_qkv=0.4,
                  attention_bias=True),
    # decoder_sparse_step 2 over 5 layers (dense, MoE, dense, MoE, dense), shared expert with
    # its gate, q/k/v biases, top-3 of 6.
    "qwen2_moe": dict(num_hidden_layers=5, num_key_value_heads=2, head_dim=8,
                      intermediate_size=24, moe_intermediate_size=16, num_experts=6,
                      num_experts_per_tok=3, decoder_sparse_step=2,
                      shared_expert_intermediate_size=20, qkv_bias=True),
    # SparseMixer-v2 top-2 with mask threshold router_jitter_noise, LayerNorm with biases,
    # biases on attention and the head, longrope switching at 8 < 12 positions.
    "phimoe": dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                   intermediate_size=24, num_local_experts=5, num_experts_per_tok=2,
                   router_jitter_noise=0.3, input_jitter_noise=0.05, attention_bias=True,
                   lm_head_bias=True, max_position_embeddings=64,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0, 1.2, 1.6, 2.5],
                                    "long_factor": [1.0, 2.0, 4.0, 8.0],
                                    "short_mscale": 1.05, "long_mscale": 1.2,
                                    "original_max_position_embeddings": 8}),
    # Partial rotary (half of head_dim 8), per-head q/k norms, q/k/v biases, a dense first layer
    # (first_k_dense_replace), sigmoid scores with a selection bias (e_score_correction_bias,
    # redrawn below), 4 groups of 2 experts of which each token keeps 2 (each group scored by its
    # two best biased scores), renormalised top-3 of 8 scaled by 2.5, two shared experts.
    "glm4_moe": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                     intermediate_size=24, moe_intermediate_size=12, n_routed_experts=8,
                     num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
                     use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5}),
    # Attention sinks (redrawn below), sliding window 4 < 12 tokens on layers 0 and 3 only,
    # YaRN as the Hub's checkpoints set it (truncate false; its ramp falls inside head_dim 8),
    # q/k/v/o, router and expert biases, top-3 of 6 by a softmax over the chosen logits, and
    # the clamped SwiGLU at a limit of 0.3, which these weights' activations cross.
    "gpt_oss": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=12, num_local_experts=6, num_experts_per_tok=3,
                    sliding_window=4, swiglu_limit=0.3,
                    layer_types=["sliding_attention", "full_attention", "full_attention",
                                 "sliding_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 4096}),
    # Multi-head latent attention (queries through q_lora_rank 12, keys/values through
    # kv_lora_rank 10, 6 unrotated + 4 rotated query/key dims, values of 5, interleaved rope,
    # attention biases), YaRN with mscale / mscale_all_dim (cos/sin and the softmax scale, its
    # ramp inside the 4 rotated dims), a dense first layer, sigmoid scores with a selection bias
    # (redrawn below), 4 groups of 2 experts keeping 2 (each scored by its two best biased
    # scores), renormalised top-3 of 8 scaled by 2.5, two shared experts.
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=24,
                        moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2,
                        first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=12,
                        kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                        rope_interleave=True, attention_bias=True, max_position_embeddings=64,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                         "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                                         "beta_fast": 4.0, "beta_slow": 1.0,
                                         "original_max_position_embeddings": 16}),
    # The Gated DeltaNet hybrids (hidden 32): gated attention with per-head zero-centred q/k
    # norms on 4 query heads of 8 over 2 key/value heads, half of each head rotated; Gated
    # DeltaNet layers of 2 key heads of 8 and 4 value heads of 6 (two per key head), a 3-tap
    # convolution; top-3 of 6 experts with a gated shared expert. Qwen3-Next: every second
    # layer attention (full_attention_interval 2), a dense third layer (mlp_only_layers),
    # top-3 not renormalised; config.json in the Hub's spelling (below, HUB_SPELLING).
    "qwen3_next": dict(hidden_size=32, num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=24, moe_intermediate_size=12, num_experts=6,
                       num_experts_per_tok=3, shared_expert_intermediate_size=20,
                       norm_topk_prob=False, mlp_only_layers=[2], full_attention_interval=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=6, linear_conv_kernel_dim=3,
                       rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                        "partial_rotary_factor": 0.5}),
    # Qwen3.5-MoE's text model: Qwen3-Next's with separate DeltaNet projections, every layer
    # routed (renormalised top-3), attention on the last of 4 layers only, and Qwen3.5's
    # multimodal rotary settings (mrope_section, interleaved), plain rotary for text.
    "qwen3_5_moe_text": dict(hidden_size=32, num_hidden_layers=4, num_key_value_heads=2,
                             head_dim=8, moe_intermediate_size=12, num_experts=6,
                             num_experts_per_tok=3, shared_expert_intermediate_size=20,
                             layer_types=["linear_attention"] * 3 + ["full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=6,
                             linear_conv_kernel_dim=3,
                             rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                              "partial_rotary_factor": 0.5,
                                              "mrope_section": [1, 1, 0],
                                              "mrope_interleaved": True}),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention (queries through q_lora_rank 12, keys/values
    # through kv_lora_rank 10, 6 unrotated + 4 rotated dims, values of 5) with the rotated
    # halves not interleaved, attention biases, dense layers 0 and 2 of 4 (mlp_layer_types),
    # and GLM-4.5's routing: sigmoid scores with a selection bias (redrawn below), 4 groups of
    # 2 keeping 2, renormalised top-3 of 8 scaled by 2.5, two shared experts.
    "glm4_moe_lite": dict(num_hidden_layers=4, num_key_value_heads=4, intermediate_size=24,
                          moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          n_shared_experts=2, norm_topk_prob=True, q_lora_rank=12,
                          kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                          rope_interleave=False, attention_bias=True,
                          mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # MiniMax-M2 in the Hub's keys: q/k RMSNorms over the whole projections (use_qk_norm,
    # qk_norm_type "per_layer"), half of each head rotated (rotary_dim 4 of head_dim 8), sigmoid
    # scores with a selection bias (scoring_func, use_routing_bias; the bias redrawn below),
    # renormalised top-3 of 6, GQA 2, the MTP keys of its checkpoints (no MTP tensors).
    "minimax_m2": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                       intermediate_size=12, num_local_experts=6, num_experts_per_tok=3,
                       rotary_dim=4, use_qk_norm=True, qk_norm_type="per_layer",
                       scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0,
                       attn_type_list=[1, 1, 1], use_mtp=True, num_mtp_modules=3,
                       mtp_transformer_layers=1,
                       rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    # Llama 4's text model: MoE on layers 1 and 3 of 4 (interleave_moe_layer_step 2; the dense
    # ones intermediate_size_mlp wide), top-2 of 4 gated by the chosen logits' sigmoids applied
    # to the experts' inputs, a shared expert, attention biases; rotary positions on layers 0, 1
    # and 3 (pairs interleaved, llama3 scaling whose three bands hold head_dim 8's
    # frequencies), L2 q/k norms there and chunked attention of 4 < 12 tokens; layer 2 without
    # rotary positions, its queries scaled by the temperature tuning (floor_scale 2, attn_scale
    # 0.3, so the scale grows within the 12 tokens).
    "llama4_text": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=12, intermediate_size_mlp=24, num_local_experts=4,
                        num_experts_per_tok=2, interleave_moe_layer_step=2,
                        no_rope_layers=[1, 1, 0, 1], attention_chunk_size=4, use_qk_norm=True,
                        attention_bias=True, attn_temperature_tuning=True, floor_scale=2,
                        attn_scale=0.3,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 8.0,
                                         "original_max_position_embeddings": 1024}),
}
# Qwen3.5-MoE as the Hub ships it: the image-text-to-text model (a vision tower, the text model
# under text_config and its tensors under model.language_model.*), config.json in the Hub's
# spelling (text_config's attn_output_gate and multi-token-prediction keys), and the tensors of
# one multi-token-prediction layer (mtp.*). Its text model is qwen3_5_moe_text's settings; the
# reference is transformers' logits of the whole model on text.
VL = "qwen3_5_moe"
VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2,
                 temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=32,
                 num_position_embeddings=16)
# Mixtral with llama3 rope scaling (transformers computes any type's rotary frequencies by the
# rope_type its config names): factor 8 with its band edges at wavelengths 1024 and 128, so
# that of head_dim 8's four frequencies (theta 500000: wavelengths 6.3, 167, 4.4e3, 1.2e5) one is
# kept, one blended and two divided.
LLAMA3 = "mixtral_llama3"
LLAMA3_CONFIG = dict(CONFIGS["mixtral"], sliding_window=None,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 8.0,
                                      "original_max_position_embeddings": 1024})
# DeepSeek-V3 as the Hub ships it: block-FP8 weights (e4m3 with a float32 weight_scale_inv per
# block; blocks of 8 x 8 here, so kv_a_proj_with_mqa's 14 rows end in a partial block), the
# Hub's config.json spelling (rope_scaling with ``type``, rope_theta, topk_method, scoring_func,
# moe_layer_freq, ep_size, aux_loss_alpha, seq_aux, num_nextn_predict_layers, no head_dim, no
# rope_interleave: interleaved by default), no query low rank (q_lora_rank null), default rope,
# and one multi-token-prediction layer's tensors past num_hidden_layers. The reference logits
# are transformers' of the dequantized weights (written as float32 to a scratch directory).
FP8 = "deepseek_v3_fp8"
FP8_CONFIG = dict(num_hidden_layers=2, num_key_value_heads=4, intermediate_size=24,
                  moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                  n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=1,
                  first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=None,
                  kv_lora_rank=10, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FP8_BLOCK = 8
# gpt-oss as the Hub ships it: experts in MXFP4 (quantized below; MXFP4 needs input widths of
# multiples of 32), config.json in the Hub's spelling (rope_scaling, rope_theta,
# experts_per_token, initial_context_length, no swiglu_alpha) and YaRN without ``truncate``
# (true by default), factor 8. Saved to tests/data/hf/gpt_oss_mxfp4 with transformers' logits
# of the directory (dequantized on load).
MXFP4 = "gpt_oss_mxfp4"
MXFP4_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=3, swiglu_limit=0.5, max_position_embeddings=32768,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 4096})
# Each type's torch seed: the first five as the committed files were made (sorted order), new
# types after them, so that adding a type leaves the others' files as they are.
SEEDS = {t: i for i, t in enumerate(("mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
                                     "glm4_moe", "gpt_oss", MXFP4, "deepseek_v3",
                                     FP8, "qwen3_next", "qwen3_5_moe_text", VL,
                                     "glm4_moe_lite", "minimax_m2", LLAMA3, "llama4_text"))}
PROMPT, NEW = 5, 8


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(SEEDS[model_type])
    if model_type == VL:
        from transformers import AutoModelForImageTextToText

        text = {**COMMON, **CONFIGS["qwen3_5_moe_text"]}
        config = AutoConfig.for_model(VL, text_config=text, vision_config=VL_VISION,
                                      tie_word_embeddings=False)
        config._attn_implementation = "eager"
        config.text_config._attn_implementation = "eager"
        model = AutoModelForImageTextToText.from_config(config).float().eval()
    else:
        settings = {MXFP4: MXFP4_CONFIG, FP8: FP8_CONFIG, LLAMA3: LLAMA3_CONFIG}.get(
            model_type) or CONFIGS[model_type]
        base = {MXFP4: "gpt_oss", FP8: "deepseek_v3", LLAMA3: "mixtral"}.get(model_type,
                                                                             model_type)
        config = AutoConfig.for_model(base, **{**COMMON, **settings})
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "norm" in name:  # every norm weight: input, post-attention, final, q/k
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("sinks"):  # gpt-oss's sink logits, large enough to matter
                param.copy_(torch.randn_like(param))
        for name, buffer in model.named_buffers():  # the selection bias, zeros as initialised
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    return model


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``(blocks, scales)`` of ``weight [N, in, out]`` in the Hub's layout (blocks
    ``[N, out, in / 32, 16]``, low nibble first; scales ``[N, out, in / 32]``, exponent + 127):
    each block of 32 scaled by the power of two that brings its largest magnitude to at most 6,
    each value rounded to the nearest FP4 magnitude."""
    n, width, out = weight.shape
    rows = weight.transpose(1, 2).reshape(n, out, width // 32, 32)
    largest = rows.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(largest / 6.0))
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scaled = rows / torch.exp2(exponent)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``weight [N, in, out]`` of :func:`quantize_mxfp4`'s output."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).long()
    values = magnitudes[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    values = values.reshape(*blocks.shape[:-1], 32) * torch.exp2(scales.float() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).transpose(1, 2)


def save_mxfp4(model: torch.nn.Module, directory: str) -> None:
    """The model's experts quantized (and the model's own weights set to the quantized values),
    saved as the Hub's gpt-oss checkpoints are: ``*_blocks`` / ``*_scales`` and a config.json in
    the Hub's spelling with ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    quantized = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                blocks, scales = quantize_mxfp4(param)
                param.copy_(dequantize_mxfp4(blocks, scales))
                quantized[name] = (blocks, scales)
    model.save_pretrained(directory)
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    del cfg["swiglu_alpha"]
    cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope,
               experts_per_token=cfg["num_experts_per_tok"],
               initial_context_length=rope["original_max_position_embeddings"],
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router",
                   "model.embed_tokens", "lm_head"]})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 ``(e4m3 weight, float32 weight_scale_inv)`` of ``weight [rows, cols]``: each
    ``block x block`` tile (the last ones partial) divided by its largest magnitude / 448."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.empty(grid)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """``weight [rows, cols]`` of :func:`quantize_fp8`'s output (each tile times its scale)."""
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return quantized.float() * expanded[:quantized.shape[0], :quantized.shape[1]]


def save_fp8(model: torch.nn.Module, directory: str) -> str:
    """The model saved as DeepSeek-V3's Hub checkpoints are (module docstring at ``FP8``); returns
    a scratch directory holding the dequantized weights in float32 with transformers' config."""
    import tempfile

    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    plain = dict(tensors)
    for name, value in list(tensors.items()):
        if name.startswith("model.layers.") and name.endswith(("proj.weight", "_mqa.weight")):
            quantized, scale = quantize_fp8(value, FP8_BLOCK)
            tensors[name] = quantized
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
            plain[name] = dequantize_fp8(quantized, scale, FP8_BLOCK)
    mtp = f"model.layers.{FP8_CONFIG['num_hidden_layers']}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(16, 32)
    tensors[f"{mtp}.enorm.weight"] = torch.ones(16)
    save_file(tensors, file, metadata={"format": "pt"})
    scratch = tempfile.mkdtemp()  # left for the caller to load; the OS's temporary files
    save_file(plain, os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(scratch, "config.json"), "w") as f:
        json.dump(cfg, f)
    rope = cfg.pop("rope_parameters")
    for key in ("head_dim", "qk_head_dim", "rope_interleave"):
        cfg.pop(key, None)
    cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling=None, topk_method="noaux_tc",
               scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001,
               seq_aux=True, num_nextn_predict_layers=1,
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                    "quant_method": "fp8",
                                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return scratch


def hub_spelling(directory: str, model_type: str) -> None:
    """Rewrites a saved hybrid as the Hub's checkpoints spell it and adds the tensors of one
    multi-token-prediction layer (``mtp.*``, which transformers skips): Qwen3-Next's
    config.json with top-level ``rope_theta`` / ``partial_rotary_factor``, ``rope_scaling``
    null, ``full_attention_interval`` instead of ``layer_types`` and ``use_sliding_window``
    false; Qwen3.5's ``text_config`` with ``attn_output_gate`` and the MTP settings."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    hidden = 32
    tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden),
                    "mtp.norm.weight": torch.ones(hidden),
                    "mtp.layers.0.input_layernorm.weight": torch.ones(hidden)})
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    if model_type == "qwen3_next":
        rope = cfg.pop("rope_parameters")
        cfg.pop("layer_types")
        cfg.update(rope_theta=rope["rope_theta"], rope_scaling=None,
                   partial_rotary_factor=rope["partial_rotary_factor"],
                   full_attention_interval=CONFIGS["qwen3_next"]["full_attention_interval"],
                   use_sliding_window=False)
    else:
        cfg["text_config"].update(attn_output_gate=True, mtp_num_hidden_layers=1,
                                  mtp_use_dedicated_embeddings=False, full_attention_interval=4)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def load(directory: str, faults: list[str] | None = None) -> torch.nn.Module:
    """transformers' model of a saved directory in float32 (an MXFP4 one dequantized): the
    tensors transformers found missing, unexpected (other than the multi-token-prediction
    ones it skips) or mismatched go to ``faults``, or raise where ``faults`` is None."""
    kwargs = {}
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    if "quantization_config" in cfg:
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    auto = AutoModelForCausalLM
    if cfg.get("model_type") == VL:
        from transformers import AutoModelForImageTextToText as auto
    model, info = auto.from_pretrained(directory, attn_implementation="eager",
                                       dtype=torch.float32, output_loading_info=True, **kwargs)
    found = [f"{kind}: {sorted(map(str, names))}" for kind, names in info.items()
             if kind in ("missing_keys", "unexpected_keys", "mismatched_keys") and names
             and not (kind == "unexpected_keys" and all(n.startswith("mtp.") for n in names))]
    if faults is None and found:
        raise RuntimeError(f"{directory}: transformers reports {found}")
    if faults is not None:
        faults.extend(found)
    return model.float().eval()


def make(model_type: str) -> None:
    model = build(model_type)
    directory = os.path.join(OUT, model_type)
    if model_type == MXFP4:
        save_mxfp4(model, directory)
        expected = model
        model = load(directory)  # the reference is what transformers reads from the files
        for (name, a), b in zip(expected.state_dict().items(), model.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), f"transformers dequantized {name} otherwise"
    elif model_type == FP8:
        model = load(save_fp8(model, directory))
    else:
        model.save_pretrained(directory)
    if model_type in HUB_SPELLING:
        hub_spelling(directory, model_type)
        again = load(directory)  # the Hub's spelling reads as what was saved
        for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), f"{directory}: {name} reads otherwise"
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
        # use_mtp off: MiniMax-M2's config.json says use_mtp (for its MTP modules, which
        # transformers builds none of), which generate would read as assisted decoding.
        generated = model.generate(input_ids[:, :PROMPT], max_new_tokens=NEW, do_sample=False,
                                   min_new_tokens=NEW, pad_token_id=0, use_mtp=False).numpy()
    np.savez_compressed(os.path.join(directory, "reference.npz"), input_ids=input_ids.numpy(),
                        logits=logits, generated=generated)
    print(f"{model_type}: {sum(p.numel() for p in model.parameters())} params -> {directory}")


# Saved directories whose config.json records another routing than the type's (transformers
# computes the type's own): the reference each is compared with.
ROUTED = {"mixtral_sparsemixer": "mixtral", "qwen3_5_moe_exported": VL}
# Directories rewritten in the Hub's spelling after transformers saved them (hub_spelling).
HUB_SPELLING = ("qwen3_next", VL)


def check(root: str, types: list[str]) -> int:
    failures = 0
    for model_type in types:
        directory = os.path.join(root, model_type)
        if not os.path.isdir(directory):
            print(f"{model_type}: no {directory}")
            failures += 1
            continue
        faults: list[str] = []
        model = load(directory, faults)
        ref = np.load(os.path.join(OUT, ROUTED.get(model_type, model_type), "reference.npz"))
        if model_type in ROUTED:
            print(f"{model_type}: config.sparsemixer_jax_routing = "
                  f"{model.config.sparsemixer_jax_routing}")
        with torch.no_grad():
            logits = model(torch.as_tensor(ref["input_ids"])).logits.numpy()
        err = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
        ok = err <= 1e-4 and not faults
        failures += not ok
        print(f"{model_type}: transformers loads {directory}; logits max error {err:.2e} of the "
              f"largest; tensors {'; '.join(faults) or 'all matched'} "
              f"({'ok' if ok else 'FAIL'})")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", metavar="DIR", help="compare transformers' logits of the "
                        "directories DIR/<type> with the references")
    parser.add_argument("--types", nargs="*", help="the types to make or check (default: all; "
                        "with --check also the ROUTED directories)")
    args = parser.parse_args()
    if args.check:
        sys.exit(1 if check(args.check, args.types or [*CONFIGS, MXFP4, FP8, LLAMA3, VL, *ROUTED])
                 else 0)
    for name in args.types or [*CONFIGS, MXFP4, FP8, LLAMA3, VL]:
        make(name)
