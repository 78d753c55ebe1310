"""The routing options: sigmoid scores, bias balancing, the balance loss's scope, group-limited
routing and shared experts (docs/routing.md, "Routing options").

The router functions against the gradient of their forward written out (the exact gradient of a
deterministic selection), SparseMixer with groups against the exact-gradient oracle (Monte
Carlo), the layer under every dispatch and an expert mesh, the bias step after an update summed
over micro-batches, an exact resume with the bias state, and the one-line refusals.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.exact_experiment import grouped_probs_fn
from sparsemixer_jax import exact as oracle
from sparsemixer_jax import routers, training
from sparsemixer_jax.moe import MoEConfig, MoEFeedForward, end_of_update
from sparsemixer_jax.parallel.sharding import batch_sharding, make_mesh, shard_state
from sparsemixer_jax.tasks import check_config, run_config, translation
from sparsemixer_jax.training import steps as training_steps
from sparsemixer_jax.training.checkpoint import RunCheckpoints
from sparsemixer_jax.training.config import moe_model_fields, router_config
from sparsemixer_jax.training.optim import OptimSettings
from sparsemixer_jax.training.state import restore_checkpoint
from tests import kit, tiny_wmt_config

N, EMB, MLP = 8, 8, 16
LOGITS = jnp.array([[0.3, 1.2, -0.5, 0.8, 0.1, -1.0, 0.6, 0.4],
                    [1.5, -0.2, 0.7, 0.0, 0.9, 0.2, -0.4, 1.1]])
COTANGENT = jnp.array([[0.7, -1.3, 0.2, 0.5, -0.9, 1.1, 0.3, -0.4]] * 2)  # per chosen expert


# ------------------------------------------------------------------ the routers, by their forward


def _explicit_gradient(gates_of, expert):
    """The gradient of ``sum_t c_{D_t} gate_t(z)`` with the chosen experts ``D`` held fixed: the
    exact gradient of a deterministic top-k forward wherever its selection is locally constant."""
    def loss(z):
        gate = gates_of(z)
        return jnp.sum(gate * jnp.take_along_axis(COTANGENT, expert, axis=-1))
    return jax.grad(loss)(LOGITS)


def _router_gradient(config, bias=None):
    route = routers.router_fn(config.check("", N))
    out = route(LOGITS, None, False, bias)

    def loss(z):
        routed = route(z, None, False, bias)
        return jnp.sum(routed.gate * jnp.take_along_axis(COTANGENT, routed.expert, axis=-1))
    return out, jax.grad(loss)(LOGITS)


@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_bias_moves_the_selection_only(normalize):
    """The bias picks the experts (on the logits); the gates stay softmax(z) at them and the
    gradient is the exact gradient of that forward at the biased selection."""
    bias = jnp.zeros(N).at[5].set(10.0)  # expert 5 (lowest logit of token 0) is always chosen
    config = routers.RouterConfig("switch", top_k=2, jitter_eps=0.0, normalize_top_k=normalize)
    out, grad = _router_gradient(config, bias)
    expected_expert = jax.lax.top_k(LOGITS + bias, 2)[1]
    np.testing.assert_array_equal(out.expert, expected_expert)
    assert np.all(np.asarray(out.expert)[:, 0] == 5)

    def gates_of(z):
        gate = jnp.take_along_axis(jax.nn.softmax(z), expected_expert, axis=-1)
        return gate / jnp.sum(gate, -1, keepdims=True) if normalize else gate
    np.testing.assert_allclose(out.gate, gates_of(LOGITS), rtol=1e-6)
    np.testing.assert_allclose(grad, _explicit_gradient(gates_of, expected_expert), rtol=1e-5,
                               atol=1e-7)
    plain, _ = _router_gradient(config)
    assert not np.array_equal(plain.expert, out.expert)


def test_sigmoid_scores_select_with_bias_and_renormalise_with_the_scale():
    bias = jnp.linspace(-0.3, 0.3, N)
    config = routers.RouterConfig("switch", top_k=3, jitter_eps=0.0, score="sigmoid",
                                  routed_scaling_factor=2.5)
    out, grad = _router_gradient(config, bias)
    scores = jax.nn.sigmoid(LOGITS)
    expected_expert = jax.lax.top_k(scores + bias, 3)[1]
    np.testing.assert_array_equal(out.expert, expected_expert)

    def gates_of(z):
        s = jnp.take_along_axis(jax.nn.sigmoid(z), expected_expert, axis=-1)
        return 2.5 * s / jnp.sum(s, -1, keepdims=True)
    np.testing.assert_allclose(out.gate, gates_of(LOGITS), rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(out.gate, -1), 2.5, rtol=1e-6)
    np.testing.assert_allclose(grad, _explicit_gradient(gates_of, expected_expert), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(out.probs, scores / scores.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(out.scores, scores, rtol=1e-6)


def test_groups_limit_the_choice_to_the_best_groups():
    """Groups of 2, one kept: the group of the token's best logit; its two experts are chosen
    where the ungrouped choice would take the second from another group."""
    config = routers.RouterConfig("switch", top_k=2, jitter_eps=0.0, num_groups=4, top_groups=1)
    out, grad = _router_gradient(config)
    assert np.asarray(out.expert).tolist() == [[1, 0], [0, 1]]
    assert np.asarray(jax.lax.top_k(LOGITS, 2)[1]).tolist() == [[1, 3], [0, 7]]
    keep = jnp.array([[1, 1, 0, 0, 0, 0, 0, 0]] * 2, bool)
    np.testing.assert_array_equal(routers.limit_to_groups(LOGITS, 4, 1),
                                  jnp.where(keep, LOGITS, -jnp.inf))
    # Groups 0 and 3 of token 1 (best logits 1.5 and 1.1) when two are kept.
    two = np.isfinite(np.asarray(routers.limit_to_groups(LOGITS, 4, 2)))
    assert two[1].tolist() == [True, True, False, False, False, False, True, True]

    def gates_of(z):
        return jnp.take_along_axis(jax.nn.softmax(z), out.expert, axis=-1)
    np.testing.assert_allclose(out.gate, gates_of(LOGITS), rtol=1e-6)
    np.testing.assert_allclose(grad, _explicit_gradient(gates_of, out.expert), rtol=1e-5,
                               atol=1e-7)


def test_dense_term_under_sigmoid_weights_unchosen_experts_by_the_renormalised_scores():
    """DenseMixer under sigmoid scores: pi_j of an unchosen expert becomes the gate it would
    have, ``scale * s_j / S`` with ``S`` (the chosen scores' sum) held constant."""
    z = LOGITS[0]
    values = jax.random.normal(jax.random.key(1), (N, 3))
    c = jnp.array([0.4, -1.0, 0.6])
    config = routers.RouterConfig("densemixer", top_k=2, jitter_eps=0.0, score="sigmoid",
                                  routed_scaling_factor=2.0).check("", N)

    def term_grad(z):
        routed = routers.router_fn(config)(z, None, False)
        term = routers.unchosen_expert_term(routed.scores, routed.expert, values,
                                            config.unchosen, normalize_top_k=config.renormalises)
        return jnp.dot(c, 2.0 * term)
    s = jax.nn.sigmoid(z)
    chosen = np.asarray(jax.lax.top_k(s, 2)[1])
    total = float(s[chosen].sum())
    by_hand = np.zeros(N)
    for j in set(range(N)) - set(chosen.tolist()):
        # d/dz_j of 2 s_j / S (S constant) times v_j . c
        by_hand[j] = 2.0 * float(s[j] * (1 - s[j])) / total * float(values[j] @ c)
    np.testing.assert_allclose(jax.grad(term_grad)(z), by_hand, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------ SparseMixer with groups: the oracle

MC_SAMPLES = 40_000
Z_SE = 4.5


def test_sparsemixer_with_groups_matches_the_oracle_expectation():
    """Mean of 40k top-2 SparseMixer gradients under group-limited routing (N = 6 in 3 groups,
    2 kept) against the enumerated expectation with those groups' experts alone
    (oracle.topk_expected_gradient), within 4.5 standard errors per component; the
    expectation without groups is far off (the test has power)."""
    problem = oracle.random_problem(jax.random.key(3), num_experts=6, dim=3)
    problem = problem._replace(logits=jnp.array([1.0, 0.2, 0.9, 0.95, -0.5, 0.3]),
                               expert_outputs=2 * problem.expert_outputs)
    config = routers.RouterConfig("sparsemixer", top_k=2, jitter_eps=0.5, num_groups=3,
                                  top_groups=2).check("", 6)
    route = routers.router_fn(config)

    def total(z_batch):
        out = route(z_batch, jax.random.key(11), True)
        y = jnp.einsum("tk,tkd->td", out.gate, problem.expert_outputs[out.expert])
        return jnp.sum(jax.vmap(problem.downstream)(y))

    z_batch = jnp.broadcast_to(problem.logits, (MC_SAMPLES, 6))
    grads = np.asarray(jax.jit(jax.grad(total))(z_batch), np.float64)
    mean, se = grads.mean(0), grads.std(0, ddof=1) / np.sqrt(MC_SAMPLES)

    def probs_fn(z):
        return routers.router_probs(z, 0.5)

    grouped = grouped_probs_fn(probs_fn, problem.logits, 3, 2)

    @jax.jit
    def expectations(problem):
        return (oracle.topk_expected_gradient(problem, grouped, 2),
                oracle.topk_expected_gradient(problem, probs_fn, 2))

    expected, ungrouped = (np.asarray(g) for g in expectations(problem))
    live = se > 0
    assert not live[4] and not live[5]  # group 2 (experts 4, 5) is never kept here
    np.testing.assert_array_equal(mean[~live], expected[~live])
    z_scores = np.abs(mean - expected)[live] / se[live]
    assert np.all(z_scores < Z_SE), f"z-scores {z_scores}, SE {se}"
    assert np.max(np.abs(ungrouped - expected)[live] / se[live]) > 2 * Z_SE


# SparseMixer top-1 with a selection bias, through the config (its estimator against the oracle:
# tests/test_routing.py). The bias moves token 0's argmax from expert 1 to expert 3.
SM_BIAS = jnp.array([0.0, -0.2, 0.1, 0.6, 0.2, 0.0, -0.1, 0.0])
_sm_bias_route = routers.router_fn(routers.RouterConfig(
    "sparsemixer", jitter_eps=0.5, bias_update_rate=0.01).check("", N))


def _sm_bias_loss(z, key, bias):
    out = _sm_bias_route(z, key, True, bias)
    return jnp.sum(out.gate * jnp.take_along_axis(COTANGENT, out.expert[..., None],
                                                  -1)[..., 0]), out


# One compilation per input dtype and transform: the routing and its gradient together.
_sm_bias_grad_and_route = jax.jit(jax.grad(_sm_bias_loss, has_aux=True))
_sm_bias_eval = jax.jit(lambda z, bias: _sm_bias_route(z, None, False, bias))


def test_sparsemixer_with_bias_under_jit_vmap_and_bf16_logits():
    keys = jax.random.split(jax.random.key(4), 3)
    grad, out = _sm_bias_grad_and_route(LOGITS, keys[0], SM_BIAS)
    q, pi = routers.selection_probs(LOGITS, SM_BIAS, 0.5)
    np.testing.assert_array_equal(out.probs, pi)
    ratio = np.asarray(out.gate / jnp.take_along_axis(pi, out.expert[:, None], -1)[:, 0])
    assert set(ratio.tolist()) <= {1.0, 0.5}, ratio  # w pi_D: Euler or mid-point branch
    assert np.all(np.take_along_axis(np.asarray(q), np.asarray(out.expert)[:, None], -1) > 0)
    assert np.all(np.asarray(jnp.abs(grad).max(-1)) > 0)
    # vmap over keys: each key's draws as in its own call; values to float32 rounding (the
    # batched program may fuse and reassociate differently: 1 ulp seen).
    batched = jax.vmap(_sm_bias_grad_and_route, in_axes=(None, 0, None))(LOGITS, keys, SM_BIAS)
    for i, key in enumerate(keys):
        alone = _sm_bias_grad_and_route(LOGITS, key, SM_BIAS)
        np.testing.assert_array_equal(batched[1].expert[i], alone[1].expert)
        chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], batched), alone,
                                    rtol=1e-6, atol=1e-7)
    # bf16 logits route in float32, as their float32 cast does; the gradient comes back in bf16.
    low = LOGITS.astype(jnp.bfloat16)
    low_grad, low_out = _sm_bias_grad_and_route(low, keys[0], SM_BIAS)
    chex.assert_trees_all_equal(
        low_out, _sm_bias_grad_and_route(low.astype(jnp.float32), keys[0], SM_BIAS)[1])
    assert low_grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(low_grad, float)))
    # Evaluation, eager and under jit: the argmax of z + b, gate pi_D, no key.
    evaluated = _sm_bias_route(LOGITS, None, False, SM_BIAS)
    chex.assert_trees_all_equal(evaluated, _sm_bias_eval(LOGITS, SM_BIAS))
    top = jnp.argmax(LOGITS + SM_BIAS, -1)
    np.testing.assert_array_equal(evaluated.expert, top)
    np.testing.assert_array_equal(evaluated.gate, jnp.take_along_axis(pi, top[:, None], -1)[:, 0])
    assert int(evaluated.expert[0]) == 3 and int(jnp.argmax(LOGITS[0])) == 1


