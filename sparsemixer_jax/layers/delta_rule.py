"""The gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025) as pure
functions, and the short causal convolution in front of it
(:class:`~sparsemixer_jax.layers.gated_deltanet.GatedDeltaNet` is the layer around them).

Per head, with a state ``S`` of shape ``[Dk, Dv]`` that starts at zero (or at a cache's state),
each token ``t`` with query ``q_t``, key ``k_t``, value ``v_t``, log decay ``g_t <= 0`` and
write strength ``beta_t`` in ``(0, 1)`` does::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

Three forms compute it, equal up to float rounding:

- :func:`chunk_gated_delta_rule`, the chunked parallel form for training and prefill: within a
  chunk of ``C`` tokens the updates are solved at once in the paper's WY / UT form (a unit lower
  triangular solve of ``C x C``), and a scan carries the state from chunk to chunk; its work is
  matmuls of ``C``-long blocks instead of ``T`` rank-one updates.
- :func:`recurrent_gated_delta_rule`, token by token (:func:`gated_delta_step` per token), for
  decoding one token at a time against a cached state.
- :func:`scan_gated_delta_rule`, the equation above written out with the ``Dk x Dk`` transition
  matrix, a ``lax.scan`` over tokens: the tests' oracle, not meant for speed.

All three take ``q, k`` of shape ``[B, T, H, Dk]``, ``v`` ``[B, T, H, Dv]`` and ``g, beta``
``[B, T, H]`` (queries and keys already L2-normed, queries already scaled), an optional
``initial_state`` ``[B, H, Dk, Dv]`` and an optional ``reset`` bool ``[B, T]``: True where a new
document starts, so the state is cleared before that token (packed documents). They compute in
float32 and return ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv])``, both float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_resets(segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, T]``: True where a token's segment id differs from the previous token's (a
    new packed document starts there; never at position 0, whose state is the caller's)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((segment_ids.shape[0], 1), bool), change], axis=1)


def _documents(reset: jax.Array | None, batch: int, length: int) -> jax.Array:
    """int32 ``[B, T]``: how many documents started up to each token; two tokens share a
    document exactly when these counts are equal, and a token continues the state handed in
    exactly when its count is 0."""
    if reset is None:
        return jnp.zeros((batch, length), jnp.int32)
    return jnp.cumsum(reset.astype(jnp.int32), axis=1)


def _float32(*arrays: jax.Array) -> list[jax.Array]:
    return [a.astype(jnp.float32) for a in arrays]


def _zero_state(k: jax.Array, v: jax.Array) -> jax.Array:
    batch, _, heads, dk = k.shape
    return jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32)


# ----------------------------------------------------------------------- the causal convolution


def causal_conv1d(x: jax.Array, weight: jax.Array, state: jax.Array | None = None,
                  reset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution of ``x`` ``[B, T, C]`` with ``weight`` ``[C, K]``.

    Output ``y[t, c] = sum_j weight[c, j] * x[t - (K - 1) + j, c]`` (tap ``K - 1`` reads the token
    itself, as ``torch.nn.Conv1d`` with left padding ``K - 1`` does); before position 0 it reads
    ``state`` ``[B, K - 1, C]`` (the last inputs of an earlier call, oldest first; zeros: none).
    A tap never reads across a document boundary (``reset`` as in the module docstring): it
    reads zero there, as if the document had started the sequence.

    Returns ``(y [B, T, C]`` in ``x``'s dtype, the new state ``[B, K - 1, C])``: the last
    ``K - 1`` inputs, with those of documents other than the last one zeroed, so decoding from
    it continues the last document alone.
    """
    batch, length, channels = x.shape
    taps = weight.shape[1]
    if state is None:
        state = jnp.zeros((batch, taps - 1, channels), x.dtype)
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)          # [B, K-1+T, C]
    # The state's inputs belong to document 0, the one the call continues.
    docs = jnp.concatenate([jnp.zeros((batch, taps - 1), jnp.int32),
                            _documents(reset, batch, length)], axis=1)
    y = jnp.zeros((batch, length, channels), jnp.float32)
    for j in range(taps):
        same = (docs[:, j:j + length] == docs[:, taps - 1:])[..., None]
        tap = padded[:, j:j + length].astype(jnp.float32) * weight[:, j].astype(jnp.float32)
        y = y + jnp.where(same, tap, 0.0)
    tail = padded[:, length:]
    new_state = jnp.where((docs[:, length:] == docs[:, -1:])[..., None], tail, 0)
    return y.astype(x.dtype), new_state


