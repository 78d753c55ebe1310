"""The fused training step, the fused attention option and the runtime settings, on CPU.

Float32 comparisons run at ``highest`` matmul precision (conftest), which is what CPUs do anyway;
on a GPU it keeps TF32 out of them.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import training
from sparsemixer_jax.layers.fairseq import fairseq_attention
from sparsemixer_jax.models.encoder_decoder import Transformer, TransformerConfig
from sparsemixer_jax.packed_tree import PackedTree
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.tasks import check_config, run_config, translation
from sparsemixer_jax.training import runtime
from sparsemixer_jax.training import steps as training_steps
from tests import kit, tiny_wmt_config

VOCAB = 40


def tiny_config(**model):
    """The tiny translation config (tests/kit.py) with ``model`` fields."""
    return kit.tiny_config("translation", model=model)


def batch(seed=0, rows=4, length=8):
    rng = np.random.default_rng(seed)
    b = {k: rng.integers(3, VOCAB, (rows, length), dtype=np.int32) for k in ("inputs", "targets")}
    b["targets"][1, 5:] = 0  # some padding
    b["inputs"][2, 6:] = 0
    return {k: jnp.asarray(v) for k, v in b.items()}


@pytest.fixture(scope="module")
def steps():
    config = tiny_config()
    return training.build_steps(run_config(config), VOCAB)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def assert_same_update(ref, new):
    """Bit-exact on CPU. GPUs' default reductions and scatter-adds are not deterministic, and
    Adam's first step is about ``lr * sign(g)``, so a gradient entry near 0 may move its
    parameter by up to ``2 lr`` (lr = 1e-7 here) the other way: 1e-6 absolute there."""
    if jax.default_backend() == "cpu":
        jax.tree.map(np.testing.assert_array_equal, ref, new)
    else:
        jax.tree.map(lambda r, n: np.testing.assert_allclose(r, n, rtol=1e-5, atol=1e-6), ref, new)


def test_fused_step_equals_zero_accumulate_update(steps):
    """One micro-batch: the single compiled call gives what the three calls give."""
    key = jax.random.key(7)
    state = copy(steps.init_state())
    b = batch()
    acc = steps.zeros(state, b)
    acc, stats = steps.accumulate(state, acc, b, jax.random.fold_in(key, 0))
    ref, ref_metrics = steps.update(copy(state), acc, stats)
    new, metrics = steps.train_step(copy(state), [b], key)
    assert_same_update((ref.params, ref.opt_state, ref_metrics),
                       (new.params, new.opt_state, metrics))
    assert int(ref.step) == int(new.step) == 1  # the update is counted
    # The update moved the parameters. Adam's first step is about lr = 1e-7 here, below
    # np.allclose's tolerance for the non-zero biases of the fairseq initialisation: compare
    # exactly.
    moved = jax.tree.leaves(jax.tree.map(lambda n, o: not np.array_equal(n, o), new.params,
                                         state.params))
    assert sum(moved) > len(moved) // 2, moved


def test_several_micro_batches_take_the_accumulating_path(steps):
    key = jax.random.key(3)
    state = copy(steps.init_state())
    b0, b1 = batch(0), batch(1)
    acc = steps.zeros(state, b0)
    stats = state.layer_state
    for j, b in enumerate((b0, b1)):
        acc, stats = steps.accumulate(state.replace(layer_state=stats), acc, b,
                                      jax.random.fold_in(key, j))
    ref, ref_metrics = steps.update(copy(state), acc, stats)
    new, metrics = steps.train_step(copy(state), [b0, b1], key)
    assert_same_update((ref.params, ref.opt_state, ref_metrics),
                       (new.params, new.opt_state, metrics))


def test_micro_batches_compile_the_accumulation_once(steps):
    """The zero accumulator is placed as an accumulated one is: the second micro-batch reuses
    the first one's executable (jit keys executables on whether arrays are committed)."""
    state = copy(steps.init_state())
    shape = {"rows": 3, "length": 7}  # a signature no other test here compiles
    before = training_steps._accumulate._cache_size()
    steps.train_step(state, [batch(0, **shape), batch(1, **shape)], jax.random.key(0))
    assert training_steps._accumulate._cache_size() == before + 1


def test_a_non_finite_update_changes_nothing_but_the_step(steps):
    """An infinite parameter makes the loss NaN: the update is skipped, bit for bit, on the
    accumulating path and the fused one, and counted."""
    state = copy(steps.init_state())
    params = jax.tree.map(jnp.copy, state.params)
    first = jax.tree.leaves(params)[0]
    leaves, treedef = jax.tree.flatten(params)
    leaves[0] = first.at[(0,) * first.ndim].set(jnp.inf)
    state = state.replace(params=jax.tree.unflatten(treedef, leaves))
    # A moved optimizer state, so that "unchanged" is not "still zero".
    state = state.replace(opt_state=jax.tree.map(lambda a: a + 1 if a.dtype == jnp.float32
                                                 else a, state.opt_state))
    for micro in ([batch(0)], [batch(0), batch(1)]):
        new, metrics = steps.train_step(copy(state), micro, jax.random.key(1))
        assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
        assert int(new.step) == int(state.step) + 1
        jax.tree.map(np.testing.assert_array_equal, (new.params, new.opt_state,
                                                     new.layer_state),
                     (state.params, state.opt_state, state.layer_state))


