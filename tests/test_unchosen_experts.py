"""DenseMixer and Default MoE: the router gradient for the experts a token did not choose.

Hand-computed backward passes on a 3-expert example (renormalised top-2 too), the MoE layer's
wiring (DenseMixer's output is Switch's without jitter bit for bit, with Switch's jitter under
successor_jitter; its expert gradients too), Default MoE's default vectors (EMA update, before
or after use, gated or not, padding, evaluation, the forward variant, an expert mesh), their
checkpointing with an exact resume, and the errors for bad or ignored router options.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import routers, training
from sparsemixer_jax.moe.unchosen import all_expert_outputs, update_expert_defaults
from sparsemixer_jax.parallel.sharding import batch_sharding, make_mesh
from sparsemixer_jax.tasks import check_config, run_config, translation
from sparsemixer_jax.training.state import restore_checkpoint
from tests import kit, tiny_wmt_config

NEW_ROUTERS = ("densemixer", "densemixer_blog", "default_moe", "default_moe_st",
               "default_moe_forward")

# --------------------------------------------------------------- the backward, by hand, N = 3

LOGITS = np.array([0.3, 1.2, -0.5])  # softmax ~ [0.25, 0.62, 0.12]; argmax 1
VALUES = np.array([[1.0, -2.0], [0.5, 1.5], [-1.0, 0.25]])  # v_j, d = 2
OUTPUTS = np.array([[2.0, 1.0], [-0.5, 3.0], [1.0, -1.0]])  # what the chosen experts output
COTANGENT = np.array([0.7, -1.3])  # dL/dy of a linear loss L = c . y


def softmax_jacobian(p):
    return np.diag(p) - np.outer(p, p)


def routed_loss(name: str, top_k: int, values: np.ndarray):
    """``L(z) = c . y`` for one token: the chosen experts' gated outputs (Switch's forward,
    no jitter) plus :func:`routers.unchosen_expert_term` with ``values``; and ``y``."""
    rule = routers.UNCHOSEN_EXPERT_RULES[name]

    def loss(z):
        routed = routers.switch_route(z, None, top_k=top_k, jitter_eps=0.0, training=False)
        expert = routed.expert if top_k > 1 else routed.expert[None]
        gate = routed.gate if top_k > 1 else routed.gate[None]
        y = gate @ jnp.asarray(OUTPUTS)[expert]
        y = y + routers.unchosen_expert_term(routed.probs, routed.expert, jnp.asarray(values),
                                             rule)
        return jnp.dot(jnp.asarray(COTANGENT), y), y

    return loss


def hand_gradient(name: str, chosen: list[int]) -> np.ndarray:
    """dL/dz from the methods' definitions, written out expert by expert."""
    p = np.exp(LOGITS) / np.exp(LOGITS).sum()
    d_pi = np.zeros(3)
    for j in range(3):
        own = COTANGENT @ OUTPUTS[j]  # the gate's ordinary gradient, chosen experts only
        stand_in = COTANGENT @ VALUES[j]  # what stands for expert j's output
        if name != "densemixer_blog":
            d_pi[j] = own if j in chosen else stand_in
        elif name == "densemixer_blog":  # (pi_j + TopK_j) v_j . c, on top of the gate's own
            d_pi[j] = (own if j in chosen else 0.0) + p[j] * stand_in
    return softmax_jacobian(p) @ d_pi


@pytest.mark.parametrize("name", NEW_ROUTERS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_backward_matches_the_hand_computed_formula(name, top_k):
    chosen = [1] if top_k == 1 else [1, 0]  # the largest logits, in order
    grad, y = jax.grad(routed_loss(name, top_k, VALUES), has_aux=True)(jnp.asarray(LOGITS))
    np.testing.assert_allclose(grad, hand_gradient(name, chosen), rtol=1e-6, atol=1e-7)
    # The forward: Switch's output, plus sum_{j unchosen} pi_j v_j only for
    # default_moe_forward.
    p = np.exp(LOGITS) / np.exp(LOGITS).sum()
    switch_y = sum(p[j] * OUTPUTS[j] for j in chosen)
    unchosen = [j for j in range(3) if j not in chosen]
    expected = switch_y + (sum(p[j] * VALUES[j] for j in unchosen)
                           if name == "default_moe_forward" else 0.0)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["densemixer", "default_moe", "default_moe_forward"])
