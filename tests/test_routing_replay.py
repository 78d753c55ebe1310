"""Routing replay: given experts in every MoE layer, the live router's gates over them.

The MoE layer against a hand computation over the given experts (softmax scores with and
without renormalisation, sigmoid scores with a selection bias, groups and a scaling factor),
every router's answer to replay, a forward given its own routes against the forward without
them (logits and gradients) on tiny Hugging Face models of three types, the split over the
layer scan, jit and the decode cache, and the one-line refusals.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import hf, routers
from sparsemixer_jax.models.lm_generate import generate
from sparsemixer_jax.moe import MoEFeedForward
from tests import kit

DATA = os.path.join(os.path.dirname(__file__), "data", "hf")
EMB, MLP, N, B, T = 8, 16, 8, 2, 5


def gated_layer(router="switch", selection_bias=False, **router_options):
    return MoEFeedForward((EMB, MLP), *kit.moe_sections(
        N, router=router, top_k=2, activation="silu", gated=True, router_bias=False,
        activation_dropout=0.0, jitter_eps=0.0, selection_bias=selection_bias,
        router_options=router_options), rngs=nnx.Rngs(params=0, router=1))


def hand_output(layer, x, experts):
    """``sum_t gate_t f_{e_t}(x)`` over the given ``experts [B, T, 2]``, the gates computed
    from the router's kernel as the layer's router section says (jax float32, so that its
    gradient in the kernel can be taken too)."""
    config = layer.router_config
    w_gate, w_up, w_down = (p[...] for p in layer.expert_params())

    def output(kernel):
        logits = x @ kernel
        scores = jax.nn.sigmoid(logits) if config.score == "sigmoid" else \
            jax.nn.softmax(logits, axis=-1)
        gate = jnp.take_along_axis(scores, experts, axis=-1)
        if config.renormalises:
            gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
        gate = gate * config.routed_scaling_factor
        y = 0.0
        for t in range(experts.shape[-1]):
            e = experts[..., t]
            h = jax.nn.silu(jnp.einsum("bte,btem->btm", x, w_gate[e])) * \
                jnp.einsum("bte,btem->btm", x, w_up[e])
            y = y + gate[..., t, None] * jnp.einsum("btm,btme->bte", h, w_down[e])
        return y

    return output


def distinct_routes(seed, shape, num_experts):
    """int32 ``[*shape, 2]``: two distinct random experts per token."""
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((*shape, num_experts)), axis=-1)
    return order[..., :2].astype(np.int32)


@pytest.mark.parametrize("router_options, selection_bias", [
    ({"normalize_top_k": True}, False),
    ({}, False),
    ({"score": "sigmoid", "routed_scaling_factor": 2.5, "num_groups": 4, "top_groups": 2,
      "group_score": "top2_sum"}, True),
], ids=["softmax_renormalised", "softmax", "sigmoid_bias_groups_scaled"])
def test_replayed_layer_equals_the_hand_computation_over_the_given_experts(
        router_options, selection_bias):
    layer = gated_layer(selection_bias=selection_bias, **router_options)
    if selection_bias:  # a bias that would select other experts: under replay it only selects
        layer.expert_bias[...] = jnp.asarray(np.random.default_rng(5).normal(0, 3.0, N),
                                             jnp.float32)
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    head = jax.random.normal(jax.random.key(4), (B, T, EMB))
    own = np.asarray(nnx.jit(lambda m: m(x, deterministic=True, record_routes=True)[1])(
        layer)["routes"])
    given = distinct_routes(7, (B, T), N)
    given[0, 0] = -1  # the router's own choice for this token
    assert not np.array_equal(np.sort(given[1:], -1), np.sort(own[1:], -1))
    want_experts = np.where(given >= 0, given, own)
    hand = hand_output(layer, x, jnp.asarray(want_experts))

    def loss(layer):
        y, metrics = layer(x, deterministic=True, routes=jnp.asarray(given), record_routes=True)
        return jnp.sum(y * head), (y, metrics["routes"])

    (_, (y, chosen)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer)
    np.testing.assert_array_equal(np.asarray(chosen), want_experts)
    kernel = layer.router.kernel[...]
    (_, want_y), want_grad = jax.jit(jax.value_and_grad(
        lambda k: (jnp.sum(hand(k) * head), hand(k)), has_aux=True))(kernel)
    # Both are float32 sums of a few terms of size ~1 in another order: rounding ~1e-6.
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(want_grad))) > 1e-3  # the router receives a gradient
    np.testing.assert_allclose(np.asarray(grads.router.kernel[...]), np.asarray(want_grad),
                               rtol=1e-4, atol=1e-5)


REPLAYING = sorted(n for n in routers.ROUTERS if routers.replays(n))
# default_moe_st is default_moe under its earlier name: the same function and rule.
SAME_ROUTER = {"default_moe_st": "default_moe"}


def test_default_moe_st_is_default_moe():
    for name, same in SAME_ROUTER.items():
        assert routers.ROUTERS[name] == routers.ROUTERS[same]
        assert routers.UNCHOSEN_EXPERT_RULES[name] == routers.UNCHOSEN_EXPERT_RULES[same]
        assert routers.replays(name) == routers.replays(same)


@pytest.mark.parametrize("router", sorted(set(routers.ROUTERS) - set(SAME_ROUTER)))
def test_every_router_replays_its_own_selection_unchanged_or_refuses(router):
    """In training: output and gradients of every param equal the layer without routes
    (densemixer_blog takes no normalize_top_k, the rest route renormalised)."""
    options = {} if router == "densemixer_blog" or router not in REPLAYING else \
        {"normalize_top_k": True}
    x = jax.random.normal(jax.random.key(3), (B, T, EMB))
    head = jax.random.normal(jax.random.key(4), (B, T, EMB))
    mask = jnp.arange(T)[None, :] < jnp.asarray([[T], [T - 2]])  # row 1 padded at its end

    def run(routes):
        layer = gated_layer(router, **options)  # the same params and router key each time

        def loss(layer):
            y, metrics = layer(x, mask, deterministic=False, routes=routes, record_routes=True)
            return jnp.sum(y * head), (y, metrics["routes"])

        return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer)

    if router not in REPLAYING:
        with pytest.raises(ValueError, match=f"router '{router}' is not available: .*derived "
                                             "later"):
            run(jnp.zeros((B, T, 2), jnp.int32))
        return
    (_, (y, chosen)), grads = run(None)
    assert np.all(np.asarray(chosen)[1, T - 2:] == -1)  # padding: no expert
    (_, (y_replayed, chosen_replayed)), grads_replayed = run(chosen)
    np.testing.assert_array_equal(np.asarray(chosen_replayed), np.asarray(chosen))
    # The same gates from the same scores: equal up to the order XLA sums in (float32).
    np.testing.assert_allclose(np.asarray(y_replayed), np.asarray(y), rtol=1e-6, atol=1e-7)
    for got, want in zip(jax.tree.leaves(grads_replayed), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_layer_refuses_routes_of_another_shape_in_one_line():
    layer = gated_layer()
    x = jnp.zeros((B, T, EMB))
    with pytest.raises(ValueError, match=r"routes must be \[B, T, top_k\] = \[2, 5, 2\] .* got "
                                         r"shape \[2, 5, 3\]$"):
        layer(x, deterministic=True, routes=jnp.zeros((B, T, 3), jnp.int32))


@pytest.fixture(scope="module")
def models():
    """Tiny models: deepseek_v3 (sigmoid scores, correction bias, groups, scaling; a dense
    first layer, two scanned MoE layers) and qwen3_moe (norm_topk_prob; a dense layer between
    MoE layers)."""
    return {t: hf.load_pretrained(os.path.join(DATA, t)) for t in ("deepseek_v3", "qwen3_moe")}


def ids_of(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 97, shape), jnp.int32)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_forward_given_its_own_routes_equals_the_forward_without_them(models, model_type):
    model, config = models[model_type]
    ids = ids_of(0, (2, 6))
    mask = jnp.asarray([[True] * 6, [False, False] + [True] * 4])  # left padding

    @nnx.jit
    def run(model, routes):
        def loss(model):
            out = model.forward(ids, token_mask=mask, routes=routes, deterministic=True)
            return jnp.sum(out.logits[:, -1] ** 2), (out.logits, out.routes)
        return nnx.value_and_grad(loss, has_aux=True)(model)

    (_, (logits, own)), grads = run(model, None)
    layers = sum(config.arch.moe_layers)
    assert own.shape == (2, 6, layers, config.top_k) and own.dtype == jnp.int32
    assert np.all(np.asarray(own)[1, :2] == -1) and np.all(np.asarray(own)[:, 2:] >= 0)
    (_, (logits_replayed, chosen)), grads_replayed = run(model, own)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(own))
    # The same gates from the same scores; XLA may sum them in another order (float32).
    np.testing.assert_allclose(np.asarray(logits_replayed), np.asarray(logits), rtol=1e-6,
                               atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_replayed), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    router_grads = [g for path, g in nnx.to_flat_state(nnx.state(grads_replayed))
                    if "router" in path and "kernel" in path]
    assert router_grads and all(float(jnp.max(jnp.abs(g[...]))) > 0 for g in router_grads)


def test_each_moe_layer_of_the_scan_replays_its_own_routes_with_jit_and_cache(models):
    """deepseek_v3: MoE layers 1 and 2 are one stack of 2 repeats; each gets its own routes.
    Replayed through a prefill and one-token steps of the cache, the logits are the full
    forward's."""
    model, config = models["deepseek_v3"]
    ids = ids_of(1, (2, 6))
    given = distinct_routes(2, (2, 6, 2), config.num_experts)
    given = np.concatenate([given, np.argsort(np.random.default_rng(3).random(
        (2, 6, 2, config.num_experts)), -1)[..., 2:3].astype(np.int32)], -1)  # top-3, distinct
    forward = nnx.jit(lambda m, ids, r: m.forward(ids, routes=r))
    full = forward(model, ids, jnp.asarray(given))
    np.testing.assert_array_equal(np.asarray(full.routes), given)
    own = forward(model, ids, jnp.full(given.shape, -1, jnp.int32))  # every token its own
    assert not np.array_equal(np.asarray(own.routes), given)
    assert np.abs(np.asarray(full.logits - own.logits)).max() > 1e-3  # the routes matter

    step = nnx.jit(lambda m, ids, cache, r: m.forward(ids, cache=cache, routes=r))
    out = None
    logits = []
    for t in range(6):  # one token at a time: one compiled step
        out = step(model, ids[:, t:t + 1], model.init_cache(2, 6) if out is None else out.cache,
                   jnp.asarray(given[:, t:t + 1]))
        np.testing.assert_array_equal(np.asarray(out.routes), given[:, t:t + 1])
        logits.append(out.logits)
    # Cached attention sums the same keys over a longer, masked axis: float32 rounding.
    np.testing.assert_allclose(np.concatenate(logits, 1), np.asarray(full.logits), rtol=1e-5,
                               atol=1e-5)