def test_sparsemixer_with_bias_and_groups_chooses_groups_on_the_biased_logits():
    """Token 0's best logit is in group 0 (experts 0-3); a bias of +3 on expert 5 makes group 1
    the best on z + b, so every draw, in training and evaluation, lies in group 1."""
    route = routers.router_fn(routers.RouterConfig(
        "sparsemixer", jitter_eps=0.5, bias_update_rate=0.01, num_groups=2,
        top_groups=1).check("", N))
    bias = jnp.zeros(N).at[5].set(3.0)
    z = jnp.broadcast_to(LOGITS[0], (256, N))
    for is_training in (True, False):
        out = route(z, jax.random.key(5), is_training, bias)
        assert np.all(np.asarray(out.expert) >= 4), np.unique(out.expert)
        np.testing.assert_array_equal(np.asarray(out.probs)[:, :4], 0.0)


# ------------------------------------------------------------------------------ the MoE layer

OPTIONS = {  # router fields, the layer's shared experts
    "sigmoid_bias_groups_global": (dict(name="switch", top_k=2, score="sigmoid",
                                        routed_scaling_factor=2.0, bias_update_rate=0.01,
                                        num_groups=4, top_groups=2, balance_scope="global_batch"),
                                   2),
    "densemixer_sequence": (dict(name="densemixer", top_k=2, balance_scope="sequence"), 1),
    "default_moe_bias": (dict(name="default_moe", top_k=2, bias_update_rate=0.01), 0),
    "sparsemixer_groups_global": (dict(name="sparsemixer_v2", top_k=2, num_groups=2,
                                       top_groups=1, balance_scope="global_batch"), 1),
    "sparsemixer_bias_groups": (dict(name="sparsemixer_v2star", top_k=2, bias_update_rate=0.01,
                                     num_groups=2, top_groups=1), 0),
    "sparsemixer_sigmoid_bias_groups": (dict(name="sparsemixer", top_k=2, score="sigmoid",
                                             routed_scaling_factor=2.5, bias_update_rate=0.01,
                                             num_groups=2, top_groups=1,
                                             group_score="top2_sum"), 0),
}