def test_renormalised_top2_backward_matches_the_hand_computed_formula(name):
    """normalize_top_k: gates p_t / S over the chosen A = {1, 0}, S = p_1 + p_0, differentiated
    through S; an unchosen expert weighs p_j / S with S held constant (DenseMixer's code:
    ``pi (1 - mask) / S.detach() + pi mask / S``)."""
    rule = routers.UNCHOSEN_EXPERT_RULES[name]

    def loss(z):
        routed = routers.switch_route(z, None, top_k=2, jitter_eps=0.0, training=False,
                                      normalize_top_k=True)
        y = routed.gate @ jnp.asarray(OUTPUTS)[routed.expert]
        y = y + routers.unchosen_expert_term(routed.probs, routed.expert, jnp.asarray(VALUES),
                                             rule, normalize_top_k=True)
        return jnp.dot(jnp.asarray(COTANGENT), y), y

    grad, y = jax.grad(loss, has_aux=True)(jnp.asarray(LOGITS))
    p = np.exp(LOGITS) / np.exp(LOGITS).sum()
    chosen, s = [1, 0], p[1] + p[0]
    own = OUTPUTS @ COTANGENT
    mixed = sum(p[t] * own[t] for t in chosen) / s**2
    d_pi = np.array([own[j] / s - mixed if j in chosen else (VALUES[j] @ COTANGENT) / s
                     for j in range(3)])
    np.testing.assert_allclose(grad, softmax_jacobian(p) @ d_pi, rtol=1e-6, atol=1e-7)
    expected = (p[1] * OUTPUTS[1] + p[0] * OUTPUTS[0]) / s
    if name == "default_moe_forward":
        expected = expected + p[2] * VALUES[2] / s
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_switch_route_gives_no_gradient_to_unchosen_experts():
    """The baseline the new routers change: without the term, d_pi_j = 0 off the top-k."""
    def loss(z):
        routed = routers.switch_route(z, None, jitter_eps=0.0, training=False)
        return COTANGENT @ (routed.gate * jnp.asarray(OUTPUTS)[routed.expert])

    p = np.exp(LOGITS) / np.exp(LOGITS).sum()
    expected = softmax_jacobian(p) @ np.array([0.0, COTANGENT @ OUTPUTS[1], 0.0])
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(LOGITS)), expected, rtol=1e-6)


def test_straight_through_term_is_exactly_zero_and_values_get_no_gradient():
    rule = routers.UNCHOSEN_EXPERT_RULES["densemixer"]
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 5, 3)))
    expert = jnp.argmax(probs, -1)
    values = jax.random.normal(jax.random.key(1), (4, 5, 3, 6))
    term = routers.unchosen_expert_term(probs, expert, values, rule)
    assert term.shape == (4, 5, 6) and bool(jnp.all(term == 0.0))
    dv = jax.grad(lambda v: jnp.sum(routers.unchosen_expert_term(probs, expert, v, rule)
                                    * jnp.arange(6.0)))(values)
    assert bool(jnp.all(dv == 0.0))


# ------------------------------------------------------------------------------ the MoE layer

EMB, MLP, N, B, T = 8, 16, 4, 3, 5


def make_layer(router, mesh=None, **kw):
    return kit.moe_layer(EMB, MLP, N, mesh, router=router, dispatch=kw.pop("dispatch", "padded"),
                         **kw)


@pytest.fixture(scope="module")
def data():
    return kit.moe_inputs(3, (B, T, EMB), {1: 3})


@nnx.jit
def train_call(layer, x, mask, head):
    """One training forward and backward: ``(y, param grads)``; the layer's state advances."""
    def loss_fn(layer):
        y, _ = layer(x, mask)
        return jnp.sum(y * head), y

    (_, y), grads = nnx.value_and_grad(loss_fn, has_aux=True)(layer)
    return y, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("top_k", [1, 2])