def test_the_update_returns_its_float32_metrics_in_one_buffer(steps):
    """Each output leaf of a compiled program is a kernel of its own: the metrics come back as
    one float32 vector (and the bool ``finite``), read as the tree they pack, on the device and
    after ``jax.device_get``."""
    state = copy(steps.init_state())
    _, metrics = steps.train_step(state, [batch(0), batch(1)], jax.random.key(2))
    leaves = jax.tree.leaves(metrics)
    assert [leaf.dtype for leaf in leaves] == [jnp.float32, jnp.bool_], leaves
    host = jax.device_get(metrics)
    assert isinstance(host["loss"], np.ndarray) and host["loss"].shape == ()
    assert set(host) == set(metrics) >= {"loss", "grad_norm", "finite", "tokens"}
    for key in host:  # the same values, wherever they are read
        jax.tree.map(np.testing.assert_array_equal, host[key], metrics[key])
    packed = PackedTree.pack({"a": jnp.arange(6.0).reshape(2, 3),
                              "b": {"c": jnp.float32(7.0), "d": jnp.int32(3)}})
    assert packed.vector.shape == (7,) and packed.others[0].dtype == jnp.int32
    np.testing.assert_array_equal(packed["a"], np.arange(6.0).reshape(2, 3))
    assert float(packed["b"]["c"]) == 7.0 and int(packed["b"]["d"]) == 3


