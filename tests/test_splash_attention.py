"""Splash attention (``model.attention_impl="splash"``, jax's Pallas TPU flash attention):
run by Pallas' interpreter on the CPU it gives the einsum attention's logits and gradients in a
language model (packed documents, padding, grouped query heads, score blocks skipped); on a mesh
each device attends over its own rows inside ``shard_map``; compiled for a TPU slice without
the hardware, the roofline counts its three kernels' FLOPs from the blocks they compute."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.aot import hlo, roofline
from sparsemixer_jax.kernels import splash_attention
from sparsemixer_jax.kernels.splash_attention import causal_blocks, splash_block, splash_heads
from sparsemixer_jax.layers.fairseq import ModelConfig
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution
from sparsemixer_jax.moe.config import MoEConfig
from sparsemixer_jax.parallel.sharding import make_mesh
from tests import kit

# 384 tokens: 3 x 3 blocks of 128, of which the kernels compute the 6 on and below the diagonal.
VOCAB, T = 61, 384


def _config(attention_impl: str) -> LMConfig:
    return LMConfig.build(model_type="mixtral", vocab_size=VOCAB, hidden_size=16, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                    moe_intermediate_size=12, num_experts=4, top_k=2, moe_layers=(True,),
                    execution=LMExecution(attention_impl=attention_impl))


def _inputs():
    ids = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    segments = jnp.array([[0] * 200 + [1] * 184, [0] * T])  # row 0 packs two documents
    real = jnp.ones((2, T), bool).at[1, -50:].set(False)  # row 1 ends in padding
    return ids, segments, real


@functools.cache
def _logits_and_grads(attention_impl: str):
    """(logits, gradients) of packed documents and padding (:func:`tests.kit.lm_logits_and_grads`)
    and the logits of the same tokens without either."""
    ids = _inputs()[0]
    logits, grads, (graphdef, state) = kit.lm_logits_and_grads(_config(attention_impl), *_inputs())
    plain = jax.jit(lambda state: nnx.merge(graphdef, state).forward(ids).logits)(state)
    return logits, grads, np.asarray(plain)


def test_splash_gives_the_einsum_logits_and_gradients():
    """Float32 throughout; the kernel sums the softmax block by block (an online softmax), the
    einsum attention over the whole row, so the two differ by float32 rounding of sums of a
    few hundred terms: the bounds of the fused-attention tests (1e-5 of the largest logit,
    1e-4 relative on the gradients), which a wrong mask or head grouping exceeds by orders of
    magnitude."""
    logits, grads, plain = _logits_and_grads("einsum")
    splash_logits, splash_grads, splash_plain = _logits_and_grads("splash")
    _, _, real = _inputs()
    scale = np.abs(logits).max()
    keep = np.asarray(real)  # padded queries' outputs are never used
    np.testing.assert_allclose(splash_logits[keep], logits[keep], rtol=0, atol=1e-5 * scale)
    # Without segments or padding: the causal mask alone.
    np.testing.assert_allclose(splash_plain, plain, rtol=0, atol=1e-5 * np.abs(plain).max())
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert max(float(jnp.abs(g).max()) for _, g in flat) > 0
    for (path, g), s in zip(flat, jax.tree.leaves(splash_grads), strict=True):
        np.testing.assert_allclose(s, g, rtol=1e-4, atol=1e-6 * float(jnp.abs(g).max()) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))


def test_on_a_mesh_each_device_attends_over_its_own_rows():
    """Eight rows on a 2 x 2 x 2 mesh: one row a device, in ``shard_map``, the same numbers as
    on one device (each row runs the same kernel on the same data)."""
    mesh = make_mesh(2, 2, jax.devices()[:8], fsdp=2)
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (8, 128, 2, 8))
    k, v = (jax.random.normal(key, (8, 128, 1, 8)) for key in keys[1:])
    rows = NamedSharding(mesh, P(mesh.axis_names))
    split = jax.jit(functools.partial(splash_heads, mesh=mesh))
    lowered = split.lower(*(jax.device_put(x, rows) for x in (q, k, v))).as_text()
    assert "manual_computation" in lowered or "shard_map" in lowered
    out = split(*(jax.device_put(x, rows) for x in (q, k, v)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(splash_heads)(q, k, v)))


def test_blocks_and_refusals():
    assert splash_block(4096, 4096) == 512 and splash_block(384, 384) == 128
    assert splash_block(100, 100) is None
    assert causal_blocks(384, 384, 128) == (6, 9)
    assert causal_blocks(4096, 4096, 512) == (36, 64)
    with pytest.raises(ValueError, match=r"'splash' is a TPU kernel.*'gpu'.*'cudnn'"):
        splash_attention._interpret(types.SimpleNamespace(platform="gpu"))
    with pytest.raises(ValueError, match="both must be multiples of 128"):
        splash_heads(*(jnp.zeros((1, 100, 2, 8)),) * 3)
    with pytest.raises(ValueError, match=r"^config\.model\.attention_impl='splash' is the "
                                         r"language models'"):
        ModelConfig(emb_dim=8, mlp_dim=8, num_heads=2, moe=MoEConfig(),
                    attention_impl="splash").check("config.model.")


def test_the_roofline_counts_the_kernels_of_a_tpu_program():
    """The gradient of splash attention compiled for 4 TPU v5p chips: its forward, dq and dkv
    kernels cost 2, 3 and 4 matmuls of ``2 H T T D`` FLOPs a row, times the 6 of 9 blocks."""
    _, devices = kit.target_devices_or_skip("tpu:v5p:2x2x1")
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 2, 2), ("data", "fsdp", "expert"))
    heads, dim = 4, 128

    def loss(q, k, v):
        return jnp.sum(splash_heads(q, k, v, mesh=mesh).astype(jnp.float32))

    rows = NamedSharding(mesh, P(mesh.axis_names))
    args = [jax.ShapeDtypeStruct((4, T, h, dim), jnp.bfloat16, sharding=rows)
            for h in (heads, 2, 2)]
    gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with pytest.raises(ValueError, match="jax_default_matmul_precision='highest' asks float32"):
        gradient.lower(*args)  # conftest.py's precision for float32 comparisons
    with jax.default_matmul_precision("default"):
        compiled = gradient.lower(*args).compile()
    ops = roofline.program_ops(hlo.parse_module(compiled.as_text()), len(devices))
    kernels = {op.name.split(".")[0]: op.flops for op in ops if op.kind == "kernel"}
    one = 2 * heads * T * T * dim * 6 / 9  # one matmul over the computed blocks, one row
    assert kernels == {"splash_mha_fwd_residuals": 2 * one, "splash_mha_dq_no_residuals": 3 * one,
                       "splash_mha_dkv_no_residuals": 4 * one}
