"""Batched, jittable beam search and greedy decoding over the cached Transformer decoder.

The search functions are model-agnostic: they take ``tokens_to_logits(tokens [B'], cache) ->
(logits [B', V], cache)`` and an initial cache (any pytree whose non-scalar leaves have the
flattened batch(*beam) axis first), and run under ``jax.lax.while_loop``.
:func:`beam_search_model` and :func:`greedy_search_model` wire them to a
:class:`sparsemixer_jax.models.encoder_decoder.Transformer` and jit the whole search.

Search semantics (fairseq-style, with the GNMT length penalty that flax ``examples/wmt`` uses):

* every sequence starts from the start token ``PAD_ID`` (0); ``PAD_ID`` is never generated;
* a hypothesis is scored ``sum(log p) / ((5 + len) / 6) ** alpha`` with ``len`` counting EOS;
* each step expands the ``K`` live beams into their ``2K`` best continuations; an EOS
  continuation is *finished* only if it ranks among the best ``K`` of those (so ``K = 1`` is
  exactly greedy decoding), and the best ``K`` non-EOS continuations stay live;
* a sentence is done once it holds ``K`` finished hypotheses; at its length limit only EOS may
  be generated, so every returned hypothesis ends with EOS followed by ``PAD_ID`` padding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.models.encoder_decoder import Transformer
from sparsemixer_jax.section import check_positive, read_fields
from sparsemixer_jax.token_ids import PAD_ID


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """``config.decode``: beam search on the test split at the end of a translation run."""

    beam_size: int = 4
    length_penalty: float = 0.6  # alpha of the GNMT length penalty
    max_extra_len: int = 50  # target positions beyond the source length
    test_bleu: bool = True  # decode the test split and report BLEU when training ends

    @classmethod
    def from_config(cls, section: Any, where: str = "config.decode.") -> DecodeConfig:
        decode = cls(**read_fields(cls, section, where))
        check_positive(where, beam_size=decode.beam_size)
        if decode.max_extra_len < 0:
            raise ValueError(f"{where}max_extra_len must be >= 0, got {decode.max_extra_len}")
        return decode

# Finite "minus infinity" for scores: keeps arithmetic NaN-free; anything below NEG_INF / 2 is
# treated as an impossible hypothesis.
NEG_INF = -1.0e9

TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (Wu et al., 2016), float32."""
    return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def sequence_limits(inputs: jax.Array, max_extra_len: int, max_len: int) -> jax.Array:
    """Per-sentence output budget ``min(source_len + max_extra_len, max_len)``: int32 ``[B]``.

    ``source_len`` counts non-padding tokens of ``inputs [B, S]``; the budget includes EOS and is
    at least 1.
    """
    src_len = jnp.sum(inputs != PAD_ID, axis=1).astype(jnp.int32)
    return jnp.clip(src_len + max_extra_len, 1, max_len)