def test_bad_routes_are_refused_in_one_line(models):
    model, _ = models["deepseek_v3"]
    ids = ids_of(0, (1, 3))
    good = np.tile(np.arange(3, dtype=np.int32), (1, 3, 2, 1))
    cases = [
        (good[:, :, :1], r"routes must be int \[B, T, MoE layers, top_k\] = \[1, 3, 2, 3\] for "
                         r"input_ids \[1, 3\], got shape \[1, 3, 1, 3\]$"),
        (good.astype(np.float32), r"routes must hold integer expert ids, got dtype float32$"),
        (np.where(np.arange(3) == 2, 8, good),
         r"routes\[0, 0, 0, 2\] = 8 is not an expert id: ids lie in \[0, 8\), -1 for the "
         r"router's own choice$"),
        (np.where(np.arange(3) == 0, -1, good),
         r"routes\[0, 0, 0\] = \[-1, 1, 2\] mixes -1 with expert ids; -1 fills a token's whole "
         r"row \(the router's own choice\)$"),
        (np.where(np.arange(3) == 0, 1, good),
         r"routes\[0, 0, 0\] = \[1, 1, 2\] gives an expert twice; a token's experts are "
         r"distinct$"),
    ]
    for routes, message in cases:
        with pytest.raises(ValueError, match=message):
            model.forward(ids, routes=routes)
    phimoe, phimoe_config = hf.load_pretrained(os.path.join(DATA, "phimoe"))  # SparseMixer-v2
    shape = (1, 3, sum(phimoe_config.arch.moe_layers), phimoe_config.top_k)
    with pytest.raises(ValueError, match=r"router 'sparsemixer_v2' is not available: .*derived "
                                         r"later"):
        phimoe.forward(ids, routes=np.zeros(shape, np.int32))