def make_layer(option: str, dispatch: str = "ragged", mesh=None) -> MoEFeedForward:
    router, shared = OPTIONS[option]
    moe = MoEConfig(num_experts=N, dispatch=dispatch, grouped_impl="xla",
                    activation_dropout=0.0, num_shared_experts=shared,
                    shared_expert_gate=shared == 1).check()
    layer = MoEFeedForward((EMB, MLP), moe, routers.RouterConfig(**router), mesh=mesh,
                           rngs=nnx.Rngs(params=0, router=2))
    if mesh is not None:
        shard_state(layer, mesh)
    if layer.expert_bias is not None:  # a trained-looking bias, so that it changes choices
        layer.expert_bias[...] = 0.3 * jnp.sin(jnp.arange(N, dtype=jnp.float32))
    return layer


@pytest.fixture(scope="module")
def data():
    return kit.moe_inputs(0, (8, 6, EMB), {1: 3, 5: 0})


@nnx.jit
def train_call(layer, x, mask, head):
    """``(y, grads, balance_loss)`` of ``sum(y * head) + balance_loss`` in training."""
    def loss_fn(layer):
        y, metrics = layer(x, mask)
        return jnp.sum(y * head) + metrics["balance_loss"], (y, metrics["balance_loss"])
    (_, (y, balance)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(layer)
    return y, nnx.to_pure_dict(grads), balance


def _references(option, data, cache={}):  # noqa: B006 - the module's shared reference runs
    if option not in cache:
        layer = make_layer(option)
        cache[option] = layer, train_call(layer, *data)
    return cache[option]


def check_layout_agrees(option, layout, data):
    """The layer with ``option`` under dispatch ``layout`` (or ``"mesh"``: ragged on a 2 x 4
    data x expert mesh) gives the ragged single-device layer's output, gradients, balance loss
    and loads."""
    x, mask, head = data
    ref, expected = _references(option, data)
    assert np.all(np.asarray(expected[0])[5] == 0)  # padding outputs zeros, shared experts too
    if layout == "mesh":
        mesh = make_mesh(2, 4)
        layer = make_layer(option, mesh=mesh)
        got = train_call(layer, *(jax.device_put(a, batch_sharding(mesh))
                                  for a in (x, mask, head)))
    else:
        layer = make_layer(option, layout)
        got = train_call(layer, x, mask, head)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    if ref.expert_load is not None:  # the loads bias balancing reads: the same on 8 devices
        np.testing.assert_array_equal(layer.expert_load[...], ref.expert_load[...])
        top_k = ref.router_config.top_k
        assert float(jnp.sum(ref.expert_load[...])) == top_k * float(jnp.sum(mask))


def test_sparsemixer_layer_trains_with_bias_balancing(data):
    """The layer with top-2 SparseMixer-v2* and bias balancing: finite output and gradients,
    and the loads count two rows per token."""
    layer, (y, grads, _) = _references("sparsemixer_bias_groups", data)
    assert np.all(np.isfinite(np.asarray(y)))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.sum(layer.expert_load[...])) == 2 * float(jnp.sum(data[1]))
    assert float(jnp.max(jnp.abs(grads["router"]["kernel"]))) > 0