def _step_log_probs(
    logits: jax.Array, step: jax.Array, limits: jax.Array, eos_id: int
) -> jax.Array:
    """Log-probabilities ``[B, ..., V]`` with padding banned and EOS forced at the length limit.

    ``step`` is the number of tokens generated before this one; ``limits`` int32 ``[B]``.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vocab = jnp.arange(log_probs.shape[-1])
    log_probs = jnp.where(vocab == PAD_ID, NEG_INF, log_probs)
    at_limit = (step + 1 >= limits).reshape((-1,) + (1,) * (log_probs.ndim - 1))
    return jnp.where(at_limit & (vocab != eos_id), NEG_INF, log_probs)


# -- greedy ---------------------------------------------------------------------------------------


class _GreedyState(NamedTuple):
    step: jax.Array  # int32 scalar: tokens generated so far
    last: jax.Array  # int32 [B]: the token to feed next
    seqs: jax.Array  # int32 [B, L]
    done: jax.Array  # bool [B]
    cache: Any


def greedy_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    *,
    batch_size: int,
    max_len: int,
    eos_id: int,
    limits: jax.Array | None = None,
) -> jax.Array:
    """Greedy (argmax) decoding.

    Args:
      tokens_to_logits: ``(tokens [B], cache) -> (logits [B, V], cache)``.
      cache: the decoder cache for batch ``B``.
      batch_size: ``B``.
      max_len: static length ``L`` of the output buffer.
      eos_id: end-of-sentence id.
      limits: optional int32 ``[B]`` per-sentence budgets ``<= L`` (EOS forced at the limit).

    Returns:
      int32 ``[B, L]``: tokens, then EOS, then ``PAD_ID`` (EOS is forced at ``limits``, or at
      ``L`` when no limits are given).
    """
    if limits is None:
        limits = jnp.full((batch_size,), max_len, jnp.int32)

    def cond(state: _GreedyState) -> jax.Array:
        return (state.step < max_len) & ~jnp.all(state.done)

    def body(state: _GreedyState) -> _GreedyState:
        logits, cache = tokens_to_logits(state.last, state.cache)
        log_probs = _step_log_probs(logits, state.step, limits, eos_id)
        token = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        token = jnp.where(state.done, PAD_ID, token)
        seqs = jax.lax.dynamic_update_slice_in_dim(state.seqs, token[:, None], state.step, 1)
        done = state.done | (token == eos_id)
        return _GreedyState(state.step + 1, token, seqs, done, cache)

    init = _GreedyState(
        step=jnp.zeros((), jnp.int32),
        last=jnp.full((batch_size,), PAD_ID, jnp.int32),
        seqs=jnp.full((batch_size, max_len), PAD_ID, jnp.int32),
        done=jnp.zeros((batch_size,), bool),
        cache=cache,
    )
    return jax.lax.while_loop(cond, body, init).seqs


# -- beam search ----------------------------------------------------------------------------------


class BeamState(NamedTuple):
    """Beam search loop state (``B`` sentences, ``K`` beams, ``L`` output positions)."""

    step: jax.Array  # int32 scalar: tokens generated so far by every live hypothesis
    live_seqs: jax.Array  # int32 [B, K, L]
    live_scores: jax.Array  # float32 [B, K]: summed log-probabilities (NEG_INF: empty)
    last: jax.Array  # int32 [B, K]: the token each live beam feeds next
    fin_seqs: jax.Array  # int32 [B, K, L]
    fin_scores: jax.Array  # float32 [B, K]: length-normalised, best first (NEG_INF: empty)
    fin_flags: jax.Array  # bool [B, K]: slot holds a finished hypothesis
    done: jax.Array  # bool [B]
    cache: Any  # decoder cache, batch axis B * K


def _gather_beams(tree: Any, indices: jax.Array) -> Any:
    """Picks beams: leaves ``[B, K_old, ...]``, ``indices [B, K_new]`` -> ``[B, K_new, ...]``.

    Scalar leaves (e.g. the cache index, shared by all beams) pass through.
    """

    def gather(x):
        if x.ndim == 0:
            return x
        return jnp.take_along_axis(x, indices.reshape(indices.shape + (1,) * (x.ndim - 2)), axis=1)

    return jax.tree.map(gather, tree)


def _split_beams(tree: Any, batch_size: int) -> Any:
    """``[B * K, ...]`` -> ``[B, K, ...]`` for every non-scalar leaf."""
    return jax.tree.map(
        lambda x: x if x.ndim == 0 else x.reshape(batch_size, -1, *x.shape[1:]), tree
    )


def _merge_beams(tree: Any) -> Any:
    """``[B, K, ...]`` -> ``[B * K, ...]`` for every non-scalar leaf."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x.reshape(-1, *x.shape[2:]), tree)