def test_rollouts_record_the_routes_a_full_forward_replays(models):
    """qwen3_moe, row 1 left-padded: a sampled rollout's routes are the selection of a full
    forward over its tokens, which replays them unchanged; with an eos the routes end at each
    row's first new eos; greedy decoding's replayed logits are the forward's own and pick its
    tokens."""
    model, config = models["qwen3_moe"]
    prompt = ids_of(4, (2, 4))
    prompt_mask = jnp.asarray([[True] * 4, [False] + [True] * 3])
    mask = jnp.concatenate([prompt_mask, jnp.ones((2, 6), bool)], axis=1)
    forward = nnx.jit(lambda m, ids, r: m.forward(ids, token_mask=mask, routes=r))
    sample = dict(prompt_mask=prompt_mask, temperature=1.0, key=jax.random.key(0),
                  return_routes=True)

    tokens, routes = generate(model, prompt, 6, **sample)
    routes = np.asarray(routes)
    assert routes.shape == (2, 10, sum(config.arch.moe_layers), config.top_k)
    assert routes.dtype == np.int32
    unset = np.all(routes == -1, axis=(2, 3))
    assert np.all(unset | np.all(routes >= 0, axis=(2, 3)))  # -1 fills whole rows only
    np.testing.assert_array_equal(unset, [[False] * 9 + [True], [True] + [False] * 8 + [True]])
    own = forward(model, tokens, None)
    replayed = forward(model, tokens, jnp.asarray(routes))
    computed = ~unset
    np.testing.assert_array_equal(np.asarray(own.routes)[computed], routes[computed])
    np.testing.assert_array_equal(np.asarray(replayed.routes), np.asarray(own.routes))
    assert len({tuple(r) for r in routes[computed][:, 0]}) > 1  # the routes vary by token

    eos = int(tokens[0, 6])  # row 0's third new token: the routes end at its first new one
    ended_tokens, ended = generate(model, prompt, 6, eos_id=eos, **sample)
    ended = np.asarray(ended)
    new = np.asarray(ended_tokens)[:, 4:] == eos
    first = np.where(new.any(1), new.argmax(1) + 4, 10)
    for row in range(2):
        np.testing.assert_array_equal(ended[row, :first[row]], routes[row, :first[row]])
        assert np.all(ended[row, first[row]:] == -1)

    greedy, greedy_routes = generate(model, prompt, 6, prompt_mask=prompt_mask,
                                     return_routes=True)
    own = forward(model, greedy, None)
    replayed = forward(model, greedy, greedy_routes)
    # The same selection, so the same gates from the same scores (float32 summation order).
    np.testing.assert_allclose(np.asarray(replayed.logits[:, 3:]),
                               np.asarray(own.logits[:, 3:]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.argmax(np.asarray(replayed.logits[:, 3:-1]), -1),
                                  np.asarray(greedy[:, 4:]))

    unchanged, none_fed = generate(model, prompt, 0, prompt_mask=prompt_mask, return_routes=True)
    np.testing.assert_array_equal(np.asarray(unchanged), np.asarray(prompt))
    assert none_fed.shape == (2, 4, *routes.shape[2:]) and np.all(np.asarray(none_fed) == -1)


def test_the_docs_example_replays_a_vllm_rollout(monkeypatch):
    """docs/lm.md's routing replay example, run from the repository's root as it says (the
    rollout test's shapes and sampling, so that generate's programs are compiled once)."""
    names = kit.run_docs_example(monkeypatch, "## Routing replay")
    routes, replay = np.asarray(names["routes"]), names["replay"]
    assert np.all(routes[:, 9] == -1) and np.all(routes[1, 0] == -1)
    np.testing.assert_array_equal(replay, routes)  # the engine's rows, where the batch has them
    chosen = np.asarray(names["out"].routes)
    assert np.all(chosen[:, 9] >= 0)  # the last token: the layer's own choice
    np.testing.assert_array_equal(chosen[:, :9], routes[:, :9])