# ----------------------------------------------------------------------------- token by token


def gated_delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                     beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the rule: ``state`` ``[B, H, Dk, Dv]``, ``q, k`` ``[B, H, Dk]``, ``v``
    ``[B, H, Dv]``, ``g, beta`` ``[B, H]``; returns ``(o [B, H, Dv], new state)``, float32."""
    state = state * jnp.exp(g)[..., None, None]
    # The delta rule writes the error of what the decayed state already recalls for k.
    recalled = jnp.einsum("bhk,bhkv->bhv", k, state)
    delta = beta[..., None] * (v - recalled)
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, state), state


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, initial_state: jax.Array | None = None,
                               reset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The rule token by token (:func:`gated_delta_step` under a scan): the decoding form.
    Shapes as in the module docstring."""
    q, k, v, g, beta = _float32(q, k, v, g, beta)
    state = _zero_state(k, v) if initial_state is None else initial_state.astype(jnp.float32)
    if reset is None:
        reset = jnp.zeros(g.shape[:2], bool)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, reset_t = token
        state = jnp.where(reset_t[:, None, None, None], 0.0, state)
        o_t, state = gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t)
        return state, o_t

    tokens = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, reset)]
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state


def scan_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                          beta: jax.Array, initial_state: jax.Array | None = None,
                          reset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The oracle: the rule as written in the module docstring, the transition matrix
    ``exp(g) (I - beta k k^T)`` formed in full for each token. Shapes as in the module
    docstring."""
    q, k, v, g, beta = _float32(q, k, v, g, beta)
    state = _zero_state(k, v) if initial_state is None else initial_state.astype(jnp.float32)
    if reset is None:
        reset = jnp.zeros(g.shape[:2], bool)
    eye = jnp.eye(k.shape[-1], dtype=jnp.float32)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, reset_t = token
        state = state * (1.0 - reset_t.astype(jnp.float32))[:, None, None, None]
        outer = k_t[..., :, None] * k_t[..., None, :]                     # [B, H, Dk, Dk]
        transition = jnp.exp(g_t)[..., None, None] * (eye - beta_t[..., None, None] * outer)
        write = beta_t[..., None, None] * k_t[..., :, None] * v_t[..., None, :]
        state = jnp.einsum("bhij,bhjv->bhiv", transition, state) + write
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    tokens = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, reset)]
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state


# ------------------------------------------------------------------------------- chunk by chunk


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[B, T, H, ...]`` (``T`` a multiple of ``chunk``) as ``[B, H, N, chunk, ...]``."""
    batch, length, heads = x.shape[:3]
    x = x.reshape(batch, length // chunk, chunk, heads, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                           beta: jax.Array, initial_state: jax.Array | None = None,
                           reset: jax.Array | None = None, chunk_size: int = 64
                           ) -> tuple[jax.Array, jax.Array]:
    """The rule in chunks of ``chunk_size`` tokens (the training and prefill form). Shapes as
    in the module docstring; ``T`` need not be a multiple of ``chunk_size``.

    Within a chunk, with ``G_t`` the cumulative log decay from the chunk's start and ``S0`` the
    state entering it, the state after token ``t`` is ``exp(G_t) S0 + sum_{j<=t}
    exp(G_t - G_j) k_j u_j^T`` for pseudo-values ``u_j`` that solve a unit lower triangular
    system ``(I + A) u = beta v - beta exp(G) k S0`` with ``A[t, j] = beta_t exp(G_t - G_j)
    k_t . k_j`` (``j < t``): the WY / UT form. The solve does not depend on ``S0``, so it runs
    for all chunks at once; only ``u``, the outputs and the state's hand-over run in the scan
    over chunks. A document boundary inside a chunk cuts every ``exp(G_t - G_j)`` across it and
    every ``S0`` term after it.
    """
    q, k, v, g, beta = _float32(q, k, v, g, beta)
    batch, length, heads, _ = k.shape
    state = _zero_state(k, v) if initial_state is None else initial_state.astype(jnp.float32)
    docs = _documents(reset, batch, length)
    # A partial last chunk is filled with tokens that write nothing (beta = 0, k = 0) and do not
    # decay (g = 0) nor start a document, so the final state is the last real token's.
    pad = -length % chunk_size
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
                            for a in (q, k, v, g, beta))
        docs = jnp.pad(docs, [(0, 0), (0, pad)], mode="edge")
    qc, kc, vc, gc, bc = (_chunks(a, chunk_size) for a in (q, k, v, g, beta))
    num_chunks = qc.shape[2]
    docs_c = docs.reshape(batch, 1, num_chunks, chunk_size)               # [B, 1, N, C]
    docs_before = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), docs[:, :-1]], axis=1)
    docs_before = docs_before.reshape(batch, 1, num_chunks, chunk_size)[..., :1]  # [B,1,N,1]

    cum = jnp.cumsum(gc, axis=-1)                                         # G_t: [B, H, N, C]
    same_doc = docs_c[..., :, None] == docs_c[..., None, :]               # [B, 1, N, C, C]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    # exp(G_t - G_j) for j <= t in one document, else 0; masked before exp so that the upper
    # triangle's positive exponents never overflow (an inf times 0 would be NaN).
    visible = same_doc & causal
    decay = jnp.exp(jnp.where(visible, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    carry = (docs_c == docs_before).astype(jnp.float32)                   # t still sees S0
    start_decay = jnp.exp(cum) * carry                                    # exp(G_t), cut

    kk = jnp.einsum("bhntk,bhnjk->bhntj", kc, kc)
    strict = decay * (1.0 - jnp.eye(chunk_size, dtype=jnp.float32))
    a_matrix = bc[..., None] * kk * strict
    # One solve for both right-hand sides: u = u_values - w @ S0.
    rhs = jnp.concatenate([bc[..., None] * vc, (bc * start_decay)[..., None] * kc], axis=-1)
    solved = jax.lax.linalg.triangular_solve(a_matrix, rhs, left_side=True, lower=True,
                                             unit_diagonal=True)
    dv = vc.shape[-1]
    u_values, w = solved[..., :dv], solved[..., dv:]

    scores = jnp.einsum("bhntk,bhnjk->bhntj", qc, kc) * decay              # intra-chunk
    q_start = qc * start_decay[..., None]
    # Each token's decay to the chunk's end, cut where the chunk's last document started.
    to_end = jnp.exp(cum[..., -1:] - cum) * (docs_c == docs_c[..., -1:])
    k_end = kc * to_end[..., None]
    end_decay = start_decay[..., -1]                                      # [B, H, N]

    def chunk_step(state, xs):
        u_n, w_n, scores_n, q_n, k_n, end_n = xs
        u = u_n - jnp.einsum("bhtk,bhkv->bhtv", w_n, state)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_n, state) + jnp.einsum("bhtj,bhjv->bhtv", scores_n, u)
        state = end_n[..., None, None] * state + jnp.einsum("bhtk,bhtv->bhkv", k_n, u)
        return state, o

    xs = [jnp.moveaxis(a, 2, 0) for a in (u_values, w, scores, q_start, k_end, end_decay)]
    state, o = jax.lax.scan(chunk_step, state, xs)                        # o: [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(batch, heads, num_chunks * chunk_size, dv)
    return jnp.moveaxis(o, 1, 2)[:, :length], state