def repeat_for_beams(tree: Any, beam_size: int) -> Any:
    """``[B, ...]`` -> ``[B * K, ...]`` (each sentence repeated ``K`` times, adjacent)."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    eos_id: int,
    alpha: float = 0.6,
    limits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search (module docstring for the rules).

    Long because its step is a closure that ``jax.lax.while_loop`` runs over the static sizes
    and ``tokens_to_logits``, read best in one piece; its parts are already helpers
    (:func:`_step_log_probs`, :func:`_best_finished`, :func:`_gather_beams`,
    :func:`_initial_state`).

    Args:
      tokens_to_logits: ``(tokens [B*K], cache) -> (logits [B*K, V], cache)``; beam ``k`` of
        sentence ``b`` is row ``b * K + k``.
      cache: the decoder cache with batch ``B * K`` (see :func:`repeat_for_beams`).
      batch_size, beam_size: ``B`` and ``K``.
      max_len: static length ``L`` of the output buffers.
      eos_id: end-of-sentence id.
      alpha: length-penalty exponent.
      limits: optional int32 ``[B]`` per-sentence budgets ``<= L``, EOS included.

    Returns:
      ``seqs`` int32 ``[B, K, L]`` (best first; tokens, EOS, then ``PAD_ID``) and their
      length-normalised ``scores`` float32 ``[B, K]``.
    """
    b, k = batch_size, beam_size
    if limits is None:
        limits = jnp.full((b,), max_len, jnp.int32)
    slot = jnp.arange(2 * k)

    def cond(state: BeamState) -> jax.Array:
        return (state.step < max_len) & ~jnp.all(state.done)

    def body(state: BeamState) -> BeamState:
        logits, cache = tokens_to_logits(state.last.reshape(-1), state.cache)
        log_probs = _step_log_probs(logits.reshape(b, k, -1), state.step, limits, eos_id)
        vocab = log_probs.shape[-1]
        # Every (beam, token) continuation, then the best 2K per sentence: at most K of them end
        # in EOS (one per beam), so K non-EOS ones remain to stay live.
        flat = (state.live_scores[:, :, None] + log_probs).reshape(b, k * vocab)
        cand_scores, cand_index = jax.lax.top_k(flat, 2 * k)
        cand_beam, cand_token = cand_index // vocab, (cand_index % vocab).astype(jnp.int32)
        cand_seqs = _gather_beams(state.live_seqs, cand_beam)
        cand_seqs = jax.lax.dynamic_update_slice_in_dim(
            cand_seqs, cand_token[:, :, None], state.step, 2
        )
        valid = cand_scores > NEG_INF / 2
        is_eos = cand_token == eos_id

        # Finish EOS continuations ranked among the best K, in sentences still searching.
        new_fin = is_eos & valid & (slot < k)[None, :] & ~state.done[:, None]
        fin_seqs, fin_scores, fin_flags = _best_finished(
            state, new_fin, cand_scores / length_penalty(state.step + 1, alpha), cand_seqs, k)

        # The best K non-EOS continuations stay live.
        live_rank = jnp.where(is_eos | ~valid, NEG_INF, cand_scores)
        live_scores, live_pick = jax.lax.top_k(live_rank, k)
        live_seqs, last, parent = _gather_beams((cand_seqs, cand_token, cand_beam), live_pick)
        cache = _merge_beams(_gather_beams(_split_beams(cache, b), parent))

        done = state.done | (jnp.sum(fin_flags, axis=1) >= k) | (state.step + 1 >= limits)
        return BeamState(
            state.step + 1,
            live_seqs,
            live_scores,
            last,
            fin_seqs,
            fin_scores,
            fin_flags,
            done,
            cache,
        )

    final = jax.lax.while_loop(cond, body, _initial_state(cache, b, k, max_len))
    # EOS is forced at every limit, so each sentence ends with finished hypotheses; should one
    # have none (every continuation impossible), fall back to its live beams.
    has_fin = jnp.any(final.fin_flags, axis=1)
    seqs = jnp.where(has_fin[:, None, None], final.fin_seqs, final.live_seqs)
    scores = jnp.where(has_fin[:, None], final.fin_scores, final.live_scores)
    return seqs, scores