def test_densemixer_forward_is_switch_bit_for_bit_and_only_the_router_gradient_changes(
        data, top_k):
    """Training mode with activation dropout on: the same draws, the same output. DenseMixer
    routes without jitter (its released code has none) whatever jitter_eps says, and with
    Switch's jitter under successor_jitter."""
    (y0, g0), (y1, g1) = (train_call(layer, *data) for layer in (
        make_layer("switch", top_k=top_k, jitter_eps=0.0),
        make_layer("densemixer", top_k=top_k, jitter_eps=0.1)))
    np.testing.assert_array_equal(y1, y0)
    for name in ("wi", "bi", "wo", "bo"):  # expert gradients come from the chosen rows only
        np.testing.assert_array_equal(g1[name], g0[name])
    assert not np.allclose(g1["router"]["kernel"], g0["router"]["kernel"])
    if top_k == 2:
        return  # the jitter's wiring is the same for both k
    (y2, _), (y3, _) = (train_call(layer, *data) for layer in (
        make_layer("switch", top_k=top_k, jitter_eps=0.5),
        make_layer("densemixer", top_k=top_k, jitter_eps=0.5,
                   router_options={"successor_jitter": True})))
    np.testing.assert_array_equal(y3, y2)
    assert not np.array_equal(y2, y0)  # the jitter moved some token's choice


def test_densemixer_router_gradient_uses_every_experts_output(data):
    """Top-1, no jitter, no dropout: dL/db_router = sum over tokens of J^T (E(x) . dL/dy), with
    E(x) every expert's output computed here from the layer's weights."""
    x, mask, head = data
    layer = make_layer("densemixer", jitter_eps=0.0, activation_dropout=0.0)
    params = tuple(p[...] for p in (layer.wi, layer.bi, layer.wo, layer.bo))
    probs = jax.nn.softmax(layer.router(x))  # [B, T, N]
    outputs = all_expert_outputs(x.reshape(B * T, EMB), params).reshape(B, T, N, EMB)
    d_pi = jnp.einsum("btne,bte->btn", outputs, head) * mask[..., None]
    jac = jax.vmap(jax.vmap(lambda p: jnp.diag(p) - jnp.outer(p, p)))(probs)
    expected = jnp.einsum("btnm,btn->m", jac, d_pi)
    _, grads = train_call(layer, x, mask, head)
    np.testing.assert_allclose(grads["router"]["bias"], expected, rtol=1e-5, atol=1e-6)


def test_default_vectors_follow_the_ema_rule_by_hand():
    defaults = jnp.array([[1.0, 1.0], [2.0, -2.0], [0.0, 4.0]])
    outputs = jnp.array([[3.0, 1.0], [1.0, 3.0], [5.0, 5.0], [100.0, 100.0]])
    group = jnp.array([0, 0, 2, 3])  # the last row reached no expert (group N)
    new = update_expert_defaults(defaults, outputs, group, 0.9)
    expected = np.array([[0.9 + 0.1 * 2.0, 0.9 + 0.1 * 2.0],  # mean of rows 0, 1 = (2, 2)
                         [2.0, -2.0],  # served no row: unchanged
                         [0.5, 0.9 * 4.0 + 0.5]])
    np.testing.assert_allclose(new, expected, rtol=1e-6)


def test_default_moe_layer_updates_its_defaults_in_training_only(data):
    x, mask, _ = data
    layer = make_layer("default_moe", top_k=2, jitter_eps=0.0, activation_dropout=0.0,
                       default_decay=0.25)
    assert layer.expert_defaults[...].shape == (N, EMB)
    np.testing.assert_array_equal(layer.expert_defaults[...], 0.0)
    # Expected after one training call from zero: (1 - 0.25) times the mean output of each
    # expert over the rows routed to it (a token's two experts are two rows; padding left out).
    params = tuple(p[...] for p in (layer.wi, layer.bi, layer.wo, layer.bo))
    outputs = all_expert_outputs(x.reshape(B * T, EMB), params).reshape(B, T, N, EMB)
    _, top2 = jax.lax.top_k(layer.router(x), 2)
    routed = jnp.sum(jax.nn.one_hot(top2, N), axis=2) * mask[..., None]  # [B, T, N]
    mean = jnp.einsum("btn,btne->ne", routed, outputs) / jnp.sum(routed, (0, 1))[:, None]
    layer(x, mask)
    after_train = np.asarray(layer.expert_defaults[...])
    np.testing.assert_allclose(after_train, 0.75 * mean, rtol=1e-5, atol=1e-6)
    layer(x, mask, deterministic=True)
    np.testing.assert_array_equal(layer.expert_defaults[...], after_train)


