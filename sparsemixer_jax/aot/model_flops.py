"""Model FLOPs of a training step: the matmul FLOPs the model needs, the numerator of MFU.

Forward + backward = ``3 x`` the forward's matmul FLOPs; embedding gathers, norms, softmax, the
loss and dispatch are left out (model FLOPs, not hardware FLOPs: what a compiled program
actually executes is the roofline's count, :mod:`sparsemixer_jax.aot.roofline`).
"""

from __future__ import annotations


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
      heads), out ``2 H d e``. Latent attention (``kv_lora_rank`` ``c``, ``q_lora_rank``
      ``q``, rotated width ``r``, value width ``v``): queries ``2 e q + 2 q H d`` (or ``2 e H d``),
      ``2 e (c + r)`` to the latent, ``2 c H (d - r + v)`` from it, out ``2 H v e``. Gated
      attention's gate (``attention_output_gate``) another ``2 e H d``. A Gated DeltaNet layer
      (the hybrids' ``linear_layers``): its input projections to queries and keys (``2 x 2 e
      Kk dk``), values and output gates (``2 x 2 e Kv dv``) and ``b``, ``a`` (``2 x 2 e Kv``),
      out ``2 Kv dv e``, and its depthwise convolution ``2 (2 Kk dk + Kv dv)`` per tap.
    * ``attention_scores``: scores and weighted sum, ``2 H d + 2 H v`` per key a query sees
      (``v = d`` but for latent attention): causal
      attention's lower triangle, ``(L + 1) / 2`` keys on average over ``L = seq_len``
      positions, whatever the kernel computes (an einsum computes the full square, a flash
      kernel skips the masked blocks: neither changes the model's FLOPs). A Gated DeltaNet
      layer's delta rule instead: ``6 dk dv`` per value head (reading the state with the key,
      writing the update, reading it with the query), whichever form computes it.
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
    e, h, kv, d = lm.arch.hidden_size, lm.arch.num_heads, lm.arch.num_kv_heads, lm.arch.head_dim
    v = lm.arch.v_head_dim if lm.arch.kv_lora_rank else d
    attention = 2 * e * h * d + 4 * e * kv * d + 2 * h * d * e
    if lm.arch.kv_lora_rank:
        c, q, r = lm.arch.kv_lora_rank, lm.arch.q_lora_rank, lm.arch.qk_rope_head_dim
        queries = 2 * e * q + 2 * q * h * d if q else 2 * e * h * d
        attention = queries + 2 * e * (c + r) + 2 * c * h * (d - r + v) + 2 * h * v * e
    if lm.arch.attention_output_gate:
        attention += 2 * e * h * d
    scores = 2 * (seq_len + 1) / 2 * h * (d + v)
    linear = sum(lm.arch.linear_layers)
    mixer = state = 0
    if linear:
        a = lm.arch
        keys = a.linear_num_key_heads * a.linear_key_head_dim
        values = a.linear_num_value_heads * a.linear_value_head_dim
        mixer = 2 * e * (2 * keys + 2 * values + 2 * a.linear_num_value_heads) + \
            2 * values * e + 2 * (2 * keys + values) * a.linear_conv_kernel_dim
        state = 6 * a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim
    full = lm.arch.num_layers - linear
    routed = sum(lm.arch.moe_layers)
    dense = lm.arch.num_layers - routed
    expert = 6 * e * lm.arch.moe_intermediate_size
    shared = (6 * e * lm.shared_expert_size + 2 * e) if lm.shared_expert_size else 0
    forward = {
        "attention_proj": full * attention + linear * mixer,
        "attention_scores": full * scores + linear * state,
        "ffn": routed * (lm.top_k * expert + shared) + dense * 6 * e * lm.arch.intermediate_size,
        "router": routed * 2 * e * lm.num_experts,
        "lm_head": 2 * e * lm.arch.vocab_size,
    }
    out = {k: 3.0 * v for k, v in forward.items()}
    out["unchosen"] = routed * unchosen_flops_per_token(
        lm.router, e, lm.arch.moe_intermediate_size, lm.num_experts, gated=True)["total"] \
        if routed else 0.0
    out["total"] = sum(out.values())
    return out