def test_sparsemixer_layer_trains_with_sigmoid_scores(data):
    """The layer with top-2 SparseMixer under sigmoid scores, bias balancing and groups chosen
    on the biased scores: finite output and gradients, a router gradient, two rows per token."""
    layer, (y, grads, _) = _references("sparsemixer_sigmoid_bias_groups", data)
    assert np.all(np.isfinite(np.asarray(y)))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.sum(layer.expert_load[...])) == 2 * float(jnp.sum(data[1]))
    assert float(jnp.max(jnp.abs(grads["router"]["kernel"]))) > 0


@pytest.mark.parametrize("layout", ["padded", "mesh"])
def test_every_option_at_once_agrees_across_dispatches_and_an_expert_mesh(layout, data):
    check_layout_agrees("sigmoid_bias_groups_global", layout, data)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "grouped", "mesh"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_agrees_across_dispatches_and_an_expert_mesh(option, layout, data):
    check_layout_agrees(option, layout, data)


@nnx.jit(static_argnames="deterministic")
def forward(layer, x, mask, deterministic=False):
    return layer(x, mask, deterministic=deterministic)


def test_balance_scopes_by_hand(data):
    """Sequence: the mean of each sequence's loss; global batch: the fractions of the loads
    counted so far (this call included), the probabilities of this call."""
    x, mask, _ = data
    m = np.asarray(mask)
    layer = make_layer("densemixer_sequence")
    _, metrics = forward(layer, x, mask)
    probs = np.asarray(jax.nn.softmax(layer.router(x)))
    top2 = np.argsort(-probs, axis=-1)[..., :2]
    per_sequence = []
    for b in range(8):
        if m[b].any():
            share = np.zeros(N)
            for t in np.flatnonzero(m[b]):
                share[top2[b, t]] += 0.5
            fraction, mean_prob = share / m[b].sum(), probs[b][m[b]].mean(0)
            per_sequence.append(N * np.sum(fraction * mean_prob))
    np.testing.assert_allclose(metrics["balance_loss"], np.mean(per_sequence), rtol=1e-5)

    layer = make_layer("sparsemixer_groups_global")
    forward(layer, x, mask)
    load_1 = np.asarray(layer.expert_load[...]).copy()
    _, metrics = forward(layer, x[::-1], mask[::-1])
    load_2 = np.asarray(layer.expert_load[...])
    assert load_2.sum() == 2 * load_1.sum() == 2 * 2 * m.sum()
    probs = routers.router_probs(routers.limit_to_groups(layer.router(x[::-1]), 2, 1), 0.1)
    mean_prob = np.asarray(probs)[m[::-1]].mean(0)
    np.testing.assert_allclose(metrics["balance_loss"],
                               N * np.sum(load_2 / load_2.sum() * mean_prob), rtol=1e-5)
    _, evaluated = forward(layer, x, mask, deterministic=True)
    np.testing.assert_array_equal(layer.expert_load[...], load_2)  # evaluation counts nothing
    assert np.isfinite(evaluated["balance_loss"])