def test_default_vectors_agree_across_dispatches(data):
    """The EMA reads each row's expert output wherever the dispatch computed it; in capacity mode
    the dropped rows are left out (so the defaults differ from the dropless ones)."""
    x, mask, _ = data
    defaults = {}
    for dispatch in ("padded", "ragged"):
        layer = make_layer("default_moe", dispatch=dispatch, jitter_eps=0.0,
                           activation_dropout=0.0, capacity_factor=0.5)
        layer(x, mask)
        defaults[dispatch] = layer.expert_defaults[...]
    np.testing.assert_allclose(defaults["ragged"], defaults["padded"], rtol=1e-5, atol=1e-6)
    dropless = make_layer("default_moe", jitter_eps=0.0, activation_dropout=0.0)
    dropless(x, mask)
    assert not np.allclose(dropless.expert_defaults[...], defaults["padded"])


def test_default_moe_output_adds_the_defaults_only_in_the_forward_variant(data):
    x, mask, _ = data
    defaults = jax.random.normal(jax.random.key(5), (N, EMB))
    out = {}
    for name, options in (("switch", {}), ("default_moe", {}), ("default_moe_st", {}),
                          ("default_moe_forward", {}),
                          ("forward_train_only", {"default_at_eval": False})):
        router = "default_moe_forward" if name == "forward_train_only" else name
        layer = make_layer(router, activation_dropout=0.0, router_options=options)
        if name != "switch":
            layer.expert_defaults[...] = defaults
        out[name] = layer(x, mask, deterministic=True)[0]
    np.testing.assert_array_equal(out["default_moe"], out["switch"])
    np.testing.assert_array_equal(out["default_moe_st"], out["switch"])
    np.testing.assert_array_equal(out["forward_train_only"], out["switch"])
    probs = jax.nn.softmax(make_layer("switch").router(x))
    chosen = jax.nn.one_hot(jnp.argmax(probs, -1), N)
    expected = out["switch"] + ((probs * (1 - chosen)) @ defaults) * mask[..., None]
    np.testing.assert_allclose(out["default_moe_forward"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean", ["ungated", "gated"])
def test_default_update_before_use_and_gated_mean_by_hand(data, mean):
    """default_update="before": the term of this very call reads the defaults after the EMA
    took this batch in; default_mean="gated" averages gate * f instead of f."""
    x, mask, _ = data
    layer = make_layer("default_moe_forward", top_k=2, activation_dropout=0.0,
                       default_decay=0.25,
                       router_options={"default_update": "before", "default_mean": mean})
    params = tuple(p[...] for p in (layer.wi, layer.bi, layer.wo, layer.bo))
    outputs = all_expert_outputs(x.reshape(B * T, EMB), params).reshape(B, T, N, EMB)
    probs = jax.nn.softmax(layer.router(x))
    _, top2 = jax.lax.top_k(probs, 2)
    routed = jnp.sum(jax.nn.one_hot(top2, N), axis=2) * mask[..., None]  # [B, T, N]
    weight = routed * probs if mean == "gated" else routed
    ema = 0.75 * jnp.einsum("btn,btne->ne", weight, outputs) / jnp.sum(routed, (0, 1))[:, None]
    switch_y = jnp.einsum("btn,btne->bte", routed * probs, outputs)
    expected = switch_y + ((probs * (1 - routed)) @ ema) * mask[..., None]
    y, _ = layer(x, mask)
    np.testing.assert_allclose(layer.expert_defaults[...], ema, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["densemixer", "default_moe"])
def test_expert_mesh_equals_one_device(name, data):
    x, mask, head = data
    # A batch of 8 (the mesh splits it 8 ways): the fixture's 3 rows, repeated.
    x, mask, head = (jnp.concatenate([a, a, a])[:8] for a in (x, mask, head))
    ref = make_layer(name, top_k=2)
    y0, g0 = train_call(ref, x, mask, head)
    mesh = make_mesh(2, 4)
    layer = make_layer(name, mesh, top_k=2)
    y1, g1 = train_call(layer, *(jax.device_put(a, batch_sharding(mesh)) for a in (x, mask, head)))
    chex.assert_trees_all_close(y1, y0, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(g1, g0, rtol=1e-4, atol=1e-6)
    if name == "default_moe":
        np.testing.assert_allclose(layer.expert_defaults[...], ref.expert_defaults[...],
                                   rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1, 1.5])
def test_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match=r"default_decay must lie in \(0, 1\)"):
        make_layer("default_moe", default_decay=decay)
    config = tiny_wmt_config.get_config()
    config.router.name = "default_moe"
    config.router.default_decay = decay
    with pytest.raises(ValueError, match=r"config.router.default_decay must lie in \(0, 1\)"):
        check_config(config)


@pytest.mark.parametrize(("router", "options", "message"), [
    ("switch", {"default_mean": "gated"}, r"default_mean='gated' has no effect on router "
                                          r"'switch'"),
    ("default_moe", {"default_at_eval": False}, r"default_at_eval=False has no effect"),
    ("sparsemixer", {"normalize_top_k": True}, r"normalize_top_k=True has no effect"),
    ("densemixer_blog", {"normalize_top_k": True}, r"normalize_top_k=True has no effect"),
    ("switch", {"successor_jitter": True}, r"successor_jitter=True has no effect"),
    ("default_moe", {"default_update": "during"}, r"default_update='during'; choose one of"),
    ("default_moe", {"normalise_top_k": True}, r"unknown router option\(s\) \['normalise_top_k'\]"),
])
def test_router_options_a_router_ignores_are_refused(router, options, message):
    with pytest.raises(ValueError, match=message):
        routers.get_router(router, **options)
    with pytest.raises(ValueError, match=message):
        make_layer(router, router_options=options)
    config = tiny_wmt_config.get_config()
    config.router.name = router
    if "normalise_top_k" in options:  # a config cannot hold an unknown field
        return
    config.router.update(options)
    with pytest.raises(ValueError, match="config.router." + message):
        check_config(config)


def test_routers_are_in_the_registry():
    for name in NEW_ROUTERS:
        assert name in routers.ROUTERS and not routers.uses_omega(name)
    with pytest.raises(ValueError, match="unknown router"):
        routers.get_router("densemixr")


# ------------------------------------------------------------- checkpoints and an exact resume


def tiny(**overrides):
    config = tiny_wmt_config.get_config()
    config.router.name = "default_moe"
    config.decode.test_bleu = False
    config.update_from_flattened_dict(overrides)
    return config


def last_state(workdir, config):
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    restored = restore_checkpoint(workdir, steps.abstract_state(), "last")
    return jax.tree.map(np.asarray, restored.state), restored.meta


def test_default_vectors_are_checkpointed_and_resumed_exactly(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    reference = translation.train_and_evaluate(tiny(train_steps=2), straight)
    translation.train_and_evaluate(tiny(train_steps=1), resumed)
    again = translation.train_and_evaluate(tiny(train_steps=2), resumed)
    assert again["valid_loss"] == reference["valid_loss"]
    state, meta = last_state(resumed, tiny())
    expected, _ = last_state(straight, tiny())
    assert meta["step"] == 2
    defaults = jax.tree.leaves(state.layer_state)
    assert defaults and all(np.abs(d).sum() > 0 for d in defaults)  # trained, not the zero init
    jax.tree.map(np.testing.assert_array_equal, state, expected)