def test_a_packed_tree_stacked_by_scan_unpacks_with_the_leading_axis():
    """A layer scan returns one packed tree per step; the stacked tree unpacks to each leaf with
    the scan's ``[steps]`` axis in front, step ``i``'s values at ``[i]`` (exact: slices and
    reshapes of the same values)."""
    def body(carry, i):
        tree = {"w": jnp.full((2, 3), i, jnp.float32), "s": i.astype(jnp.float32) * 10,
                "flag": i % 2 == 0}
        return carry, PackedTree.pack(tree)

    _, stacked = jax.lax.scan(body, 0, jnp.arange(4))
    assert stacked.vector.shape == (4, 7)
    tree = stacked.unpack()
    assert tree["w"].shape == (4, 2, 3) and tree["s"].shape == (4,)
    np.testing.assert_array_equal(tree["w"], np.arange(4.0)[:, None, None] * np.ones((2, 3)))
    np.testing.assert_array_equal(tree["s"], np.arange(4.0) * 10)
    np.testing.assert_array_equal(tree["flag"], [True, False, True, False])


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_dot_product_attention_equals_the_einsum_attention(impl):
    kw = dict(attention_dropout=0.0, dtype=jnp.float32)
    ref = fairseq_attention(32, 4, **kw, rngs=nnx.Rngs(0))
    fused = fairseq_attention(32, 4, **kw, implementation=impl, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 32))
    memory = jax.random.normal(jax.random.key(2), (2, 7, 32))
    pad = jnp.array([[True] * 7, [True] * 4 + [False] * 3])[:, None, None, :]
    causal = jnp.tril(jnp.ones((5, 5), bool))[None, None]
    for mem, mask in ((memory, pad), (x, causal)):
        np.testing.assert_allclose(fused(x, mem, mask, deterministic=False),
                                   ref(x, mem, mask, deterministic=False), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
def test_transformer_with_fused_attention_equals_the_paper_attention(monkeypatch):
    """Whole model in training mode (dropout elsewhere on), attention dropout 0: "xla" (boolean
    masks) and the "cudnn" path (masks as key lengths + causal flag, run by XLA here: cuDNN
    itself needs a GPU) equal the einsum attention; so does incremental decoding via "cudnn"."""
    from sparsemixer_jax.layers import attention_impls

    monkeypatch.setitem(attention_impls.ATTENTION_IMPLS, "cudnn", "xla")
    b = batch()
    outs, steps = {}, {}
    for impl in ("einsum", "xla", "cudnn"):
        config = tiny_config(attention_impl=impl, attention_dropout=0.0)
        model = Transformer(*kit.sections(config, TransformerConfig), VOCAB,
                            rngs=nnx.Rngs(params=0, dropout=1, router=2))
        outs[impl] = model(b["inputs"], b["targets"], deterministic=False)[0]
        if impl != "xla":
            encoded = model.encode(b["inputs"])
            cache = model.init_cache(b["inputs"].shape[0], 6)
            for t in range(3):
                logits, cache = model.decode_step(b["targets"][:, t], cache, encoded)
            steps[impl] = logits
    for impl in ("xla", "cudnn"):
        np.testing.assert_allclose(outs[impl], outs["einsum"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps["cudnn"], steps["einsum"], rtol=1e-5, atol=1e-5)


def test_mask_as_lengths():
    from sparsemixer_jax.layers.attention import mask_as_lengths

    pad = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)[:, None, None, :]
    lengths, causal = mask_as_lengths(pad, 3, 5)
    assert lengths.tolist() == [3, 2, 1] and not causal  # an empty row gets 1
    square = jnp.tril(jnp.ones((4, 4), bool))[None, None] & pad
    lengths, causal = mask_as_lengths(square, 3, 4)
    assert lengths.tolist() == [3, 2, 1] and causal


def test_attention_impl_config_errors():
    with pytest.raises(ValueError, match=r"attention_impl.*no dropout.*attention_dropout=0\.1"):
        check_config(tiny_config(attention_impl="cudnn", attention_dropout=0.1))
    with pytest.raises(ValueError, match=r"'cudnn' needs config\.model\.compute_dtype='bfloat16'"):
        check_config(tiny_config(attention_impl="cudnn", attention_dropout=0.0))
    check_config(tiny_config(attention_impl="cudnn", attention_dropout=0.0,
                                   compute_dtype="bfloat16"))
    with pytest.raises(ValueError, match="attention implementation 'flash'"):
        check_config(tiny_config(attention_impl="flash", attention_dropout=0.0))
    c = tiny_config()
    c.runtime.rng_impl = "philox"
    with pytest.raises(ValueError, match=r"runtime\.rng_impl='philox'"):
        check_config(c)


def test_runtime_configure_sets_prng_and_xla_flags(monkeypatch):
    flags = os.environ.get("XLA_FLAGS", "")  # conftest's; XLA aborts on flags it does not know
    monkeypatch.setenv("XLA_FLAGS", flags)
    before = jax.config.values["jax_default_prng_impl"]
    c = tiny_wmt_config.get_config()
    precision = jax.config.values["jax_default_matmul_precision"]
    c.runtime.rng_impl = "unsafe_rbg"
    c.runtime.deterministic = True
    c.runtime.matmul_precision = "high"
    try:
        runtime.configure(runtime.RuntimeConfig.from_config(c.runtime))
        assert jax.config.values["jax_default_matmul_precision"] == "high"
        assert jax.config.values["jax_default_prng_impl"] == "unsafe_rbg"
        assert str(jax.random.key_impl(jax.random.key(0))) == "unsafe_rbg"
        assert os.environ["XLA_FLAGS"].split() == [*flags.split(), runtime.DETERMINISTIC_XLA_FLAG]
        runtime.configure(runtime.RuntimeConfig.from_config(c.runtime))  # idempotent
        assert os.environ["XLA_FLAGS"].count("deterministic") == 1
    finally:
        jax.config.update("jax_default_prng_impl", before)
        jax.config.update("jax_default_matmul_precision", precision)


loss_grad = jax.jit(jax.grad(training_steps.micro_batch_loss, argnums=2, has_aux=True),
                    static_argnums=(0, 1))


def test_balance_normalization_per_batch_is_the_reference_weight(steps):
    """``per_batch`` adds ``weight * balance`` once per micro-batch to the token-summed loss (the
    reference, fairseq); ``per_token`` adds it once per token. So ``per_batch`` with weight ``w``
    is ``per_token`` with weight ``w / tokens``: equal gradients (float32 rounding: 1e-5), and
    clearly not those of ``per_token`` with weight ``w``."""
    b = batch(seed=3)
    tokens = float(jnp.sum(b["targets"] != 0))
    key = jax.random.key(7)

    def grad(weight, normalization):
        task = translation.TranslationTask(
            label_smoothing=0.1, router=RouterConfig(balance_weight=weight, z_loss_weight=0.0,
                                                     balance_normalization=normalization))
        return loss_grad(steps.graphdef, task, steps.params, steps.layer_state, steps.rest,
                         b, key)[0]

    per_batch = grad(1.0, "per_batch")
    jax.tree.map(lambda t, u: np.testing.assert_allclose(u, t, rtol=1e-5, atol=1e-7),
                 grad(1.0 / tokens, "per_token"), per_batch)
    gap = jax.tree.map(lambda t, u: float(jnp.max(jnp.abs(t - u))), grad(1.0, "per_token"),
                       per_batch)
    assert max(jax.tree.leaves(gap)) > 1e-3


def test_balance_normalization_is_checked():
    config = tiny_config()
    config.router.balance_normalization = "per_sentence"
    with pytest.raises(ValueError, match="balance_normalization='per_sentence'"):
        check_config(config)
