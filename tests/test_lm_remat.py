"""Rematerialisation of the LM's scanned layers (``LMExecution.remat``) trades memory for compute
and nothing else: the loss and every gradient equal the model's without it (float32 rounding),
in training mode (SparseMixer-v2 samples its routes: the recomputed layers must draw the same
ones) and for a type that scans dense+MoE pairs. The lowered program must actually hold the
checkpoint, or the comparison would prove nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution


def _config(model_type: str, remat: str) -> LMConfig:
    moe_every = 2 if model_type == "qwen2_moe" else 1
    return LMConfig.build(
        model_type=model_type, vocab_size=61, hidden_size=16, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=4, intermediate_size=24, moe_intermediate_size=12,
        num_experts=4, top_k=2, router="sparsemixer_v2", jitter_eps=0.1,
        moe_layers=tuple(i % moe_every == moe_every - 1 for i in range(4)),
        execution=LMExecution(remat=remat))


@functools.cache
def _loss_and_grads(model_type: str, remat: str):
    """Loss, gradients and the forward's jaxpr (text) of a tiny model (shared per module)."""
    config = _config(model_type, remat)
    ids = jax.random.randint(jax.random.key(3), (2, 8), 0, 61)
    model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))  # training mode: routes sampled
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
        rest = jax.tree.map(lambda x: x, rest)  # RNG counts of this trace level (as the steps)
        out = nnx.merge(graphdef, params, rest).forward(ids)
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out.logits[:, :-1]),
                                            ids[:, 1:, None], axis=-1))
        return nll + 0.01 * out.aux["balance_loss"]

    step = jax.value_and_grad(loss)
    jaxpr = str(jax.make_jaxpr(loss)(params, rest))
    value, grads = jax.jit(step)(params, rest)
    return value, grads, jaxpr


@pytest.mark.parametrize("model_type, remat", [
    ("mixtral", "full"), ("mixtral", "dots_saveable"), ("qwen2_moe", "nothing_saveable"),
    ("mixtral", "elementwise")])
def test_remat_leaves_loss_and_gradients_unchanged(model_type, remat):
    value, grads, plain = _loss_and_grads(model_type, "none")
    value_r, grads_r, rematted = _loss_and_grads(model_type, remat)
    # jax.checkpoint's primitive (remat2) wraps the layer body only when remat asks.
    assert "remat" not in plain and "remat" in rematted
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0
    flat, flat_r = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_r)
    assert len(flat) == len(flat_r)
    for (path, g), g_r in zip(flat, flat_r, strict=True):
        np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_an_unknown_remat_policy_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"remat='dots'; choose one of"):
        _config("mixtral", "dots")


def test_the_execution_section_is_read_from_the_model_section_and_replaced_by_name():
    """``remat`` and the other execution fields are :class:`LMExecution`'s: read from a model
    section (its other fields left alone), checked naming the config field, and named on their
    own by ``LMConfig.replace`` (``load_pretrained``'s overrides)."""
    section = {"hidden_size": 8, "mlp_dim": 16, "remat": "full", "dispatch": "padded"}
    assert LMExecution.from_config(section) == LMExecution(remat="full", dispatch="padded")
    with pytest.raises(ValueError, match=r"^config\.model\.remat='dots'; choose one of"):
        LMExecution.from_config({"remat": "dots"})
    config = _config("mixtral", "none")
    changed = config.replace(remat="full", dispatch="padded")
    assert changed.execution == LMExecution(remat="full", dispatch="padded")
    assert changed.replace(execution=LMExecution()) == config
    assert changed.moe_sections()[0].dispatch == "padded"  # the MoE layers' section follows
    with pytest.raises(ValueError, match=r"^LMConfig: remat='dots'; choose one of"):
        config.replace(remat="dots")
