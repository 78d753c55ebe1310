"""The language model's fused attention (``LMConfig.execution.attention_impl``):
``jax.nn.dot_product_attention`` gives the einsum attention's logits and gradients with every
mask the model builds (grouped query heads, a sliding window, packed documents, padding) and
under cached decoding. cuDNN's form runs only on NVIDIA GPUs (its arguments differ from XLA's by
``is_causal`` alone); the checks of its config run here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution
from tests import kit

VOCAB, T = 53, 12


def _config(attention_impl: str, **changes) -> LMConfig:
    fields = dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=16, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=24,
                  moe_intermediate_size=12, num_experts=4, top_k=2, moe_layers=(True, True),
                  sliding_window=5)
    # LMConfig.replace takes the execution section's fields by name.
    return LMConfig.build(**fields).replace(attention_impl=attention_impl, **changes)


def _inputs():
    ids = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    segments = jnp.array([[0] * 7 + [1] * 5, [0] * T])  # row 0 packs two documents
    real = jnp.ones((2, T), bool).at[1, -3:].set(False)  # row 1 ends in padding
    return ids, segments, real


@functools.cache
def _logits_and_grads(attention_impl: str):
    return kit.lm_logits_and_grads(_config(attention_impl), *_inputs())


@pytest.mark.parametrize("attention_impl", ["xla", "auto"])
def test_fused_attention_gives_the_einsum_logits_and_gradients(attention_impl):
    logits, grads, _ = _logits_and_grads("einsum")
    fused_logits, fused_grads, _ = _logits_and_grads(attention_impl)
    _, _, real = _inputs()
    scale = np.abs(logits).max()
    keep = np.asarray(real)  # padding queries' outputs are never used
    np.testing.assert_allclose(fused_logits[keep], logits[keep], rtol=0, atol=1e-5 * scale)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    fused = jax.tree.leaves(fused_grads)
    assert max(float(jnp.abs(g).max()) for _, g in flat) > 0
    for (path, g), f in zip(flat, fused, strict=True):
        np.testing.assert_allclose(f, g, rtol=1e-4, atol=1e-6 * float(jnp.abs(g).max()) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))


def test_fused_attention_under_cached_decoding_gives_the_full_forward_logits():
    """Prefill 5 tokens, then one at a time past the sliding window (XLA's form)."""
    graphdef, state = _logits_and_grads("xla")[2]
    ids = _inputs()[0][:1]

    @jax.jit
    def forward(x, cache=None):
        return nnx.merge(graphdef, jax.tree.map(lambda a: a, state)).forward(x, cache=cache)

    full = np.asarray(forward(ids).logits)
    step = forward
    out = step(ids[:, :5], nnx.merge(graphdef, state).init_cache(1, T))
    steps, cache = [out.logits[:, -1]], out.cache
    for t in range(5, T):
        out = step(ids[:, t:t + 1], cache)
        steps.append(out.logits[:, -1])
        cache = out.cache
    cached = np.stack([np.asarray(x) for x in steps], axis=1)
    np.testing.assert_allclose(cached[0], full[0, 4:], rtol=0, atol=1e-5 * np.abs(full).max())


def test_attention_impl_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"LMConfig: attention_impl='flash'; choose one of"):
        _config("flash")
    with pytest.raises(ValueError, match=r"attention_impl='cudnn' needs compute_dtype="
                                         r"'bfloat16'.*'float32'"):
        _config("cudnn")
    assert _config("cudnn", compute_dtype="bfloat16").execution.attention_impl == "cudnn"
    section = {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "mlp_dim": 16}
    with pytest.raises(ValueError, match=r"config\.model\.attention_impl='cudnn' needs "
                                         r"config\.model\.compute_dtype='bfloat16'"):
        LMExecution.from_config(section | {"attention_impl": "cudnn"})
    with pytest.raises(ValueError, match=r"config\.model\.attention_impl='flash'"):
        LMExecution.from_config(section | {"attention_impl": "flash"})


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="needs a GPU")
def test_cudnn_attention_gives_the_xla_logits_on_a_gpu():
    """bfloat16, head width 64 (cuDNN takes multiples of 8): cuDNN's flash attention against
    XLA's on the same weights, with packed documents, padding and a sliding window."""
    outs = {}
    for impl in ("xla", "cudnn"):
        config = _config(impl, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64,
                         compute_dtype="bfloat16")
        model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))
        model.eval()
        graphdef, state = nnx.split(model)

        # the state an argument: merged inside the trace, the layer scan may update its
        # variables (a closed-over state's would belong to the outer trace level)
        @jax.jit
        def logits(state, ids, segments, real, graphdef=graphdef):
            return nnx.merge(graphdef, state).forward(ids, segment_ids=segments,
                                                      token_mask=real).logits

        outs[impl] = np.asarray(logits(state, *_inputs()))
    keep = np.asarray(_inputs()[2])
    scale = np.abs(outs["xla"]).max()
    np.testing.assert_allclose(outs["cudnn"][keep], outs["xla"][keep], rtol=0, atol=2e-2 * scale)
    # Generation with the cuDNN config (its cached steps take XLA's form) runs and is greedy.
    from sparsemixer_jax.models.lm_generate import generate

    tokens = generate(model, _inputs()[0][:, :4], 3)
    assert tokens.shape == (2, 7)


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and \
        tuple(int(x) for x in device.compute_capability.split(".")) >= (9, 0)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda") or not _on_hopper(),
                    reason="needs an NVIDIA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("max_segments", [8, 4])
