"""Tests of beam search and greedy decoding with the cached Transformer decoder.

One tiny model (vocab 12, emb 32, 1+1 layers, N=2 SparseMixer MoE in both) is shared: the
search-rule tests run on its random initialisation, then the copy-task test trains it. All
searches use the same input shape, so each search compiles once.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparsemixer_jax.models import decode
from sparsemixer_jax.models.encoder_decoder import Transformer, TransformerConfig
from sparsemixer_jax.token_ids import PAD_ID
from tests import kit

VOCAB, EOS = 12, 1  # 0 = padding / start, 1 = EOS, 2..11 = symbols
SRC_LEN = 8
EXTRA = 2  # decode.max_extra_len for these tests
# Static output cap: below SRC_LEN + EXTRA, so both the per-sentence budget (source length +
# EXTRA) and the cap bind for some sentences; every search then shares one output shape.
MAX_LEN = SRC_LEN


def tiny_config():
    """The tiny Transformer (tests/kit.py) at emb 32, mlp 64, 4 heads, 1 + 1 layers, no dropout."""
    return kit.tiny_config("transformer", model={
        "encoder_layers": 1, "decoder_layers": 1, "emb_dim": 32, "mlp_dim": 64, "num_heads": 4,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0})


def copy_batch(rng: np.random.Generator, n: int) -> jax.Array:
    """``[n, SRC_LEN]``: 1..SRC_LEN-1 random symbols, EOS, then padding."""
    lengths = rng.integers(1, SRC_LEN, n)
    x = rng.integers(2, VOCAB, (n, SRC_LEN))
    x[np.arange(SRC_LEN)[None] > lengths[:, None]] = PAD_ID
    x[np.arange(n), lengths] = EOS
    return jnp.asarray(x, jnp.int32)


@pytest.fixture(scope="module")
def model():
    return Transformer(*kit.sections(tiny_config(), TransformerConfig), VOCAB,
                       rngs=nnx.Rngs(params=0, dropout=1, router=2))


@pytest.fixture(scope="module")
def inputs():
    return copy_batch(np.random.default_rng(1), 16)


@pytest.fixture(scope="module")
def beams(model, inputs):
    """Beam 4 on the untrained model (length penalty 0.6)."""
    return decode.beam_search_model(
        model, inputs, eos_id=EOS, beam_size=4, alpha=0.6, max_extra_len=EXTRA, max_len=MAX_LEN
    )


def test_length_penalty():
    np.testing.assert_allclose(decode.length_penalty(7, 0.6), (12 / 6) ** 0.6, rtol=1e-6)
    np.testing.assert_allclose(decode.length_penalty(3, 0.0), 1.0)


def test_sequence_limits():
    inputs = jnp.array([[5, 6, 1, 0], [5, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(decode.sequence_limits(inputs, 2, 4), [4, 4, 2])
    np.testing.assert_array_equal(decode.sequence_limits(inputs, 0, 9), [3, 2, 1])


def test_beam_one_equals_greedy(model, inputs):
    greedy = decode.greedy_search_model(
        model, inputs, eos_id=EOS, max_extra_len=EXTRA, max_len=MAX_LEN
    )
    seqs, _ = decode.beam_search_model(
        model, inputs, eos_id=EOS, beam_size=1, alpha=0.6, max_extra_len=EXTRA, max_len=MAX_LEN
    )
    chex.assert_shape(greedy, (16, MAX_LEN))
    limits = np.asarray(decode.sequence_limits(inputs, EXTRA, MAX_LEN))
    _check_terminated(np.asarray(greedy)[:, None], limits)
    np.testing.assert_array_equal(seqs[:, 0], greedy)


def _check_terminated(seqs: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Asserts every row of ``seqs [B, K, L]`` is symbols, one EOS, then padding; lengths."""
    b, k, _ = seqs.shape
    lengths = np.zeros((b, k), int)
    for i in range(b):
        for j in range(k):
            row = seqs[i, j]
            eos = np.flatnonzero(row == EOS)
            assert len(eos) == 1, row
            n = eos[0] + 1
            assert np.all(row[: n - 1] >= 2) and np.all(row[n:] == PAD_ID), row
            assert n <= limits[i], (row, limits[i])
            lengths[i, j] = n
    return lengths


def test_beams_are_terminated_sorted_and_distinct(beams, inputs):
    seqs, scores = (np.asarray(x) for x in beams)
    chex.assert_shape(seqs, (16, 4, MAX_LEN))
    limits = np.asarray(decode.sequence_limits(inputs, EXTRA, MAX_LEN))
    lengths = _check_terminated(seqs, limits)
    # The untrained model runs into the budget for some sentences: EOS was forced there.
    assert np.any(lengths == limits[:, None])
    assert np.all(np.diff(scores, axis=1) <= 0)
    assert np.all(scores > decode.NEG_INF / 2)
    for i in range(seqs.shape[0]):
        assert len({tuple(row) for row in seqs[i]}) == 4


@nnx.jit
def _rescore(model, inputs, seqs, alpha):
    """Length-normalised log-probability of each hypothesis under teacher forcing."""
    logits, _ = model(inputs, seqs, deterministic=True)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(log_probs, seqs[..., None], axis=-1)[..., 0]
    mask = seqs != PAD_ID
    length = jnp.sum(mask, axis=-1)
    return jnp.sum(jnp.where(mask, token_lp, 0.0), axis=-1) / decode.length_penalty(length, alpha)


def test_beam_scores_equal_teacher_forced_scores(model, inputs, beams):
    """The cached search's scores are the model's own (full forward) length-normalised scores."""
    seqs, scores = beams
    b, k, length = seqs.shape
    flat_inputs = jnp.repeat(inputs, k, axis=0)
    expected = _rescore(model, flat_inputs, seqs.reshape(b * k, length), 0.6)
    np.testing.assert_allclose(scores.reshape(-1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # fast counterparts: beam 1 = greedy, cached = full decoding, test BLEU
def test_beam_search_learns_copy_task(model, inputs):
    """~200 Adam steps on copying; beam search then reproduces held-out sources exactly."""
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            logits, aux = model(batch, batch, deterministic=False)
            mask = (batch != PAD_ID).astype(jnp.float32)
            xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch)
            return jnp.sum(xent * mask) / jnp.sum(mask) + 0.01 * aux["balance_loss"]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    for _ in range(200):
        loss = train_step(model, optimizer, copy_batch(rng, 64))
    assert float(loss) < 0.5

    seqs, _ = decode.beam_search_model(
        model, inputs, eos_id=EOS, beam_size=4, alpha=0.6, max_extra_len=EXTRA, max_len=MAX_LEN
    )
    np.testing.assert_array_equal(seqs[:, 0], inputs)
