"""Tests of the Switch Transformer: construction from configs, masking, cached decoding,
``fold_omega``, bf16 compute, training mode, and one full-size Transformer-base step.

Tiny shapes throughout (one compiled forward shared by several tests) except the single
Transformer-base forward/backward.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.wmt import get_config
from sparsemixer_jax.layers.fairseq import FeedForward
from sparsemixer_jax.models.encoder_decoder import (
    PAD_ID,
    Transformer,
    TransformerConfig,
    shift_right,
    sinusoidal_positions,
)
from sparsemixer_jax.moe import MoEFeedForward, fold_omega
from sparsemixer_jax.routers import ROUTERS, uses_omega
from tests import kit

VOCAB = 13
BATCH, SRC_LEN, TGT_LEN = 3, 7, 6


def tiny_config(num_experts: int = 2, router: str = "sparsemixer", layers: int = 2, **model):
    """Transformer-base config shrunk to emb 16, mlp 32, 2 heads (tests/kit.py), with
    ``layers`` + ``layers`` layers, ``num_experts`` experts and ``router``."""
    return kit.tiny_config("transformer", model=dict(
        encoder_layers=layers, decoder_layers=layers, num_experts=num_experts, **model),
        **{"router.name": router})


def transformer(config, vocab_size: int = VOCAB, **kwargs) -> Transformer:
    """The Transformer of ``config``'s typed sections (``mesh``, ``rngs`` in ``kwargs``)."""
    return Transformer(*kit.sections(config, TransformerConfig), vocab_size, **kwargs)


def random_batch(seed: int, src_len: int = SRC_LEN, tgt_len: int = TGT_LEN):
    """Source/target ids in ``[1, VOCAB)`` with trailing padding of different lengths per row."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, VOCAB, (BATCH, src_len))
    targets = rng.integers(1, VOCAB, (BATCH, tgt_len))
    for row, (s, t) in enumerate([(src_len, tgt_len), (src_len - 2, tgt_len - 3), (3, 2)]):
        inputs[row, s:] = PAD_ID
        targets[row, t:] = PAD_ID
    return jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)


@nnx.jit
def eval_forward(model, inputs, targets):
    return model(inputs, targets, deterministic=True)


@pytest.fixture(scope="module")
def moe_model():
    """2+2 layers, N=2 SparseMixer: MoE FFN in layer 0, dense in layer 1 (encoder and decoder)."""
    return transformer(tiny_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def batch():
    return random_batch(1)


@pytest.fixture(scope="module")
def eval_out(moe_model, batch):
    return eval_forward(moe_model, *batch)


# -- construction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "router"),
    [(n, "sparsemixer") for n in (0, 2, 4, 6, 8, 16)] + [(4, r) for r in sorted(ROUTERS)],
)
def test_builds_from_config(num_experts, router):
    """Every N and every router builds from the config alone (abstractly: nothing is
    allocated). The router does not change how N is laid out, so each varies on its own."""
    config = tiny_config(num_experts, router, layers=3)
    model = nnx.eval_shape(lambda: transformer(config, rngs=nnx.Rngs(0)))
    for stack in (model.encoder_layers, model.decoder_layers):
        for i, layer in enumerate(stack):
            if num_experts and i % 2 == 0:
                assert isinstance(layer.ffn, MoEFeedForward)
                assert layer.ffn.wi.shape == (num_experts, 16, 32)
                assert layer.ffn.router_config.name == router
                assert (layer.ffn.omega is not None) == uses_omega(router)
            else:
                assert isinstance(layer.ffn, FeedForward)


@pytest.mark.parametrize(
    ("num_experts", "router"),
    [(n, "sparsemixer") for n in (0, 4, 6, 16)] + [(2, r) for r in sorted(ROUTERS)],
)
def test_training_forward_traces(num_experts, router):
    """Training-mode forward for every N and router, traced abstractly (nothing compiled)."""
    config = tiny_config(num_experts, router, layers=2)
    inputs, targets = random_batch(0)

    def forward():
        model = transformer(config, rngs=nnx.Rngs(0))
        return model(inputs, targets, deterministic=False)

    logits, aux = jax.eval_shape(forward)
    assert logits.shape == (BATCH, TGT_LEN, VOCAB) and logits.dtype == jnp.float32
    expected = {"encoder/layer_0", "decoder/layer_0"} if num_experts else set()
    assert set(aux["moe"]) == expected
    for metrics in aux["moe"].values():
        assert metrics["expert_fraction"].shape == (num_experts,)
    assert aux["balance_loss"].shape == aux["z_loss"].shape == ()


def test_moe_every_places_layers():
    config = tiny_config(4, layers=6, moe_every=3)
    model = nnx.eval_shape(lambda: transformer(config, rngs=nnx.Rngs(0)))
    moe = [isinstance(layer.ffn, MoEFeedForward) for layer in model.encoder_layers]
    assert moe == [True, False, False, True, False, False]


# -- forward --------------------------------------------------------------------------------------


def test_shift_right():
    targets = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    np.testing.assert_array_equal(shift_right(targets), [[0, 5, 6, 7], [0, 8, 0, 0]])


def test_sinusoidal_positions_match_fairseq_formula():
    dim, pos = 8, jnp.arange(5)
    emb = np.asarray(sinusoidal_positions(pos, dim))
    freqs = np.exp(np.arange(4) * -np.log(10000.0) / 3)
    angles = np.arange(5)[:, None] * freqs
    np.testing.assert_allclose(emb, np.concatenate([np.sin(angles), np.cos(angles)], 1), atol=1e-6)


def test_forward_shapes_and_aux(eval_out):
    logits, aux = eval_out
    chex.assert_shape(logits, (BATCH, TGT_LEN, VOCAB))
    assert logits.dtype == jnp.float32
    chex.assert_tree_all_finite(logits)
    names = {"encoder/layer_0", "decoder/layer_0"}
    assert set(aux["moe"]) == names
    np.testing.assert_allclose(
        aux["balance_loss"], sum(m["balance_loss"] for m in aux["moe"].values()), rtol=1e-6
    )
    np.testing.assert_allclose(
        aux["z_loss"], sum(m["z_loss"] for m in aux["moe"].values()), rtol=1e-6
    )
    for metrics in aux["moe"].values():
        np.testing.assert_allclose(jnp.sum(metrics["expert_fraction"]), 1.0, rtol=1e-6)


def test_padding_does_not_change_logits(moe_model, batch, eval_out):
    """Appending more padding to source and target leaves every real position's logits as is."""
    inputs, targets = batch
    logits, _ = eval_out
    more_logits, _ = eval_forward(
        moe_model, jnp.pad(inputs, ((0, 0), (0, 3))), jnp.pad(targets, ((0, 0), (0, 3)))
    )
    real = np.asarray(targets != PAD_ID)
    np.testing.assert_allclose(
        np.asarray(more_logits[:, :TGT_LEN])[real], np.asarray(logits)[real], atol=1e-5, rtol=1e-5
    )


