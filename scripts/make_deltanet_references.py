"""Reference files for tests/test_gated_deltanet.py: transformers' Gated DeltaNet layers at tiny
sizes with random weights, run on a fixed input.

Run under any Python with torch and transformers (not the project's environment; CI has no
torch). The committed files were made with torch 2.13.0 (CPU) and transformers 5.23.0:

    python3.11 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.23.0
    /tmp/torchenv/bin/python scripts/make_deltanet_references.py     # writes tests/data/deltanet/

Two layers, one per projection layout: Qwen3-Next's ``Qwen3NextGatedDeltaNet`` (fused
``in_proj_qkvz`` / ``in_proj_ba``) and Qwen3.5-MoE's ``Qwen3_5MoeGatedDeltaNet`` (separate
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Both with 2 key heads and 4 value
heads (so each key head serves two value heads), key head 8 and value head 6 wide, hidden 16,
4 convolution taps; 70 tokens, so the torch fallback's chunked form (chunks of 64) ends in a
partial chunk. Without the flash-linear-attention and causal-conv1d packages, transformers runs
its torch fallbacks (``torch_chunk_gated_delta_rule``, ``F.conv1d``). Every parameter is
redrawn: the projections and the convolution normal, ``A_log`` and ``dt_bias`` spread, the
gated norm's weight away from 1, so a loader or layer that dropped one would not pass.

Each ``<layout>.npz`` holds the parameters under transformers' names (``conv1d.weight`` as
``[conv_dim, 1, K]``, linear weights as ``[out, in]``), ``x [2, 70, 16]`` and the layer's float32
output ``y [2, 70, 16]``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "deltanet")
SIZES = dict(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
             hidden_act="silu", rms_norm_eps=1e-6, num_hidden_layers=1,
             layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1,
             vocab_size=32)
BATCH, LENGTH = 2, 70


def _redraw(layer: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter drawn afresh, at scales where each one moves the output."""
    for name, param in layer.named_parameters():
        shape = param.shape
        if name == "A_log":
            value = torch.log(torch.rand(shape, generator=generator) * 2.0 + 0.05)
        elif name == "dt_bias":
            value = torch.randn(shape, generator=generator) * 0.5
        elif name == "norm.weight":
            value = 1.0 + 0.3 * torch.randn(shape, generator=generator)
        elif name == "conv1d.weight":
            value = 0.5 * torch.randn(shape, generator=generator)
        else:  # projections: unit-variance outputs for unit-variance inputs
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        with torch.no_grad():
            param.copy_(value)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    layers = {"fused": (Qwen3NextGatedDeltaNet, Qwen3NextConfig),
              "separate": (Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeTextConfig)}
    for seed, (layout, (layer_type, config_type)) in enumerate(layers.items()):
        generator = torch.Generator().manual_seed(seed)
        layer = layer_type(config_type(**SIZES), layer_idx=0).eval()
        _redraw(layer, generator)
        x = torch.randn(BATCH, LENGTH, SIZES["hidden_size"], generator=generator)
        with torch.no_grad():
            y = layer(x)
        arrays = {name: p.detach().numpy() for name, p in layer.named_parameters()}
        path = os.path.join(OUT, f"{layout}.npz")
        np.savez_compressed(path, x=x.numpy(), y=y.numpy(), **arrays)
        print(f"{path}: {sorted(arrays)}, |y| max {y.abs().max():.3f}")


if __name__ == "__main__":
    main()