def test_cudnn_packed_documents_give_the_xla_logits_and_gradients_on_a_gpu(max_segments):
    """bf16: cuDNN with the documents as segment offsets (model.cudnn_document_mask="offsets")
    against XLA's attention on the same weights and rows: row 0 packs five documents and
    padding, row 1 two documents. With at most 8 segments a row the packed layout runs; with 4,
    row 0 (six segments) does not fit and the logits are NaN (no silent other attention).
    Then one sequence a row without segment ids (cuDNN's causal flag alone)."""
    t = 128
    ids = jax.random.randint(jax.random.key(0), (2, t), 0, VOCAB)
    segments = jnp.array([[1] * 20 + [2] * 30 + [3] * 10 + [4] * 40 + [5] * 8 + [0] * 20,
                          [7] * 100 + [8] * 28])
    packed = {"segment_ids": segments, "token_mask": segments != 0}
    outs = {}
    for impl in ("xla", "cudnn"):
        config = _config(impl, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                         sliding_window=None, compute_dtype="bfloat16",
                         cudnn_document_mask="offsets", max_segments_per_row=max_segments)
        model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))
        model.eval()
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def loss_and_grads(params, rest, kwargs, graphdef=graphdef):
            def loss(params):
                out = nnx.merge(graphdef, params, rest).forward(ids, **kwargs)
                real = kwargs.get("token_mask", jnp.ones_like(ids, bool))
                logp = jax.nn.log_softmax(out.logits[:, :-1])
                nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
                return jnp.sum(nll * real[:, 1:]) / jnp.sum(real[:, 1:]), out.logits

            return jax.value_and_grad(loss, has_aux=True)(params)

        outs[impl] = [loss_and_grads(params, rest, kwargs) for kwargs in (packed, {})]
    for case, keep in ((0, np.asarray(segments != 0)), (1, np.ones((2, t), bool))):
        (_, logits), grads = outs["xla"][case]
        (_, fused_logits), fused_grads = outs["cudnn"][case]
        logits, fused_logits = np.asarray(logits), np.asarray(fused_logits)
        if case == 0 and max_segments == 4:
            assert np.isnan(fused_logits).all() and np.isfinite(logits).all()
            continue
        # bf16 attention (8-bit mantissa, ~4e-3 a rounding) in two different kernel orders,
        # through two layers: the existing cuDNN test's 2% of the largest logit.
        scale = np.abs(logits).max()
        np.testing.assert_allclose(fused_logits[keep], logits[keep], rtol=0, atol=2e-2 * scale)
        flat = jax.tree_util.tree_leaves_with_path(grads)
        assert max(float(jnp.abs(g).max()) for _, g in flat) > 0
        for (path, g), f in zip(flat, jax.tree.leaves(fused_grads), strict=True):
            g, f = np.asarray(g, np.float32), np.asarray(f, np.float32)
            # The same bf16 rounding, summed over 256 tokens: 5% of each leaf's largest entry.
            np.testing.assert_allclose(f, g, rtol=0, atol=5e-2 * np.abs(g).max() + 1e-9,
                                       err_msg=f"{case} {jax.tree_util.keystr(path)}")