def _initial_state(cache: Any, b: int, k: int, max_len: int) -> BeamState:
    """Nothing decoded yet. Only beam 0 is live at first, so the K beams do not start as K
    copies of one hypothesis."""
    first_live = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF).astype(jnp.float32)
    return BeamState(
        step=jnp.zeros((), jnp.int32),
        live_seqs=jnp.full((b, k, max_len), PAD_ID, jnp.int32),
        live_scores=jnp.tile(first_live, (b, 1)),
        last=jnp.full((b, k), PAD_ID, jnp.int32),
        fin_seqs=jnp.full((b, k, max_len), PAD_ID, jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        fin_flags=jnp.zeros((b, k), bool),
        done=jnp.zeros((b,), bool),
        cache=cache,
    )


def _best_finished(state: BeamState, new_flags: jax.Array, new_scores: jax.Array,
                   new_seqs: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The best ``k`` finished hypotheses per sentence among the kept ones and the ``2K`` new
    candidates (``new_flags`` marks those that finish; scores length-normalised): ``seqs
    [B, K, L]``, ``scores [B, K]`` (``NEG_INF`` where none) and ``flags [B, K]``."""
    all_flags = jnp.concatenate([state.fin_flags, new_flags], axis=1)
    all_scores = jnp.concatenate([state.fin_scores, new_scores], axis=1)
    all_seqs = jnp.concatenate([state.fin_seqs, new_seqs], axis=1)
    _, keep = jax.lax.top_k(jnp.where(all_flags, all_scores, -jnp.inf), k)
    flags, seqs = _gather_beams((all_flags, all_seqs), keep)
    scores = jnp.where(flags, _gather_beams(all_scores, keep), NEG_INF)
    return seqs, scores, flags


# -- model wiring ---------------------------------------------------------------------------------


def _output_len(source_len: int, max_extra_len: int, max_len: int | None) -> int:
    length = source_len + max_extra_len
    return length if max_len is None else min(length, max_len)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "beam_size", "alpha", "eos_id", "max_extra_len", "max_len"),
)
def _beam_search_jit(graphdef, state, inputs, *, beam_size, alpha, eos_id, max_extra_len, max_len):
    model = nnx.merge(graphdef, state)
    batch = inputs.shape[0]
    length = _output_len(inputs.shape[1], max_extra_len, max_len)
    encoded = repeat_for_beams(model.encode(inputs), beam_size)
    cache = model.init_cache(batch * beam_size, length)

    def tokens_to_logits(tokens, cache):
        # Re-merged per trace of the loop body, so nothing the step might write to the module
        # (e.g. RNG counters) leaks out of the while_loop.
        return nnx.merge(graphdef, state).decode_step(tokens, cache, encoded)

    return beam_search(
        tokens_to_logits,
        cache,
        batch_size=batch,
        beam_size=beam_size,
        max_len=length,
        eos_id=eos_id,
        alpha=alpha,
        limits=sequence_limits(inputs, max_extra_len, length),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "eos_id", "max_extra_len", "max_len"))
def _greedy_jit(graphdef, state, inputs, *, eos_id, max_extra_len, max_len):
    model = nnx.merge(graphdef, state)
    batch = inputs.shape[0]
    length = _output_len(inputs.shape[1], max_extra_len, max_len)
    encoded = model.encode(inputs)
    cache = model.init_cache(batch, length)

    def tokens_to_logits(tokens, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, cache, encoded)

    return greedy_search(
        tokens_to_logits,
        cache,
        batch_size=batch,
        max_len=length,
        eos_id=eos_id,
        limits=sequence_limits(inputs, max_extra_len, length),
    )


def beam_search_model(
    model: Transformer,
    inputs: jax.Array,
    *,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra_len: int = 50,
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Jitted beam search with ``model`` on ``inputs [B, S]`` (0-padded source ids).

    Output length: at most ``source_len + max_extra_len`` tokens per sentence (EOS included),
    with a static buffer of ``min(S + max_extra_len, max_len)``. Defaults are those of
    ``config.decode``. Returns ``seqs`` int32 ``[B, K, L]`` (best first) and ``scores [B, K]``.
    One compilation per (input shape, settings, model structure).
    """
    graphdef, state = nnx.split(model)
    return _beam_search_jit(
        graphdef,
        state,
        jnp.asarray(inputs, jnp.int32),
        beam_size=beam_size,
        alpha=float(alpha),
        eos_id=int(eos_id),
        max_extra_len=int(max_extra_len),
        max_len=max_len,
    )


def greedy_search_model(
    model: Transformer,
    inputs: jax.Array,
    *,
    eos_id: int,
    max_extra_len: int = 50,
    max_len: int | None = None,
) -> jax.Array:
    """Jitted greedy decoding with ``model``; int32 ``[B, L]`` as :func:`beam_search_model`."""
    graphdef, state = nnx.split(model)
    return _greedy_jit(
        graphdef,
        state,
        jnp.asarray(inputs, jnp.int32),
        eos_id=int(eos_id),
        max_extra_len=int(max_extra_len),
        max_len=max_len,
    )