def test_decoder_is_causal(moe_model, batch, eval_out):
    """Changing target token t changes predictions after t only."""
    inputs, targets = batch
    logits, _ = eval_out
    t = 2
    changed = targets.at[0, t].set(targets[0, t] % (VOCAB - 1) + 1)
    new_logits, _ = eval_forward(moe_model, inputs, changed)
    np.testing.assert_allclose(new_logits[0, : t + 1], logits[0, : t + 1], atol=1e-6, rtol=1e-6)
    assert np.abs(np.asarray(new_logits[0, t + 1 :] - logits[0, t + 1 :])).max() > 1e-4


def test_source_padding_is_masked(moe_model, batch, eval_out):
    """Changing a source token changes the output; the encoder sees no padding."""
    inputs, targets = batch
    logits, _ = eval_out
    new_logits, _ = eval_forward(moe_model, inputs.at[0, 0].set(inputs[0, 0] % 12 + 1), targets)
    assert np.abs(np.asarray(new_logits[0] - logits[0])).max() > 1e-4
    np.testing.assert_allclose(new_logits[1:], logits[1:], atol=1e-6, rtol=1e-6)


# -- incremental decoding -------------------------------------------------------------------------


@nnx.jit
def cached_logits(model, inputs, targets):
    """Teacher-forced logits computed one position at a time with the KV cache, under scan."""
    encoded = model.encode(inputs)
    cache = model.init_cache(targets.shape[0], targets.shape[1])

    def step(cache, tokens):
        logits, cache = model.decode_step(tokens, cache, encoded)
        return cache, logits

    cache, logits = jax.lax.scan(step, cache, shift_right(targets).T)
    return jnp.swapaxes(logits, 0, 1), cache.index


def test_cached_decoding_matches_forward(moe_model, batch, eval_out):
    inputs, targets = batch
    logits, _ = eval_out
    step_logits, index = cached_logits(moe_model, inputs, targets)
    assert int(index) == TGT_LEN
    real = np.asarray(targets != PAD_ID)
    np.testing.assert_allclose(
        np.asarray(step_logits)[real], np.asarray(logits)[real], atol=1e-5, rtol=1e-5
    )


def test_decoding_is_dropless_in_capacity_mode(moe_model, batch):
    """A capacity that drops tokens in the teacher-forced pass leaves decoding as if dropless, so
    a translation does not depend on the other sentences of its batch."""
    inputs, targets = batch
    capped = transformer(tiny_config(capacity_factor=0.3), rngs=nnx.Rngs(0))
    _, aux = eval_forward(capped, inputs, targets)
    assert max(float(m["dropped_fraction"]) for m in aux["moe"].values()) > 0
    got, _ = cached_logits(capped, inputs, targets)
    want, _ = cached_logits(moe_model, inputs, targets)  # same params, capacity_factor 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


# -- fold_omega -----------------------------------------------------------------------------------