def test_end_of_update_steps_the_bias_and_resets_the_loads():
    load = jnp.array([[5.0, 1.0, 3.0, 3.0], [0.0, 0.0, 8.0, 4.0]])  # stacked layers
    state = {"a": {"expert_load": load, "expert_bias": jnp.ones((2, 4))},
             "b": {"expert_load": jnp.ones(4)}}
    out = end_of_update(state, ((("a",), 0.5), (("b",), 0.0)))
    np.testing.assert_array_equal(out["a"]["expert_bias"],
                                  [[0.5, 1.5, 1.0, 1.0], [1.5, 1.5, 0.5, 0.5]])
    np.testing.assert_array_equal(out["a"]["expert_load"], np.zeros((2, 4)))
    np.testing.assert_array_equal(out["b"]["expert_load"], np.zeros(4))
    assert "expert_bias" not in out["b"]


# ---------------------------------------------------------- training: the bias step and resume


class OneLayer(nnx.Module):
    """A model of one MoE layer with every option (``sigmoid_bias_groups_global``)."""

    def __init__(self):
        self.moe = make_layer("sigmoid_bias_groups_global")


@dataclasses.dataclass(frozen=True)
class SquaredError:
    """The steps' task: squared error of the layer's output against ``y``, plus the balance
    loss; randomness (the router's jitter) from the step's key."""

    def loss(self, model, batch, key):
        nnx.reseed(model, router=key)
        y, metrics = model.moe(batch["x"], batch["mask"])
        error = jnp.sum((y - batch["y"]) ** 2)
        return error + metrics["balance_loss"], {"error": error, "rows": jnp.ones(())}

    def summarize(self, sums):
        return sums["rows"], {"loss": sums["error"] / sums["rows"]}


