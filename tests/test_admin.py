"""Admin initialisation (Liu et al., 2020) of the ELECTRA encoder: the profiling pass sets each
post-norm sublayer's residual scale so that the residual sums grow as Admin prescribes."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.models.encoder import Encoder, EncoderConfig
from sparsemixer_jax.training.config import moe_model_fields, router_config
from tests import kit


def admin_config(init="admin", num_layers=4):
    c = ml_collections.ConfigDict()
    c.model = moe_model_fields(ml_collections.ConfigDict(dict(
        num_layers=num_layers, emb_dim=64, mlp_dim=128, num_heads=4, relative_buckets=32,
        relative_max_distance=128, absolute_positions=0)))
    c.model.num_experts, c.model.moe_every = 4, 2
    c.model.init = init
    c.router = router_config()
    return c


def _variance(v, real):
    """Variance over the real tokens' elements (the statistic the pass uses)."""
    v = np.asarray(v, np.float64)[real]
    return float(np.mean((v - v.mean()) ** 2))


@pytest.fixture(scope="module")
def profiled():
    tokens = jax.random.randint(jax.random.key(3), (8, 24), 5, 200)
    tokens = tokens.at[:, 20:].set(0).at[0, 10:].set(0)  # padding, unequal lengths
    encoder = Encoder(*kit.sections(admin_config(), EncoderConfig), vocab_size=200,
                      rngs=nnx.Rngs(params=0, dropout=1, router=2))
    scales = encoder.set_admin_scales(tokens)
    return encoder, tokens, scales


def _sublayers(encoder, tokens):
    """Per sublayer: (its input x_i, omega_i, its branch f_i(x_i), the residual sum)."""
    token_mask = tokens != 0
    x = encoder.embeddings(tokens, jnp.zeros_like(tokens), deterministic=True)
    bias = encoder.position_bias(tokens.shape[1])
    out = []
    for layer in encoder.layers:
        h = layer.attention_branch(x, bias, token_mask[:, None, None, :], deterministic=True)
        total = layer.residual(x, layer.attn_residual_scale) + h
        out.append((x, layer.attn_residual_scale[...], h, total))
        x = layer.self_attn_norm(total)
        h, _ = layer.ffn_branch(x, token_mask, deterministic=True)
        total = layer.residual(x, layer.ffn_residual_scale) + h
        out.append((x, layer.ffn_residual_scale[...], h, total))
        x = layer.ffn_norm(total)
    return out, x


def test_each_scale_is_the_std_the_residual_stream_reached(profiled):
    encoder, tokens, scales = profiled
    real = np.asarray(tokens != 0)
    sublayers, _ = _sublayers(encoder, tokens)
    assert len(scales) == 2 * len(encoder.layers) and scales[0] == 1.0
    # The embedding block is the first branch (omega_1 = 1 multiplies it).
    summed = _variance(sublayers[0][0], real)
    sums = []
    for i, (x, omega, h, total) in enumerate(sublayers):
        np.testing.assert_array_equal(omega, np.float32(scales[i]))  # the parameter holds it
        # Admin's recursion, on the profiling batch: exact.
        if i + 1 < len(scales):
            expected = _variance(np.asarray(omega) * np.asarray(x), real) + _variance(h, real)
            np.testing.assert_allclose(scales[i + 1] ** 2, expected, rtol=1e-5)
            # The residual sum before the LayerNorm has the variance the next scale names plus
            # twice the covariance of its two parts, which Admin's analysis takes as zero.
            both = (np.asarray(omega) * np.asarray(x))[real], np.asarray(h, np.float64)[real]
            cov = np.mean((both[0] - both[0].mean()) * (both[1] - both[1].mean()))
            np.testing.assert_allclose(_variance(total, real), scales[i + 1] ** 2 + 2 * cov,
                                       rtol=1e-4)
            sums.append(_variance(total, real))
            # The sublayers' LayerNorm outputs have variance 1, so each scale squared is the
            # summed output variance of the branches before it, the embedding's included.
            summed += _variance(h, real)
            np.testing.assert_allclose(scales[i + 1] ** 2, summed, rtol=1e-3)
    # The stream grows sublayer by sublayer. (The sums themselves need not: the attention
    # branch covaries with its input, positively here, which Admin's scales leave out.)
    assert np.all(np.diff(scales) > 0) and sums[-1] > sums[0]


def test_the_forward_applies_the_scales(profiled):
    encoder, tokens, _ = profiled
    _, by_hand = _sublayers(encoder, tokens)
    hidden, _ = encoder(tokens, deterministic=True)
    np.testing.assert_allclose(hidden, by_hand, rtol=1e-5, atol=1e-6)
    # With every scale back at 1 the output changes: the scales are used.
    for layer in encoder.layers:
        ones = jnp.ones_like(layer.attn_residual_scale[...])
        saved = layer.attn_residual_scale[...], layer.ffn_residual_scale[...]
        layer.attn_residual_scale[...] = ones
        layer.ffn_residual_scale[...] = ones
        unscaled, _ = encoder(tokens, deterministic=True)
        layer.attn_residual_scale[...], layer.ffn_residual_scale[...] = saved
        break
    assert not np.allclose(unscaled, hidden, atol=1e-4)


def test_other_schemes_have_no_residual_scales():
    encoder = Encoder(*kit.sections(admin_config("fairseq", 2), EncoderConfig), vocab_size=50,
                      rngs=nnx.Rngs(0))
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(encoder, nnx.Param))}
    assert not any("residual_scale" in n for n in names)
    with pytest.raises(ValueError, match=r"model\.init='admin'"):
        encoder.set_admin_scales(jnp.ones((2, 8), jnp.int32))
