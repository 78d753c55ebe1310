"""The model-FLOP count of a training step and the device peaks for model FLOPs utilisation."""

from __future__ import annotations

# Per-device peak dense matmul throughput in FLOP/s (vendor datasheets, dense, no sparsity),
# by dtype, for the MFU figure. float32 on NVIDIA runs as TF32 under JAX's default precision.
PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "float32": 494.5e12},  # SXM; PCIe is lower (756 / 378)
    "H200": {"bfloat16": 989e12, "float32": 494.5e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
}


def model_flops_per_step(sizes: dict[str, int], num_experts: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward matmul FLOPs).

    Per token and layer, forward: attention projections ``8 e^2`` (q, k, v, out), scores and
    weighted sum ``4 L e``; feed-forward ``4 e m`` (top-1 MoE: one expert, same FLOPs, plus the
    router ``2 e N``). The decoder adds cross-attention (``4 e^2`` for q/out per target token,
    ``4 e^2`` for k/v per source token, ``4 L e`` scores) and the output projection ``2 e V``.
    Causal self-attention is counted in full (it is computed in full). Embedding gathers,
    LayerNorm, softmax and dispatch are not counted (MFU convention: model FLOPs, not hardware
    FLOPs).
    """
    e, m, n_layers, v = sizes["emb"], sizes["mlp"], sizes["layers"], sizes["vocab"]
    length = sizes["length"]
    tokens = max(1, sizes["tokens"] // length) * length  # per side
    moe_layers = (n_layers + 1) // 2 if num_experts else 0  # moe_every = 2: layers 0, 2, ...
    router = 2 * e * num_experts * moe_layers
    ffn = 4 * e * m
    encoder = n_layers * (8 * e * e + 4 * length * e + ffn) + router
    decoder = n_layers * (8 * e * e + 4 * length * e + ffn + 4 * e * e + 4 * length * e) + router
    cross_kv = n_layers * 4 * e * e  # per source token
    forward = tokens * (encoder + cross_kv + decoder + 2 * e * v)
    return 3.0 * forward


def device_peak(dtype: str) -> tuple[str, float | None]:
    import jax

    kind = jax.devices()[0].device_kind
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return kind, peaks[dtype]
    return kind, None