def micro_batches(seed):
    x, mask, y = kit.moe_inputs(seed, (4, 6, EMB), {1: 3})
    return [{"x": x[:2], "mask": mask[:2], "y": y[:2]}, {"x": x[2:], "mask": mask[2:], "y": y[2:]}]


@pytest.fixture(scope="module")
def one_layer_steps():
    return training_steps.Steps(OneLayer(), SquaredError(), OptimSettings(peak_lr=1e-2))


def test_the_bias_moves_after_each_update_by_the_loads_summed_over_micro_batches(
        one_layer_steps):
    steps = one_layer_steps
    assert steps.balance == ((("moe",), 0.01),)
    state = jax.tree.map(jnp.copy, steps.init_state())
    key, batches = jax.random.key(5), micro_batches(0)
    acc, layer_state = steps.zeros(state, batches[0]), state.layer_state
    loads = []
    for j, b in enumerate(batches):
        acc, layer_state = steps.accumulate(state.replace(layer_state=layer_state), acc, b,
                                            jax.random.fold_in(key, j))
        loads.append(np.asarray(layer_state["moe"]["expert_load"]))
    assert loads[0].sum() == 2 * (6 + 3) and loads[1].sum() == loads[0].sum() + 2 * 12  # rows
    start = np.asarray(state.layer_state["moe"]["expert_bias"])
    new, metrics = steps.train_step(state, batches, key)
    assert bool(metrics["finite"])
    np.testing.assert_array_equal(new.layer_state["moe"]["expert_load"], np.zeros(N))
    step = 0.01 * np.sign(loads[1].mean() - loads[1]).astype(np.float32)
    assert np.any(step != 0)
    np.testing.assert_array_equal(new.layer_state["moe"]["expert_bias"], start + step)
    # The optimizer never sees the bias: it is no parameter.
    assert "expert_bias" not in str(jax.tree_util.tree_structure(new.params))


