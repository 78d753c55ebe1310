"""ELECTRA's objective on a tiny model: where replacements are sampled, the discriminator's
labels, the stop-gradient through sampling, the tied embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import token_ids
from sparsemixer_jax.data import text
from sparsemixer_jax.models import electra
from sparsemixer_jax.models.encoder import EncoderConfig
from sparsemixer_jax.tasks import run_config
from tests import tiny_electra_config

VOCAB = 40


def build_model(config, vocab_size):
    """A fresh ELECTRA (generator + discriminator) of ``config``, seeded from ``config.seed``,
    as the pretraining task builds it (which checks the config first)."""
    run = run_config(config)
    return run.task.build_model(run, vocab_size, None)
SETTINGS = electra.LossSettings(disc_weight=50.0, balance_weight=0.01, z_loss_weight=0.0,
                                mask_prob=0.15)


# Compiled once per model structure: every test below reuses it.
electra_loss = nnx.jit(electra.electra_loss, static_argnums=(3,),
                       static_argnames=("deterministic",))


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_electra_config.get_config(), VOCAB)


def make_batch(seed=0, rows=4, length=16):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(token_ids.FIRST_WORD_ID, VOCAB, size=(rows, length)).astype(np.int32)
    tokens[:, 0], tokens[:, 9] = token_ids.CLS_ID, token_ids.SEP_ID
    tokens[1, 12:] = token_ids.PAD_ID
    segments = np.zeros_like(tokens)
    segments[:, 10:] = 1
    batch = text.mlm_batch(tokens, segments, rng, mask_prob=0.15, mask_token_prob=0.85)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def test_generator_and_discriminator_share_the_embeddings(model):
    assert model.generator.embeddings is model.discriminator.embeddings
    assert len(model.generator.layers) == 1 and len(model.discriminator.layers) == 2
    params = nnx.state(model, nnx.Param)
    tables = [p for path, p in nnx.to_flat_state(params) if path[-2:] == ("token", "embedding")]
    assert len(tables) == 1  # one table in the state: one set of weights, one gradient


def test_replacements_only_at_selected_positions_and_labels_where_they_differ(model):
    batch = make_batch()
    _, metrics = electra_loss(model, batch, jax.random.key(0), SETTINGS,
                                      deterministic=True)
    tokens, corrupted = np.asarray(batch["tokens"]), np.asarray(metrics["corrupted"])
    selected = np.asarray(batch["selected"])
    np.testing.assert_array_equal(corrupted[~selected], tokens[~selected])
    assert (corrupted[selected] >= token_ids.FIRST_WORD_ID).all()  # never a special id
    replaced = corrupted != tokens
    assert replaced.sum() == metrics["replaced"] > 0
    assert metrics["mlm_count"] == selected.sum()
    assert metrics["disc_count"] == (tokens != 0).sum()


def test_a_sample_equal_to_the_original_is_labelled_original(model):
    """With the generator forced to output token 7, selected positions holding 7 stay
    "original": the discriminator's loss is the hand-computed one with exactly those labels."""
    batch = make_batch(seed=1)
    tokens = np.asarray(batch["tokens"]).copy()
    selected = np.asarray(batch["selected"])
    rows, cols = np.nonzero(selected)
    tokens[rows[::2], cols[::2]] = 7  # half of the selected positions already hold 7
    batch = {**batch, "tokens": jnp.asarray(tokens)}
    graphdef, state = nnx.split(model)
    forced = nnx.merge(graphdef, state)
    bias = np.zeros(VOCAB, np.float32)
    bias[7] = 1e4
    forced.generator_head.bias[...] = jnp.asarray(bias)

    loss, metrics = electra_loss(forced, batch, jax.random.key(3), SETTINGS,
                                         deterministic=True)
    expected = np.where(selected, 7, tokens)
    np.testing.assert_array_equal(metrics["corrupted"], expected)
    labels = (expected != tokens).astype(np.float32)
    assert 0 < labels.sum() < selected.sum()
    discriminate = nnx.jit(lambda m, x, s: m.discriminator_head(m.discriminator(x, segments=s)[0]))
    logits = np.asarray(discriminate(forced, jnp.asarray(expected), batch["segments"]), np.float64)
    real = tokens != 0
    bce = np.logaddexp(0.0, logits) - labels * logits  # sigmoid cross entropy
    np.testing.assert_allclose(metrics["disc_loss"], bce[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["replaced"], labels[real].sum())
    mlm = metrics["mlm_loss"]
    np.testing.assert_allclose(
        loss, mlm + 50.0 * metrics["disc_loss"] + 0.01 * metrics["balance_loss"], rtol=1e-6)


def test_no_gradient_flows_through_the_sample_into_the_generator(model):
    """The discriminator loss gives the generator's own weights a zero gradient (its only path
    there is the sampled, discrete token) and the shared token table a nonzero one."""
    batch = make_batch(seed=2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def disc_grads(p):
        def disc_loss(p):
            m = nnx.merge(graphdef, p, rest)
            return electra.electra_loss(m, batch, jax.random.key(5), SETTINGS,
                                        deterministic=True)[1]["disc_loss"]

        return jax.grad(disc_loss)(p)

    grads = nnx.to_flat_state(disc_grads(params))
    generator = [(path, g) for path, g in grads if path[0] in ("generator", "generator_head")]
    assert len(generator) > 5
    for path, g in generator:
        assert not np.asarray(g).any(), path
    table = [g for path, g in grads if path[-2:] == ("token", "embedding")]
    assert len(table) == 1 and np.abs(np.asarray(table[0])).max() > 0
    head = [g for path, g in grads if path[0] == "discriminator_head"]
    assert all(np.abs(np.asarray(g)).max() > 0 for g in head)


def test_sampling_follows_the_generator_softmax():
    logits = jnp.log(jnp.array([0.0, 0, 0, 0, 0, 0, 0.5, 0.3, 0.2]) + 1e-30)
    n = 20000
    samples = electra.sample_replacements(jnp.broadcast_to(logits, (n, 9)), jax.random.key(0))
    counts = np.bincount(np.asarray(samples), minlength=9) / n
    # Standard error of a share p over 20000 draws: sqrt(p (1 - p) / n) <= 0.0036.
    np.testing.assert_allclose(counts[6:], [0.5, 0.3, 0.2], atol=4 * 0.0036)
    assert counts[:6].sum() == 0
    # Special ids are never drawn, even if the generator prefers them.
    special = jnp.zeros(9).at[token_ids.MASK_ID].set(50.0)
    assert (np.asarray(electra.sample_replacements(
        jnp.broadcast_to(special, (100, 9)), jax.random.key(1))) >= token_ids.FIRST_WORD_ID).all()


def test_selected_positions_and_prediction_count():
    selected = jnp.array([[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    positions, weights = electra.selected_positions(selected, 3)
    np.testing.assert_array_equal(positions[0, :2], [1, 3])
    np.testing.assert_array_equal(weights, [[1, 1, 0], [0, 0, 0]])
    assert len(set(np.asarray(positions[1]).tolist())) == 3  # distinct, so writes never collide
    # Enough room for what mask_tokens selects at any length.
    for length in range(1, 200):
        assert electra.num_predictions(length, 0.15) >= max(1, round(0.15 * length))


def test_generator_config_rules():
    config = tiny_electra_config.get_config()
    g = electra.GeneratorConfig.from_config(config.generator).encoder(
        EncoderConfig.from_config(config.model))
    assert g.num_layers == 1 and g.moe.num_experts == 0
    assert g.emb_dim == config.model.emb_dim and config.model.num_layers == 2
    config.generator.emb_dim = 8
    with pytest.raises(ValueError, match="emb_dim"):
        electra.GeneratorConfig.from_config(config.generator)


def test_moe_generator_adds_its_routers_to_the_objective():
    """``generator.num_experts > 0``: the generator's MoE layers report their metrics beside the
    discriminator's, their balance losses enter the objective, and the generator's routed layer
    (its experts and SparseMixer's omega) gets a gradient from the MLM loss. (Its router kernel
    may get none on a batch where the SparseMixer mask leaves every token one expert: then the
    gate is 1 and the masked probabilities one-hot, constant in the logits.)"""
    config = tiny_electra_config.get_config()
    config.generator.num_experts = 2
    config.model.activation = "gelu"
    model = build_model(config, VOCAB)
    assert model.generator.layers[0].ffn.num_experts == 2
    batch = make_batch(1)

    def loss_fn(model):
        return electra.electra_loss(model, batch, jax.random.key(3), SETTINGS)

    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model)
    assert set(metrics["moe"]) == {"generator", "discriminator"}
    per_layer = [m["balance_loss"] for net in metrics["moe"].values() for m in net.values()]
    assert len(per_layer) == 3  # generator layer 0, discriminator layers 0 and 1 (moe_every 1)
    np.testing.assert_allclose(metrics["balance_loss"], sum(per_layer), rtol=1e-6)
    np.testing.assert_allclose(
        loss, metrics["mlm_loss"] + 50 * metrics["disc_loss"] + 0.01 * metrics["balance_loss"],
        rtol=1e-5)
    ffn = grads["generator"]["layers"][0]["ffn"]
    for name in ("wi", "wo", "omega"):
        assert float(jnp.abs(ffn[name][...]).sum()) > 0, name