def test_fold_omega_keeps_outputs(moe_model, batch, eval_out):
    model = nnx.clone(moe_model)
    rng = np.random.default_rng(3)
    moe_layers = [
        layer.ffn
        for layer in [*model.encoder_layers, *model.decoder_layers]
        if isinstance(layer.ffn, MoEFeedForward)
    ]
    for layer in moe_layers:  # a trained omega is not all ones
        layer.omega[...] = jnp.asarray(rng.uniform(0.5, 1.5, layer.omega.shape), jnp.float32)
        layer.bo[...] = jnp.asarray(rng.normal(0, 0.1, layer.bo.shape), jnp.float32)
    before, _ = eval_forward(model, *batch)
    assert np.abs(np.asarray(before - eval_out[0])).max() > 1e-4  # omega matters

    assert fold_omega(model) == len(moe_layers) == 2
    for layer in moe_layers:
        np.testing.assert_array_equal(layer.omega[...], np.ones(16, np.float32))
    after, _ = eval_forward(model, *batch)
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=1e-5)


def test_fold_omega_skips_switch_and_dense():
    # Abstract models: fold_omega must not touch any parameter of these.
    switch = nnx.eval_shape(lambda: transformer(tiny_config(2, "switch"), rngs=nnx.Rngs(0)))
    dense = nnx.eval_shape(lambda: transformer(tiny_config(0), rngs=nnx.Rngs(0)))
    assert fold_omega(switch) == 0 and fold_omega(dense) == 0


# -- dtypes and training mode ---------------------------------------------------------------------


@pytest.mark.slow  # fast counterpart: tests/test_moe.py::test_bfloat16_compute (the layer)
def test_bfloat16_compute_keeps_float32_params_and_logits(moe_model, batch, eval_out):
    config = tiny_config(compute_dtype="bfloat16")
    model = transformer(config, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    # Same seed, same parameters as the float32 model: only the compute dtype differs.
    chex.assert_trees_all_equal(params, nnx.state(moe_model, nnx.Param))
    logits, _ = eval_forward(model, *batch)
    assert logits.dtype == jnp.float32
    assert model.encode(batch[0]).cross_k[0].dtype == jnp.bfloat16

    real = np.asarray(batch[1] != PAD_ID)
    # bf16 matmuls (8-bit mantissa) through 4 layers: agreement to bf16 accuracy only.
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(eval_out[0])[real], atol=0.1)


def _loss_fn(model, inputs, targets):
    logits, aux = model(inputs, targets, deterministic=False)
    mask = (targets != PAD_ID).astype(jnp.float32)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(xent * mask) / jnp.sum(mask) + 0.01 * aux["balance_loss"]


@nnx.jit
def train_loss_and_grads(model, inputs, targets):
    return nnx.value_and_grad(_loss_fn)(model, inputs, targets)


@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
def test_transformer_base_forward_backward_on_cpu():
    """Full Transformer-base (6+6, emb 512, mlp 2048, N=4 SparseMixer), batch 2 x 8 tokens,
    training mode (dropout, sampled routing): one compile, two steps."""
    config = get_config()
    assert (config.model.encoder_layers, config.model.emb_dim, config.model.mlp_dim) == (
        6,
        512,
        2048,
    )
    config.model.num_experts = 4
    vocab = 512  # the vocabulary size does not change the architecture; keep the step cheap
    model = transformer(config, vocab, rngs=nnx.Rngs(params=0, dropout=1))
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(1, vocab, (2, 8)), jnp.int32).at[1, 6:].set(PAD_ID)
    targets = jnp.asarray(rng.integers(1, vocab, (2, 8)), jnp.int32).at[0, 5:].set(PAD_ID)
    loss, grads = train_loss_and_grads(model, inputs, targets)
    loss2, _ = train_loss_and_grads(model, inputs, targets)  # RNG streams advanced
    assert np.isfinite(loss) and np.isfinite(loss2) and loss != loss2
    chex.assert_tree_all_finite(grads)
    # Gradients reach every MoE layer's experts and SparseMixer's omega.
    for stack in ("encoder_layers", "decoder_layers"):
        for i in (0, 2, 4):
            ffn = grads[stack][i]["ffn"]
            for name in ("wi", "wo", "omega"):
                assert np.abs(np.asarray(ffn[name][...])).max() > 0, (stack, i, name)
    num_moe = sum(isinstance(m, MoEFeedForward) for _, m in nnx.iter_modules(model))
    assert num_moe == 6


def test_mesh_is_passed_to_moe_layers():
    """The mesh reaches every MoE layer; N=6 on an expert axis of 4 is the MoE layer's error."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices, see conftest.py")
    from sparsemixer_jax.parallel.sharding import make_mesh

    mesh = make_mesh(data=2, expert=4)
    model = nnx.eval_shape(lambda: transformer(tiny_config(4), mesh=mesh, rngs=nnx.Rngs(0)))
    moe = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEFeedForward)]
    assert len(moe) == 2 and all(m.mesh is mesh for m in moe)
    with pytest.raises(ValueError, match="divisible"):
        transformer(tiny_config(6), mesh=mesh, rngs=nnx.Rngs(0))