def test_bias_state_is_checkpointed_and_resumed_exactly(one_layer_steps, tmp_path):
    """Two updates straight equal one update, a checkpoint written and read back, and one
    more, bit for bit: parameters, optimizer state and the bias state."""
    steps, key = one_layer_steps, jax.random.key(9)
    straight = jax.tree.map(jnp.copy, steps.init_state())
    for i in range(2):
        straight, _ = steps.train_step(straight, micro_batches(i), jax.random.fold_in(key, i))
    resumed, _ = steps.train_step(jax.tree.map(jnp.copy, steps.init_state()), micro_batches(0),
                                  jax.random.fold_in(key, 0))
    checkpoints = RunCheckpoints(str(tmp_path))
    checkpoints.save_last(1, resumed, {"step": 1})
    checkpoints.close()
    resumed = restore_checkpoint(str(tmp_path), steps.abstract_state(), "last").state
    resumed, _ = steps.train_step(resumed, micro_batches(1), jax.random.fold_in(key, 1))
    bias = np.asarray(straight.layer_state["moe"]["expert_bias"])
    assert np.any(bias != np.asarray(make_layer("sigmoid_bias_groups_global").expert_bias[...]))
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def tiny(**overrides):
    """The tiny translation run (two micro-batches per update) with every option on."""
    config = tiny_wmt_config.get_config()
    config.router.update(name="switch", top_k=2, score="sigmoid", bias_update_rate=0.05,
                         balance_scope="global_batch", num_groups=2, top_groups=1)
    config.model.update(num_experts=4, num_shared_experts=1, shared_expert_gate=True)
    config.decode.test_bleu = False
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.slow
def test_translation_training_resumes_the_bias_state_exactly(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    reference = translation.train_and_evaluate(tiny(train_steps=2), straight)
    translation.train_and_evaluate(tiny(train_steps=1), resumed)
    again = translation.train_and_evaluate(tiny(train_steps=2), resumed)
    assert again["valid_loss"] == reference["valid_loss"]
    steps = training.build_steps(run_config(tiny()), tiny().data.vocab_size)
    assert len(steps.balance) == 2  # the encoder's and the decoder's MoE layers
    state = restore_checkpoint(resumed, steps.abstract_state(), "last").state
    expected = restore_checkpoint(straight, steps.abstract_state(), "last").state
    jax.tree.map(np.testing.assert_array_equal, state, expected)


# ------------------------------------------------------------------------------------ config


def test_every_config_section_has_the_options_with_their_defaults():
    router = router_config()
    assert (router.score, router.routed_scaling_factor, router.bias_update_rate,
            router.balance_scope, router.num_groups, router.top_groups) == (
        "softmax", 1.0, 0.0, "micro_batch", 1, 1)
    model = moe_model_fields(type(router)())
    assert (model.num_shared_experts, model.shared_expert_gate) == (0, False)
    for task in ("translation", "pretraining"):
        config = kit.tiny_config(task)
        assert config.router.bias_update_rate == 0.0 and config.model.num_shared_experts == 0


@pytest.mark.parametrize("overrides, message", [
    ({"router.bias_update_rate": -0.1}, r"config.router.bias_update_rate must be a finite"),
    ({"router.bias_update_rate": float("nan")}, r"config.router.bias_update_rate must be"),
    ({"router.balance_scope": "batch"}, r"config.router.balance_scope='batch'; choose one of"),
    ({"router.score": "tanh"}, r"config.router.score='tanh'; choose one of"),
    ({"router.num_groups": 3}, r"config.router.num_groups=3 does not divide num_experts=2"),
    ({"router.top_groups": 2}, r"config.router.top_groups must be an int in \[1, num_groups=1\]"),
    ({"router.num_groups": 2, "router.top_k": 2},
     r"config.router.top_groups=1 groups of 1 experts hold fewer than top_k=2"),
    ({"model.num_experts": 0, "model.num_shared_experts": 1},
     r"config.model.num_shared_experts=1 needs routed experts"),
    ({"model.num_shared_experts": -1}, r"config.model.num_shared_experts must be an int >= 0"),
    ({"model.shared_expert_gate": True}, r"config.model.shared_expert_gate=True has no effect"),
    ({"router.name": "switch", "router.score": "sigmoid"},
     r"config.router.score='sigmoid' needs top_k >= 2 with router 'switch'"),
    ({"router.name": "switch", "router.routed_scaling_factor": 2.0},
     r"config.router.routed_scaling_factor=2.0 has no effect with score='softmax'"),
    ({"router.name": "densemixer_blog", "router.score": "sigmoid", "router.top_k": 2},
     r"config.router.score='sigmoid' does not compose with router 'densemixer_blog'"),
])
def test_bad_options_are_refused_in_one_line(overrides, message):
    config = tiny_wmt_config.get_config()
    config.update_from_flattened_dict(overrides)
    with pytest.raises(ValueError, match=message) as err:
        check_config(config)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # a whole LM's compilation; test_end_of_update_... steps stacked layers
def test_decoder_lm_counts_loads_through_its_layer_scan():
    """A Hugging Face type (qwen2_moe, tests/data) with the router options: each stacked MoE
    layer counts its own loads through the scan, and the update's bias step reads them."""
    from sparsemixer_jax import hf
    from sparsemixer_jax.moe import balance_plan

    model, config = hf.load_pretrained(
        "tests/data/hf/qwen2_moe", router_options=(
            ("balance_scope", "global_batch"), ("bias_update_rate", 0.01), ("score", "sigmoid")))
    plan = balance_plan(model)
    assert [rate for _, rate in plan] == [0.01]
    model.train()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 8)), jnp.int32)
    nnx.jit(lambda m, ids: m(ids))(model, ids)
    state = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    load = np.asarray(_at(state, plan[0][0])["expert_load"])
    repeats = load.shape[0]
    np.testing.assert_array_equal(load.sum(-1), [2 * 8 * config.top_k] * repeats)
    stepped = _at(end_of_update(state, plan), plan[0][0])
    np.testing.assert_array_equal(stepped["expert_bias"],
                                  0.01 * np.sign(load.mean(-1, keepdims=True) - load))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.slow  # ELECTRA's compilation; the one-layer steps tests are its fast counterpart
