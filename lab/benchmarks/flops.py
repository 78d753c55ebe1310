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


def unchosen_flops_per_token(router: str, emb: int, mlp: int, num_experts: int,
                             gated: bool = False) -> dict[str, float]:
    """Extra model FLOPs per token and MoE layer of one training step (forward + backward) that
    ``router`` adds to Switch's top-1 layer: what DenseMixer and Default MoE
    (``routers.UNCHOSEN_EXPERT_RULES``) compute for the experts a token did not choose.

    * ``dense_pass``: DenseMixer's pass of every token through all ``N`` experts,
      ``N * 4 e m`` (two matmuls per expert; ``gated`` SwiGLU experts three, ``N * 6 e m``),
      forward only: no gradient flows into it, so it has
      no backward (``moe.unchosen.all_expert_outputs``). Zero for the other routers.
    * ``unchosen_term``: the contraction ``sum_j c_j pi_j v_j`` of ``routers.unchosen_expert_term``
      (``[N] x [N, e]`` per token), ``2 N e`` forward and ``2 N e`` backward (the gradient of the
      coefficients only; ``v`` is held constant). DenseMixer and Default MoE alike.
    * ``total``: their sum.

    Left out, as LayerNorm and softmax are: the coefficients' elementwise products and Default
    MoE's EMA update of its default vectors (a segment sum of the routed outputs, about ``e``
    additions per token). Every other router (Switch, SparseMixer and its variants: the same
    matmuls as Switch) adds nothing.
    """
    from sparsemixer_jax import routers

    rule = routers.UNCHOSEN_EXPERT_RULES.get(router)
    if router not in routers.ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {sorted(routers.ROUTERS)}")
    e, m, n = emb, mlp, num_experts
    matmuls = 3 if gated else 2
    outputs = rule is not None and rule.values == "outputs"
    dense_pass = float(n * 2 * matmuls * e * m) if outputs else 0.0
    term = float(4 * n * e) if rule is not None else 0.0
    return {"dense_pass": dense_pass, "unchosen_term": term, "total": dense_pass + term}


def moe_layer_flops_per_token(emb: int, mlp: int, num_experts: int, router: str = "switch"
                              ) -> float:
    """Model FLOPs per token of one top-1 MoE layer's forward + backward (gradients of the
    parameters and the input, as ``benchmarks.layers.layer_step`` takes them): ``3 x`` the
    forward's router ``2 e N`` and expert ``4 e m``, plus :func:`unchosen_flops_per_token`."""
    e, m, n = emb, mlp, num_experts
    return 3.0 * (2 * e * n + 4 * e * m) + unchosen_flops_per_token(router, e, m, n)["total"]


