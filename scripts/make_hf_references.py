"""Reference files for tests/test_hf.py: tiny random transformers models and their outputs.

Run under any Python with torch and transformers (not the project's environment; CI has no
torch). The committed files were made with torch 2.13.0 (CPU) and transformers 5.23.0:

    python3.11 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors
    /tmp/torchenv/bin/python scripts/make_hf_references.py            # writes tests/data/hf/

For each type it builds a tiny model with non-default settings (grouped-query attention, an odd
vocabulary, head_dim apart from hidden / heads where the type allows it, dense layers mixed in,
3 or more experts per token where the type allows it, biases, Phi-3.5-MoE's jitter and longrope
settings, GLM-4.5's groups, selection bias, shared experts and partial rotary), redraws every
norm weight away from 1 and every bias away from 0, GLM's selection bias
(``e_score_correction_bias``) included (transformers initialises them to 1 and 0, so a loader
that dropped them would still pass), and saves into
``tests/data/hf/<type>/``: the model (``save_pretrained``: config.json + model.safetensors) and
``reference.npz`` with ``input_ids [2, 12]``, transformers' float32 ``logits [2, 12, V]``, and
greedy ``generate`` from the first 5 tokens for 8 new tokens (``generated [2, 13]``).

The round trip back into transformers (run by hand; the saved directories come from the
project's environment):

    python scripts/hf_roundtrip_save.py /tmp/hf_saved                  # project venv, JAX
    /tmp/torchenv/bin/python scripts/make_hf_references.py --check /tmp/hf_saved

``--check`` loads each ``/tmp/hf_saved/<type>`` with ``AutoModelForCausalLM.from_pretrained``
and compares its logits with the reference (1e-4 of the largest magnitude).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

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
}
# Each type's torch seed: the first five as the committed files were made (sorted order), new
# types after them, so that adding a type leaves the others' files as they are.
SEEDS = {t: i for i, t in enumerate(("mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
                                     "glm4_moe"))}
PROMPT, NEW = 5, 8


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(SEEDS[model_type])
    config = AutoConfig.for_model(model_type, **COMMON, **CONFIGS[model_type])
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "norm" in name:  # every norm weight: input, post-attention, final, q/k
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # the selection bias, zeros as initialised
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    return model


def make(model_type: str) -> None:
    model = build(model_type)
    directory = os.path.join(OUT, model_type)
    model.save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
        generated = model.generate(input_ids[:, :PROMPT], max_new_tokens=NEW, do_sample=False,
                                   min_new_tokens=NEW, pad_token_id=0).numpy()
    np.savez_compressed(os.path.join(directory, "reference.npz"), input_ids=input_ids.numpy(),
                        logits=logits, generated=generated)
    print(f"{model_type}: {sum(p.numel() for p in model.parameters())} params -> {directory}")


def check(root: str) -> int:
    failures = 0
    for model_type in CONFIGS:
        directory = os.path.join(root, model_type)
        if not os.path.isdir(directory):
            print(f"{model_type}: no {directory}")
            failures += 1
            continue
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
        model = model.float().eval()
        ref = np.load(os.path.join(OUT, model_type, "reference.npz"))
        with torch.no_grad():
            logits = model(torch.as_tensor(ref["input_ids"])).logits.numpy()
        err = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
        ok = err <= 1e-4
        failures += not ok
        print(f"{model_type}: transformers loads {directory}; logits max error {err:.2e} of the "
              f"largest ({'ok' if ok else 'FAIL'})")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", metavar="DIR", help="compare transformers' logits of the "
                        "directories DIR/<type> with the references")
    parser.add_argument("--types", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    if args.check:
        sys.exit(1 if check(args.check) else 0)
    for name in args.types:
        make(name)