def test_electra_generator_and_discriminator_take_the_options():
    """ELECTRA with every option: both networks' MoE layers count their loads (one row per
    token and expert, padding left out), their balance losses enter the objective, and the
    update's bias step finds every layer."""
    from sparsemixer_jax import token_ids
    from sparsemixer_jax.models import electra
    from sparsemixer_jax.moe import balance_plan
    from tests import tiny_electra_config
    from tests.test_electra import SETTINGS, VOCAB, build_model, make_batch

    config = tiny_electra_config.get_config()
    config.generator.num_experts = 2
    config.router.update(name="default_moe", top_k=2, bias_update_rate=0.01,
                         balance_scope="sequence")
    config.model.update(num_shared_experts=1, shared_expert_gate=True)
    model = build_model(config, VOCAB)
    plan = balance_plan(model)
    assert len(plan) == 3  # generator layer 0, discriminator layers 0 and 1
    batch = make_batch(1)
    _, metrics = nnx.jit(electra.electra_loss, static_argnums=(3,))(
        model, batch, jax.random.key(3), SETTINGS)
    assert np.isfinite(float(metrics["balance_loss"]))
    state = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    tokens = int(np.sum(np.asarray(batch["tokens"]) != token_ids.PAD_ID))
    for path, _ in plan:
        assert float(np.sum(_at(state, path)["expert_load"])) == 2 * tokens, path


def test_top2_sum_scores_a_group_by_its_two_best():
    """Group 0 holds the best expert (0.9) but group 1 the best pair (0.8 + 0.7 > 0.9 + 0.1):
    max keeps group 0, top2_sum (DeepSeek-V3, GLM-4.5) group 1."""
    from sparsemixer_jax.routers import limit_to_groups

    scores = jnp.asarray([[0.9, 0.1, 0.8, 0.7]])
    by_max = np.asarray(limit_to_groups(scores, 2, 1, "max"))
    by_sum = np.asarray(limit_to_groups(scores, 2, 1, "top2_sum"))
    np.testing.assert_array_equal(np.isinf(by_max), [[False, False, True, True]])
    np.testing.assert_array_equal(np.isinf(by_sum), [[True, True, False, False]])
    with pytest.raises(ValueError, match="group_score='top2_sum' needs groups of at least 2"):
        routers.check_router("switch", top_k=2, jitter_eps=0.0, num_experts=4, num_groups=4,
                             top_groups=2, group_score="top2_sum", score="sigmoid")