def model_flops_per_step(sizes: dict[str, int], num_experts: int,
                         router: str = "switch") -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward matmul FLOPs).

    Per token and layer, forward: attention projections ``8 e^2`` (q, k, v, out), scores and
    weighted sum ``4 L e``; feed-forward ``4 e m`` (top-1 MoE: one expert, same FLOPs, plus the
    router ``2 e N``). The decoder adds cross-attention (``4 e^2`` for q/out per target token,
    ``4 e^2`` for k/v per source token, ``4 L e`` scores) and the output projection ``2 e V``.
    Causal self-attention is counted in full (it is computed in full). Embedding gathers,
    LayerNorm, softmax and dispatch are not counted (MFU convention: model FLOPs, not hardware
    FLOPs). ``router``: what it adds per token in every MoE layer of encoder and decoder
    (:func:`unchosen_flops_per_token`: DenseMixer's forward-only dense pass, the unchosen-expert
    term of DenseMixer and Default MoE), not multiplied by 3.
    """
    e, m, n_layers, v = sizes["emb"], sizes["mlp"], sizes["layers"], sizes["vocab"]
    length = sizes["length"]
    tokens = max(1, sizes["tokens"] // length) * length  # per side
    moe_layers = (n_layers + 1) // 2 if num_experts else 0  # moe_every = 2: layers 0, 2, ...
    router_matmul = 2 * e * num_experts * moe_layers
    ffn = 4 * e * m
    encoder = n_layers * (8 * e * e + 4 * length * e + ffn) + router_matmul
    decoder = (n_layers * (8 * e * e + 4 * length * e + ffn + 4 * e * e + 4 * length * e)
               + router_matmul)
    cross_kv = n_layers * 4 * e * e  # per source token
    forward = tokens * (encoder + cross_kv + decoder + 2 * e * v)
    extra = unchosen_flops_per_token(router, e, m, num_experts)["total"] if num_experts else 0.0
    return 3.0 * forward + tokens * 2 * moe_layers * extra  # 2: encoder and decoder


def lm_flops_per_token(lm, seq_len: int) -> dict[str, float]:
    """Model FLOPs per token of one training step of the decoder-only language model
    (``lm``: a :class:`sparsemixer_jax.models.lm_config.LMConfig`) on rows of ``seq_len``
    tokens, by part: forward + backward = ``3 x`` the forward's matmul FLOPs.

    Per layer and token, forward, with ``e`` the hidden size, ``H`` query heads and ``K``
    key/value heads of width ``d``:

    * ``attention_proj``: q ``2 e H d``, k and v ``2 x 2 e K d`` (grouped-query attention: ``K``
      heads), out ``2 H d e``.
    * ``attention_scores``: scores and weighted sum, ``2 x 2 L H d`` over ``L = seq_len`` keys
      (causal attention is computed in full, so counted in full).
    * ``ffn``: SwiGLU (gate, up, down: ``6 e m``); a routed layer runs ``top_k`` experts of width
      ``moe_intermediate_size`` (and a shared expert and its gate where there is one), a dense
      layer one MLP of width ``intermediate_size``.
    * ``router``: ``2 e N`` in each routed layer.
    * ``lm_head``: ``2 e V`` once per token (tied or not).
    * ``unchosen``: what the router adds (:func:`unchosen_flops_per_token`, gated experts;
      already a training count, not multiplied by 3): DenseMixer's forward-only pass of every
      token through all ``N`` experts and the unchosen-expert term.

    Left out (model FLOPs, not hardware FLOPs): the embedding gather, norms, rotary positions,
    softmax, the loss and dispatch. Returns float FLOPs per token for each part (already
    ``x 3``) and their ``total``.
    """
    e, h, kv, d = lm.hidden_size, lm.num_heads, lm.num_kv_heads, lm.head_dim
    routed = sum(lm.moe_layers)
    dense = lm.num_layers - routed
    expert = 6 * e * lm.moe_intermediate_size
    shared = (6 * e * lm.shared_expert_size + 2 * e) if lm.shared_expert_size else 0
    forward = {
        "attention_proj": lm.num_layers * (2 * e * h * d + 4 * e * kv * d + 2 * h * d * e),
        "attention_scores": lm.num_layers * 4 * seq_len * h * d,
        "ffn": routed * (lm.top_k * expert + shared) + dense * 6 * e * lm.intermediate_size,
        "router": routed * 2 * e * lm.num_experts,
        "lm_head": 2 * e * lm.vocab_size,
    }
    out = {k: 3.0 * v for k, v in forward.items()}
    out["unchosen"] = routed * unchosen_flops_per_token(
        lm.router, e, lm.moe_intermediate_size, lm.num_experts, gated=True)["total"] \
        if routed else 0.0
    out["total"] = sum(out.values())
    return out


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
    from sparsemixer_jax.models.electra import generator_config, num_predictions
    from sparsemixer_jax.models.encoder import EncoderConfig

    data = TextDataConfig.of(config)
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
    gen, gen_attention, gen_extra = encoder(generator_config(config))
    predicted = num_predictions(length, data.mask_prob) / length
    heads = (2 * e * e + 2 * e) + predicted * (2 * e * e + 2 * e * vocab)
    out = {"discriminator": 3.0 * disc + disc_extra, "generator": 3.0 * gen + gen_extra,
           "heads": 3.0 * heads, "attention": 3.0 * (disc_attention + gen_attention)}
    out["total"] = out["discriminator"] + out["generator"] + out["heads"]
    return out
