"""The decoder-only LM's layers are scanned: the program XLA compiles does not grow with depth.

Compile time follows the size of the lowered program, so the test compares program sizes (a
count that cannot flake with the machine's load), not seconds: a model of 6 and of 18 layers
must lower to programs of the same number of operations, for a uniform stack and for a type
that mixes dense and MoE layers (a repeated dense+MoE pair). Unrolling the layers would multiply
the count by the depth. (Up to four runs of identical layers are scanned run by run, so
shallower mixed models lower to a few more operations; ``layer_pattern_stacks``.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.layer_stacks import layer_pattern_stacks
from sparsemixer_jax.models.lm_config import LMConfig


def _config(num_layers: int, moe_every: int) -> LMConfig:
    return LMConfig.build(
        model_type="qwen2_moe" if moe_every > 1 else "mixtral", vocab_size=61, hidden_size=16,
        num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
        moe_intermediate_size=12, num_experts=4, top_k=2,
        moe_layers=tuple(i % moe_every == moe_every - 1 for i in range(num_layers)))


def _ops_of_train_step(config: LMConfig) -> int:
    """Operations in the lowered StableHLO of a loss-and-gradient step of ``config``'s model,
    built abstractly (nothing is initialised)."""
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0, router=1)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, ids):
        rest = jax.tree.map(lambda x: x, rest)  # RNG counts of this trace level (as the steps)
        logits = nnx.merge(graphdef, params, rest)(ids)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    text = jax.jit(jax.grad(loss)).lower(params, rest, ids).as_text()
    # One StableHLO operation per line that assigns a result ("%x = ...").
    return len(re.findall(r"^\s*%\S+ = ", text, flags=re.MULTILINE))


@pytest.mark.parametrize("moe_every", [1, 2], ids=["uniform", "dense_moe_pairs"])
def test_lowered_step_does_not_grow_with_depth(moe_every):
    shallow = _ops_of_train_step(_config(6, moe_every))
    deep = _ops_of_train_step(_config(18, moe_every))
    assert shallow > 100  # the count sees the program
    assert deep == shallow, (deep, shallow)


def test_each_moe_layer_reports_its_metrics_under_its_own_index():
    """A dense+MoE pair scanned 4 times, then one MoE layer in a stack of its own: each MoE
    layer's metrics come out under its index in the model, and the losses are their sums."""
    moe_layers = (False, True) * 4 + (True,)
    assert layer_pattern_stacks(moe_layers) == (((False, True), 4), ((True,), 1))
    config = LMConfig.build(
        model_type="qwen2_moe", vocab_size=61, hidden_size=16, num_layers=9, num_heads=4,
        num_kv_heads=2, head_dim=4, intermediate_size=24, moe_intermediate_size=12,
        num_experts=4, top_k=2, moe_layers=moe_layers)
    model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))
    model.eval()
    aux = model.forward(jnp.arange(10)[None] % 61).aux
    assert list(aux["moe"]) == ["layer_1", "layer_3", "layer_5", "layer_7", "layer_8"]
    # Each layer routes the same 10 tokens with its own weights: its own loads, summing to 1.
    fractions = [aux["moe"][k]["expert_fraction"] for k in aux["moe"]]
    assert all(abs(float(jnp.sum(f)) - 1) < 1e-5 for f in fractions)
    assert len({tuple(f.tolist()) for f in fractions}) > 1
    assert float(aux["balance_loss"]) == pytest.approx(
        sum(float(m["balance_loss"]) for m in aux["moe"].values()), rel=1e-6)
