"""Tests of sparsemixer_jax/moe/diagnostics.py: cases by hand and the MoE layer's metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import routers
from sparsemixer_jax.moe.diagnostics import eligible_fraction, router_diagnostics
from tests import kit

# Reference mask at jitter_eps = 0.1 keeps expert i when max(z) - z_i <= 0.2 * max(|z_i|, max z).
LOGITS = jnp.array([
    [1.0, 0.95, 0.0, -1.0],  # 0.95 is within 0.2 of the max 1.0: 2 eligible
    [2.0, 0.0, 0.0, 0.0],  # 1 eligible
    [1.0, 1.0, 1.0, 1.0],  # ties: 4 eligible
    [-3.0, 5.0, 4.5, 4.9],  # 4.5 and 4.9 lie within 0.2 * 5 of the max: 3 eligible
])


def _eval_route(logits, router="sparsemixer"):
    return routers.get_router(router, 0.1)(logits, None, False)


def test_eligible_fraction_counts_tokens_by_number_of_eligible_experts():
    routed = _eval_route(LOGITS)
    np.testing.assert_allclose(eligible_fraction(routed.probs), [0.25, 0.25, 0.25, 0.25])
    # Padding is left out: without the second token, a third each of 2, 3 and 4 eligible.
    token_mask = jnp.array([True, False, True, True])
    np.testing.assert_allclose(eligible_fraction(routed.probs, token_mask),
                               [0.0, 1 / 3, 1 / 3, 1 / 3], rtol=1e-6)


def test_diagnostics_by_hand():
    logits = LOGITS[None]  # [B=1, T=4, N=4]
    routed = routers.RouterOutput(
        expert=jnp.array([[0, 2, 0, 3]], jnp.int32),  # tokens 1 and 3 leave the argmax (0, 1)
        gate=jnp.ones((1, 4)),
        probs=_eval_route(logits).probs,
    )
    d = router_diagnostics(logits, routed, jitter_eps=0.1)
    z = np.asarray(LOGITS)
    np.testing.assert_allclose(d["max_logit"], z.max(-1).mean(), rtol=1e-6)
    np.testing.assert_allclose(d["logit_mean"], z.mean(-1).mean(), rtol=1e-6)
    np.testing.assert_allclose(d["logit_std"], z.std(-1).mean(), rtol=1e-6)
    assert float(d["non_argmax_share"]) == pytest.approx(0.5)
    # Experts chosen 0, 2, 0, 3: shares 0.5, 0, 0.25, 0.25.
    assert float(d["load_max"]) == pytest.approx(0.5) and float(d["load_min"]) == 0.0
    np.testing.assert_allclose(d["eligible_fraction"], [0.25] * 4)
    assert float(d["ref_mask_eligible"]) == pytest.approx((2 + 1 + 4 + 3) / 4)
    # With the last token as padding every mean covers the first three.
    d = router_diagnostics(logits, routed, jnp.array([[True, True, True, False]]))
    assert float(d["non_argmax_share"]) == pytest.approx(1 / 3)
    assert float(d["ref_mask_eligible"]) == pytest.approx(7 / 3)
    assert float(d["load_max"]) == pytest.approx(2 / 3)


def test_diagnostics_read_the_selection_scores_under_a_bias_and_sigmoid_scores():
    """Under bias balancing the experts are chosen (and SparseMixer's mask computed) on z + b,
    under sigmoid scores on sigmoid(z) + b: the mask count and the argmax follow them."""
    logits = LOGITS[None]
    routed = routers.RouterOutput(expert=jnp.array([[0, 2, 0, 3]], jnp.int32),
                                  gate=jnp.ones((1, 4)), probs=_eval_route(logits).probs)
    bias = jnp.array([0.0, 0.0, 0.9, 0.0])
    d = router_diagnostics(logits, routed, jitter_eps=0.1, selection_bias=bias)
    # z + b rows: [1, .95, .9, -1] keeps 3; [2, 0, .9, 0] 1; [1, 1, 1.9, 1] 1;
    # [-3, 5, 5.4, 4.9] 3 (within 0.2 * 5.4 of the max). Argmaxes 0, 0, 2, 2.
    assert float(d["ref_mask_eligible"]) == pytest.approx((3 + 1 + 1 + 3) / 4)
    assert float(d["non_argmax_share"]) == pytest.approx(3 / 4)
    # sigmoid([0, -0.1, -3, -5]) = [.5, .475, .047, .007]: .475 lies within 0.2 * .5 of the
    # max, so 2 stay; on the logits (max 0) only the argmax does.
    z = jnp.array([[0.0, -0.1, -3.0, -5.0]])
    one = routers.RouterOutput(expert=jnp.array([1], jnp.int32), gate=jnp.ones(1),
                               probs=_eval_route(z).probs)
    assert float(router_diagnostics(z, one)["ref_mask_eligible"]) == 1.0
    sig = router_diagnostics(z, one, score="sigmoid")
    assert float(sig["ref_mask_eligible"]) == 2.0 and float(sig["non_argmax_share"]) == 1.0


def test_top_k_diagnostics_count_rows_and_the_first_choice():
    logits = LOGITS[None]
    routed = routers.RouterOutput(
        expert=jnp.array([[[0, 1], [2, 0], [0, 3], [3, 1]]], jnp.int32),  # [B=1, T=4, k=2]
        gate=jnp.ones((1, 4, 2)),
        probs=_eval_route(logits).probs,
    )
    d = router_diagnostics(logits, routed, jitter_eps=0.1)
    # First choices 0, 2, 0, 3 against argmaxes 0, 0, 0, 1: tokens 1 and 3 leave the argmax.
    assert float(d["non_argmax_share"]) == pytest.approx(0.5)
    # Rows: expert 0 three times, 1 twice, 2 once, 3 twice, of 8.
    assert float(d["load_max"]) == pytest.approx(3 / 8) and float(d["load_min"]) == 1 / 8


def test_switch_reports_all_experts_eligible_and_what_the_mask_would_keep():
    routed = _eval_route(LOGITS, "switch")
    d = router_diagnostics(LOGITS, routed, jitter_eps=0.1)
    np.testing.assert_allclose(d["eligible_fraction"], [0, 0, 0, 1])
    sm = router_diagnostics(LOGITS, _eval_route(LOGITS), jitter_eps=0.1)
    assert float(d["ref_mask_eligible"]) == pytest.approx(float(sm["ref_mask_eligible"]))
    assert float(sm["ref_mask_eligible"]) == pytest.approx(
        float(jnp.sum(jnp.arange(1, 5) * sm["eligible_fraction"])))


def test_reference_mask_is_scale_invariant_but_not_shift_invariant():
    """The router study's observation (docs/science.md): zero-mean logits leave one expert on most
    tokens; a common shift, which the softmax ignores, changes the count. 4096 Gaussian tokens:
    the share of one-eligible tokens has a standard error below 0.008."""
    z = jax.random.normal(jax.random.key(0), (4096, 4))
    share_single = {}
    for name, logits in {"zero_mean": z, "scaled": 7.0 * z, "shifted": z + 3.0,
                         "shifted_down": z - 3.0}.items():
        share_single[name] = float(eligible_fraction(_eval_route(logits).probs)[0])
    assert share_single["zero_mean"] > 0.6
    assert share_single["scaled"] == pytest.approx(share_single["zero_mean"])
    assert share_single["shifted"] < share_single["zero_mean"] - 0.2
    assert share_single["shifted_down"] < share_single["zero_mean"] - 0.2


@pytest.fixture(scope="module")
def layer_metrics():
    layer = kit.moe_layer(8, 16, 4, router="sparsemixer", activation_dropout=0.0,
                          rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    token_mask = jnp.arange(5)[None, :] < jnp.array([[5], [3]])
    _, metrics = layer(x, token_mask)
    return metrics


def test_moe_layer_logs_the_diagnostics(layer_metrics):
    m = layer_metrics
    assert m["eligible_fraction"].shape == (4,)
    assert float(jnp.sum(m["eligible_fraction"])) == pytest.approx(1.0, rel=1e-6)
    # The router's own count and the diagnostics' agree.
    mean_count = float(jnp.sum(jnp.arange(1, 5) * m["eligible_fraction"]))
    assert mean_count == pytest.approx(float(m["num_unmasked"]), rel=1e-6)
    assert float(m["ref_mask_eligible"]) == pytest.approx(mean_count, rel=1e-6)
    assert 0.0 <= float(m["load_min"]) <= 0.25 <= float(m["load_max"]) <= 1.0
    assert all(v.dtype == jnp.float32 for v in m.values())
