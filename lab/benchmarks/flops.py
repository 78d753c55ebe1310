"""The model-FLOP count of a training step and the device peaks for model FLOPs utilisation."""

from __future__ import annotations

# The formulas of the project's models live in the library (the compile command's roofline
# reports MFU with them); the benchmarks time against them.
from sparsemixer_jax.aot.model_flops import (  # noqa: F401
    lm_flops_per_token,
    model_flops_per_step,
    unchosen_flops_per_token,
)

# Per-device peak dense matmul throughput in FLOP/s (vendor datasheets, dense, no sparsity),
# by dtype, for the MFU figure. float32 on NVIDIA runs as TF32 under JAX's default precision.
PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "float32": 494.5e12},  # SXM; PCIe is lower (756 / 378)
    "H200": {"bfloat16": 989e12, "float32": 494.5e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
}


def moe_layer_flops_per_token(emb: int, mlp: int, num_experts: int, router: str = "switch"
                              ) -> float:
    """Model FLOPs per token of one top-1 MoE layer's forward + backward (gradients of the
    parameters and the input, as ``benchmarks.layers.layer_step`` takes them): ``3 x`` the
    forward's router ``2 e N`` and expert ``4 e m``, plus :func:`unchosen_flops_per_token`."""
    e, m, n = emb, mlp, num_experts
    return 3.0 * (2 * e * n + 4 * e * m) + unchosen_flops_per_token(router, e, m, n)["total"]


def device_peak(dtype: str) -> tuple[str, float | None]:
    import jax

    kind = jax.devices()[0].device_kind
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return kind, peaks[dtype]
    return kind, None


def electra_flops_per_token(config) -> dict[str, float]:
    """Model FLOPs per packed token of one ELECTRA pretraining update (forward + backward =
    3 x forward), by part, for ``config`` (schema: ``configs/electra.py``).

    The count is ``6 x`` the matmul parameters a token passes through, plus attention's scores
    and weighted sum, as :func:`model_flops_per_step`: per encoder layer and token, forward
    ``8 e^2`` (q, k, v, out), ``4 L e`` (scores and weighted sum over ``L`` keys), ``4 e m``
    (the FFN; a top-1 MoE layer runs one expert, the same, plus the router ``2 e N``). The
    discriminator head is ``2 e^2 + 2 e`` per token; the generator head (``2 e^2`` dense plus the
    tied ``2 e V`` output projection) runs on the ``ceil(mask_prob L)`` predicted positions only,
    so it counts ``P / L`` of that per token. A DenseMixer or Default MoE router adds
    :func:`unchosen_flops_per_token` in every MoE layer of both encoders (already a training
    count: DenseMixer's dense pass has no backward). Embedding gathers, LayerNorm, softmax,
    sampling and dispatch are left out (model FLOPs, not hardware FLOPs). Sequences are counted
    as full (packing fills over 98% of the positions).

    Returns float FLOPs per token: ``discriminator``, ``generator``, ``heads``, ``attention`` (the
    ``4 L e`` part of both encoders, included in theirs) and ``total``.
    """
    from sparsemixer_jax.data.text import TextDataConfig
    from sparsemixer_jax.models.electra import GeneratorConfig, num_predictions
    from sparsemixer_jax.models.encoder import EncoderConfig

    data = TextDataConfig.from_config(config)
    discriminator = EncoderConfig.from_config(config.model)
    e, length, vocab = discriminator.emb_dim, data.seq_len, data.vocab_size

    def encoder(model: EncoderConfig) -> tuple[float, float, float]:
        """Forward FLOPs, attention's share of them, and the router's extra training FLOPs."""
        layers, m, n = model.num_layers, model.mlp_dim, model.moe.num_experts
        moe_layers = len(range(0, layers, model.moe.moe_every)) if n else 0
        attention = layers * 4 * length * e
        extra = moe_layers * unchosen_flops_per_token(config.router.name, e, m, n)["total"] \
            if n else 0.0
        return (layers * (8 * e * e + 4 * e * m) + attention + moe_layers * 2 * e * n,
                attention, extra)

    disc, disc_attention, disc_extra = encoder(discriminator)
    gen, gen_attention, gen_extra = encoder(
        GeneratorConfig.from_config(config.generator).encoder(discriminator))
    predicted = num_predictions(length, data.mask_prob) / length
    heads = (2 * e * e + 2 * e) + predicted * (2 * e * e + 2 * e * vocab)
    out = {"discriminator": 3.0 * disc + disc_extra, "generator": 3.0 * gen + gen_extra,
           "heads": 3.0 * heads, "attention": 3.0 * (disc_attention + gen_attention)}
    out["total"] = out["discriminator"] + out["generator"] + out["heads"]
    return out
