"""The pretraining encoder: T5 relative position buckets, padding, MoE metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.models.encoder import Encoder, EncoderConfig, relative_position_bucket
from tests import kit

# Computed by hand from T5's definition with 32 buckets (16 per direction, 8 exact distances
# each) and max_distance 128: distance d >= 8 goes to 8 + floor(ln(d / 8) / ln(16) * 8), capped
# at 15; keys after the query (relative position > 0) add 16. E.g. d = 20: ln 2.5 / ln 16 * 8 =
# 2.64 -> 10; d = 33: 4.09 -> 12; d = 70: 6.26 -> 14; d = 200: 9.29 -> capped at 15.
BUCKET_TABLE = {
    -300: 15, -200: 15, -128: 15, -70: 14, -60: 13, -33: 12, -20: 10, -17: 10, -15: 9,
    -12: 9, -11: 8, -9: 8, -8: 8, -7: 7, -3: 3, -1: 1, 0: 0, 1: 17, 3: 19, 7: 23, 8: 24,
    9: 24, 11: 24, 12: 25, 15: 25, 17: 26, 20: 26, 33: 28, 60: 29, 70: 30, 128: 31, 200: 31,
}


def test_relative_position_bucket_matches_hand_table():
    rel = np.array(list(BUCKET_TABLE))
    got = np.asarray(relative_position_bucket(jnp.asarray(rel), num_buckets=32, max_distance=128))
    np.testing.assert_array_equal(got, np.array(list(BUCKET_TABLE.values())))


def test_relative_position_bucket_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_buckets"):
        relative_position_bucket(jnp.zeros(3, jnp.int32), num_buckets=7)
    with pytest.raises(ValueError, match="max_distance"):
        relative_position_bucket(jnp.zeros(3, jnp.int32), num_buckets=32, max_distance=8)


@nnx.jit(static_argnames=("deterministic",))
def encode(encoder, tokens, segments=None, deterministic=True):
    # Compiled: op-by-op execution of even a tiny encoder takes tens of seconds on 2 cores.
    return encoder(tokens, segments=segments, deterministic=deterministic)


@pytest.fixture(scope="module")
def encoder():
    return Encoder(*kit.sections(kit.tiny_config("encoder"), EncoderConfig), vocab_size=50,
                   rngs=nnx.Rngs(params=0, dropout=1, router=2))


def test_shapes_and_moe_aux(encoder):
    tokens = jnp.array([[3, 10, 11, 4, 12, 4, 0, 0], [3, 7, 8, 9, 4, 0, 0, 0]], jnp.int32)
    segments = jnp.array([[0, 0, 0, 0, 1, 1, 0, 0], [0] * 8], jnp.int32)
    hidden, aux = encode(encoder, tokens, segments)
    assert hidden.shape == (2, 8, 16) and hidden.dtype == jnp.float32
    assert set(aux["moe"]) == {"layer_0"}  # moe_every=2, 2 layers: layer 0 is MoE
    np.testing.assert_allclose(aux["balance_loss"], aux["moe"]["layer_0"]["balance_loss"])
    assert aux["moe"]["layer_0"]["expert_fraction"].shape == (2,)
    # The segment ids change the hidden states of every position.
    other, _ = encode(encoder, tokens, jnp.zeros_like(segments))
    assert not np.allclose(hidden[0, :6], other[0, :6])


def test_padding_is_invisible(encoder):
    """Real positions do not see padding: appending pads leaves their hidden states unchanged
    (relative positions do not depend on the length), and the routing metrics too."""
    tokens = jnp.array([[3, 10, 11, 4, 12, 4]], jnp.int32)
    padded = jnp.concatenate([tokens, jnp.zeros((1, 5), jnp.int32)], axis=1)
    a, aux_a = encode(encoder, tokens)
    b, aux_b = encode(encoder, padded)
    np.testing.assert_allclose(a, b[:, :6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux_a["balance_loss"], aux_b["balance_loss"], rtol=1e-5)


def test_relative_bias_depends_on_offsets_only(encoder):
    bias = np.asarray(encoder.position_bias(6)[0])  # [H, T, S]
    for h in range(bias.shape[0]):
        for t in range(5):
            for s in range(5):
                assert bias[h, t, s] == bias[h, t + 1, s + 1]
    assert not np.allclose(bias[:, 0, 1], bias[:, 1, 0])  # before / after are distinct buckets


def test_dense_encoder_has_no_moe_metrics():
    dense = kit.tiny_config("encoder", model={"num_experts": 0})
    enc = Encoder(*kit.sections(dense, EncoderConfig), vocab_size=50, rngs=nnx.Rngs(0))
    hidden, aux = encode(enc, jnp.array([[3, 9, 4]], jnp.int32))
    assert aux["moe"] == {} and float(aux["balance_loss"]) == 0.0
    assert hidden.shape == (1, 3, 16)


def test_dropout_only_when_not_deterministic(encoder):
    tokens = jnp.array([[3, 10, 11, 4]], jnp.int32)
    a, _ = encode(encoder, tokens, deterministic=True)
    b, _ = encode(encoder, tokens, deterministic=True)
    c, _ = encode(encoder, tokens, deterministic=False)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_absolute_positions_and_gelu_switches():
    """``absolute_positions = P`` adds a learned ``[P, emb]`` table: the output keeps its shape,
    the first ``L`` rows get a gradient and the rest none, a sequence longer than ``P`` is
    refused; ``activation`` reaches the dense and the MoE feed-forwards."""
    c = kit.tiny_config("encoder")
    c.model.absolute_positions, c.model.activation = 12, "gelu"
    enc = Encoder(*kit.sections(c, EncoderConfig), vocab_size=50,
                  rngs=nnx.Rngs(params=0, dropout=1, router=2))
    assert enc.layers[0].ffn.moe.activation == enc.layers[1].ffn.activation == "gelu"
    assert enc.embeddings.position.embedding.shape == (12, 16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(6, 50, (2, 7)), jnp.int32)

    def loss(model):
        hidden, _ = model(tokens)
        return jnp.sum(hidden * jnp.arange(16.0))

    grads = nnx.jit(nnx.grad(loss))(enc)  # compiled: op by op takes tens of seconds
    table = np.asarray(grads["embeddings"]["position"]["embedding"][...])
    assert np.abs(table[:7]).min(axis=1).all() and not table[7:].any()
    hidden, _ = encode(enc, tokens)
    assert hidden.shape == (2, 7, 16)
    with pytest.raises(ValueError, match=r"sequence of 13 tokens.*positions for 12"):
        enc(jnp.ones((1, 13), jnp.int32))
    plain = Encoder(*kit.sections(kit.tiny_config("encoder"), EncoderConfig), vocab_size=50,
                    rngs=nnx.Rngs(params=0, dropout=1, router=2))
    assert plain.embeddings.position is None  # a config without the fields: none, ReLU
    assert plain.layers[0].ffn.moe.activation == "relu"


def test_attention_impl_reaches_the_fused_attention(monkeypatch):
    """``model.attention_impl`` acts in the encoder as in the translation model: the fused path
    calls ``jax.nn.dot_product_attention`` with the implementation and the position bias, and
    gives the einsum attention's hidden states (attention dropout 0)."""
    calls = []
    fused_attention = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("implementation"), kwargs.get("bias") is not None))
        return fused_attention(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    tokens = jnp.array([[3, 10, 11, 4, 12, 4, 0, 0], [3, 7, 8, 9, 4, 0, 0, 0]], jnp.int32)
    hidden = {}
    for impl in ("einsum", "xla"):
        # Dense: the attention is what is tested.
        c = kit.tiny_config("encoder", model={"num_experts": 0})
        c.model.attention_impl, c.model.attention_dropout = impl, 0.0
        enc = Encoder(*kit.sections(c, EncoderConfig), vocab_size=50,
                      rngs=nnx.Rngs(params=0, dropout=1, router=2))
        hidden[impl], _ = encode(enc, tokens)  # traced: the spy sees the call
        assert [layer.self_attn.implementation for layer in enc.layers] == [impl, impl]
    assert calls == [("xla", True), ("xla", True)]  # one call per layer, none from "einsum"
    np.testing.assert_allclose(hidden["xla"], hidden["einsum"], rtol=1e-5, atol=1e-5)
