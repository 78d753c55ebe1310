"""Packed documents as cuDNN's segment offsets (:mod:`sparsemixer_jax.layers.packed_attention`): the
offsets and lengths of hand-made rows, the mask they imply against the language model's own,
their flat form against JAX's, the rows refused, the private JAX API they need, and
(compile-only, for an H100) that the compiled program passes cuDNN no ``[B, 1, T, T]`` bias where
the mask is exactly causal or taken as offsets, and that ``configs/lm_bench.py``'s programs hold
no such array. Running the kernel needs a GPU: tests/test_lm_attention.py."""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lm_bench
from sparsemixer_jax.data.lm_text import pack_documents
from sparsemixer_jax.layers.packed_attention import (
    check_rows_fit,
    compute_capability_of,
    segment_layout,
)
from sparsemixer_jax.models.causal_lm import CausalLM, _positions_and_masks
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution
from tests import kit


def _layout(ids, real=None, max_segments=3):
    ids = jnp.asarray(ids, jnp.int32)
    real = jnp.ones(ids.shape, bool) if real is None else jnp.asarray(real, bool)
    out = segment_layout(ids, real, max_segments)
    return np.asarray(out.lengths), np.asarray(out.offsets), bool(out.fits)


def test_one_segment_a_row():
    lengths, offsets, fits = _layout([[5] * 6, [0] * 6])
    np.testing.assert_array_equal(lengths, [[6, -1, -1], [6, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, -1, -1, -1], [0, -1, -1, -1]])
    assert fits


def test_documents_and_padding():
    # As the text packer lays them out: documents 7 and 8, then padding (segment 0, not real).
    ids = [[7, 7, 8, 8, 8, 0, 0], [3, 4, 5, 5, 5, 5, 5]]
    lengths, offsets, fits = _layout(ids, np.asarray(ids) != 0)
    np.testing.assert_array_equal(lengths, [[2, 3, 2], [1, 1, 5]])
    np.testing.assert_array_equal(offsets, [[0, 2, 5, -1], [0, 1, 2, -1]])
    assert fits
    # Padding is one segment whatever ids it carries; without a token mask id 0 is a document.
    lengths, _, _ = _layout([[7, 7, 0, 9, 9]], [[True, True, False, False, False]])
    np.testing.assert_array_equal(lengths, [[2, 3, -1]])
    lengths, _, _ = _layout([[7, 7, 0, 9, 9]])
    np.testing.assert_array_equal(lengths, [[2, 1, 2]])


def test_a_row_over_the_limit_or_an_id_in_two_runs_does_not_fit():
    lengths, offsets, fits = _layout([[1, 2, 3, 4, 4], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(offsets[1], [0, -1, -1, -1])
    assert not fits  # row 0: four segments, three allowed
    np.testing.assert_array_equal(lengths[0], [1, 1, 1])
    assert _layout([[1, 2, 3, 4, 4]], max_segments=4)[2]
    # Id 1 in two runs: the mask lets the second run see the first, the layout would not.
    assert not _layout([[1, 1, 2, 1, 0]], [[True, True, True, True, False]])[2]
    # Padding runs split by a document are not a repeated document.
    assert _layout([[0, 0, 2, 0, 0]], [[False, False, True, False, False]])[2]


def _implied_mask(lengths: np.ndarray, offsets: np.ndarray, t: int) -> np.ndarray:
    """bool ``[B, T, T]``: causal within each segment of the layout."""
    segment = np.full((len(lengths), t), -1)
    for row, (ls, os_) in enumerate(zip(lengths, offsets, strict=True)):
        for i, (length, start) in enumerate(zip(ls, os_, strict=False)):
            if length >= 0:
                segment[row, start:start + length] = i
    assert (segment >= 0).all()  # the segments cover every row
    causal = np.tril(np.ones((t, t), bool))
    return causal & (segment[:, :, None] == segment[:, None, :])


def test_the_offsets_give_the_language_models_mask_on_real_queries():
    rng = np.random.default_rng(0)
    t = 32
    documents = [rng.integers(1, 9, size=n) for n in rng.integers(1, 14, size=20)]
    tokens, segments = pack_documents(documents, t)
    assert len(tokens) >= 4 and (segments == 0).any()  # several rows, the last padded
    real = segments != 0
    config = LMConfig.build(model_type="mixtral", vocab_size=9, hidden_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8,
                      moe_intermediate_size=4, num_experts=2, top_k=1, moe_layers=(False,))
    _, (mask, _) = _positions_and_masks(config, jnp.asarray(real), None, jnp.asarray(segments),
                                        None)
    lengths, offsets, fits = _layout(segments, real, max_segments=t)
    assert fits and (lengths > 0).sum(axis=1).max() > 2
    implied = _implied_mask(lengths, offsets, t)
    mask = np.asarray(mask)
    np.testing.assert_array_equal(implied[real], mask[real])
    # Padding queries see only padding under the layout (the mask gives them nothing).
    assert not (implied[~real] & real[np.nonzero(~real)[0]]).any()


def test_the_flat_form_is_what_jaxs_entry_point_computes_at_every_call():
    """segment_layout's flat form (once a forward pass) against JAX's own per-call fix-up of the
    per-row form, for rows of 1 to 4 segments (one full), times each token's width."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    ids = jnp.asarray([[7, 7, 8, 8, 8, 0, 0], [3, 3, 3, 3, 3, 3, 3], [1, 2, 2, 5, 5, 5, 0]])
    real = ids != 0
    q, k = jnp.zeros((3, 7, 4, 8)), jnp.zeros((3, 7, 2, 8))
    layout = segment_layout(ids, real, 4, widths=(32, 16))
    assert bool(layout.fits)
    want = cudnn_attention._fix_seqlen_offsets(layout.lengths, layout.lengths, layout.offsets,
                                               layout.offsets, q, k)
    np.testing.assert_array_equal(layout.flat_lengths, want[0])
    np.testing.assert_array_equal(layout.flat_q_offsets, want[2])
    np.testing.assert_array_equal(layout.flat_kv_offsets, want[3])
    # Spelled out: segments (2, 3, 2), (7), (1, 2, 3, 1): starts 0 2 5 | 7 | 14 15 17 20.
    np.testing.assert_array_equal(np.asarray(layout.flat_lengths).ravel()[:9],
                                  [2, 3, 2, 7, 1, 2, 3, 1, 0])
    np.testing.assert_array_equal(np.asarray(layout.flat_kv_offsets).ravel()[:9] // 16,
                                  [0, 2, 5, 7, 14, 15, 17, 20, 21])


def test_rows_the_layout_cannot_hold_are_refused_in_one_line():
    ids = np.asarray([[1, 1, 2, 2], [1, 2, 3, 0]])
    check_rows_fit(ids, ids != 0, 4, "the train split")  # row 1: 3 documents and padding
    with pytest.raises(ValueError, match=r"^the train split: row 1 holds 4 segments .*"
                                         r"max_segments_per_row=3 .*'bias'$"):
        check_rows_fit(np.asarray([[1, 1, 2, 2], [1, 2, 3, 4]]), ids != -1, 3, "the train split")
    with pytest.raises(ValueError, match=r"row 0 holds 3 segments .*, a document id in two runs"):
        check_rows_fit(np.asarray([[1, 2, 1, 1]]), np.ones((1, 4), bool), 8, "x")
    # Under jit the same rows make the layout not fit (the model's logits NaN, not wrong).
    assert not bool(jax.jit(lambda i: segment_layout(i, i != 0, 3).fits)(jnp.asarray(
        [[1, 2, 3, 4]])))
    assert not bool(jax.jit(lambda i: segment_layout(i, i != 0, 8).fits)(jnp.asarray(
        [[1, 2, 1, 1]])))


def test_a_forward_pass_on_concrete_rows_over_the_limit_raises():
    """Outside jit the model sees the segment ids and refuses such rows before attending."""
    config = LMConfig.build(model_type="mixtral", vocab_size=16, hidden_size=16, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16,
                            moe_intermediate_size=8, num_experts=2, top_k=1,
                            moe_layers=(False,), compute_dtype="bfloat16",
                            attention_impl="cudnn", cudnn_document_mask="offsets",
                            max_segments_per_row=2)
    model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))
    segments = jnp.asarray([[1, 1, 2, 2, 3, 3, 0, 0]])
    with pytest.raises(ValueError, match=r"^segment_ids: row 0 holds 4 segments"):
        model.forward(jnp.ones((1, 8), jnp.int32), segment_ids=segments,
                      token_mask=segments != 0)


def test_the_private_cudnn_entry_point_takes_what_packed_attention_passes():
    """A JAX release that renames or drops these arguments fails here (packed_attention)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    parameters = inspect.signature(cudnn_attention.dot_product_attention).parameters
    for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type"):
        assert name in parameters, name
    assert list(parameters)[:3] == ["query", "key", "value"]
    assert cudnn_attention.MaskType.PADDING_CAUSAL.name == "PADDING_CAUSAL"
    # Offsets [B, M + 1] make M segments a row: what the layout's shapes assume.
    assert cudnn_attention.get_max_seg_per_batch(jnp.zeros((2, 4), jnp.int32)) == 3
    assert callable(cudnn_attention.check_compute_capability)  # compute_capability_of's
    # The kernels' primitives packed_attention binds on one device, and the checks it runs.
    for name in ("_dot_product_attention_fwd_p", "_dot_product_attention_bwd_p",
                 "check_cudnn_version", "check_layout", "check_is_flash_attention"):
        assert hasattr(cudnn_attention, name), name
    assert cudnn_attention.AttentionLayout.BTNH.name == "BTNH"


# ------------------------------------------------------------ compile-only, for an H100

B, T = 2, 128


@functools.cache
def _cudnn_custom_calls(document_mask: str, with_segments: bool) -> list[tuple[str, str]]:
    """``(computation, line)`` of each cuDNN attention custom call of a compiled forward and
    backward pass of a one-layer bf16 model for one H100, with packed documents
    (``with_segments``) or one sequence a row; ``computation``: the HLO computation holding
    it, ``"fallback"`` for the false branch of a conditional (the mask path)."""
    _, devices = kit.target_devices_or_skip("h100:1x1")
    config = LMConfig.build(model_type="mixtral", vocab_size=64, hidden_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=128,
                      moe_intermediate_size=64, num_experts=2, top_k=1, moe_layers=(False,),
                      execution=LMExecution(compute_dtype="bfloat16", attention_impl="cudnn",
                                            cudnn_document_mask=document_mask,
                                            max_segments_per_row=4))
    graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(params=0, router=1)))

    def loss(params, ids, segments):
        kwargs = {"segment_ids": segments, "token_mask": segments != 0} if with_segments else {}
        logits = nnx.merge(graphdef, params).forward(ids, **kwargs).logits
        return jnp.mean(logits)

    on_h100 = jax.sharding.SingleDeviceSharding(devices[0])
    args = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h100),
                         params),
            jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=on_h100),
            jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=on_h100))
    with jax.default_device(devices[0]), compute_capability_of(devices[0]):
        hlo = jax.jit(jax.grad(loss)).lower(*args).compile().as_text()
    fallbacks = set(re.findall(r"false_computation=%([\w.\-]+)", hlo))
    calls, computation = [], ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
        elif "custom-call(" in line and "__cudnn$fmha" in line:
            calls.append(("fallback" if computation in fallbacks else computation, line))
    return calls


BIAS = f"bf16[{B},1,{T},{T}]"


def test_cudnn_takes_its_causal_flag_alone_for_one_sequence_a_row():
    calls = _cudnn_custom_calls("bias", False)
    assert len(calls) >= 2  # forward and backward
    for _, line in calls:
        assert BIAS not in line and re.search(r'"mask_type": ?"CAUSAL"', line), line


def test_cudnn_takes_packed_documents_as_offsets_without_the_mask():
    calls = _cudnn_custom_calls("offsets", True)
    assert len(calls) >= 2 and not [where for where, _ in calls if where == "fallback"]
    for _, line in calls:  # offsets [B, M + 1], no bias, causal within each segment
        assert re.search(rf"s32\[{B},5\]", line) and BIAS not in line, line
        assert re.search(r'"mask_type": ?"PADDING_CAUSAL"', line), line
    # The mask path (the default cudnn_document_mask="bias") reads the bias.
    assert all(BIAS in line for _, line in _cudnn_custom_calls("bias", True))


def test_the_fused_call_takes_the_offsets_on_one_device(monkeypatch):
    """Wiring, on any backend: cuDNN's calls replaced by stand-ins that say which ran (the
    packed layout's output 1, the mask path's 2) and how."""
    from sparsemixer_jax.layers import attention as attention_module
    from sparsemixer_jax.layers.attention import Attention, AttentionOptions, FusedMask

    calls, packed = [], []

    def mask_path(q, k, v, **kwargs):
        calls.append(kwargs)
        return jnp.full(q.shape, 2.0, q.dtype)

    def packed_path(q, k, v, layout, scale, *, sharded):
        packed.append(sharded)
        return jnp.full(q.shape, 1.0, q.dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", mask_path)
    monkeypatch.setattr(attention_module, "packed_attention", packed_path)
    rngs = nnx.Rngs(0)
    make = lambda i, o, *, use_bias: nnx.Linear(i, o, use_bias=use_bias, rngs=rngs)
    attn = Attention(AttentionOptions(8, 2, 1, 4, implementation="cudnn"), qkv_linear=make,
                     out_linear=make, rngs=rngs)
    q, k = jnp.ones((1, 4, 2, 4), jnp.bfloat16), jnp.ones((1, 4, 1, 4), jnp.bfloat16)
    mask = jnp.tril(jnp.ones((4, 4), bool))[None, None]

    def run(fused):
        return float(attn._fused(q, k, k, mask, True, None, fused).mean())

    assert run(FusedMask(exactly_causal=True)) == 2.0
    assert calls[-1] == {"scale": 0.5, "is_causal": True, "implementation": "cudnn"}
    real = jnp.ones((1, 4), bool)
    # Whether or not the rows fit: no mask branch (the model's logits go NaN where not).
    assert run(FusedMask(segments=segment_layout(jnp.array([[1, 1, 2, 2]]), real, 3))) == 1.0
    assert run(FusedMask(segments=segment_layout(jnp.array([[1, 2, 3, 4]]), real, 3))) == 1.0
    assert packed == [False, False] and len(calls) == 1
    assert run(None) == 2.0  # no FusedMask: the mask, as before
    assert calls[-1]["is_causal"] and calls[-1]["mask"].shape == (1, 1, 4, 4)


# configs/lm_bench.py's model at its 16 layers (the kernels a layer launches, and the mask
# arrays, do not depend on width or length), shrunk to width 128 and 256 tokens a row.
BENCH_B, BENCH_T = 2, 256


@functools.cache
def _bench_program(document_mask: str | None) -> str:
    """The optimised HLO of a forward and backward pass of ``configs/lm_bench.py:dense``
    (``model.cudnn_document_mask`` as it sets it, or ``document_mask``) over packed rows, for
    one H100."""
    from sparsemixer_jax.tasks.language_model import LMTask

    _, devices = kit.target_devices_or_skip("h100:1x1")
    config = lm_bench.get_config("dense")
    config.model.update(hidden_size=128, num_heads=2, num_kv_heads=1, mlp_dim=128,
                        max_position_embeddings=BENCH_T)
    if document_mask is not None:
        config.model.cudnn_document_mask = document_mask
    config.data.update(vocab_size=256, seq_len=BENCH_T)
    lm = LMTask.from_config(config).lm
    assert lm.arch.num_layers == 16 and lm.execution.attention_impl == "cudnn"
    on_h100 = jax.sharding.SingleDeviceSharding(devices[0])
    rows = jax.ShapeDtypeStruct((BENCH_B, BENCH_T), jnp.int32, sharding=on_h100)
    with jax.default_device(devices[0]), compute_capability_of(devices[0]):
        graphdef, params = nnx.split(nnx.eval_shape(
            lambda: CausalLM(lm, rngs=nnx.Rngs(params=0, router=1))))

        def loss(params, ids, segments):
            model = nnx.merge(graphdef, params)
            return jnp.mean(model.forward(ids, segment_ids=segments,
                                          token_mask=segments != 0).logits)

        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                             sharding=on_h100), params)
        return jax.jit(jax.grad(loss)).lower(params, rows, rows).compile().as_text()


def test_the_bench_programs_hold_no_mask_array_and_launch_no_more_kernels():
    """``configs/lm_bench.py`` as it is: no ``[B, 1, T, T]`` array of any dtype, no cuDNN call
    with a bias or under a conditional, a causal mask type, and no more kernels a pass than
    with the documents as a bias (which this check sees: it holds the array)."""
    from sparsemixer_jax.aot import hlo, roofline

    square = rf"\w+\[{BENCH_B},1,{BENCH_T},{BENCH_T}\]"
    text = _bench_program(None)
    assert not re.findall(square, text)
    assert " conditional(" not in text
    calls = [line for line in text.splitlines()
             if "custom-call(" in line and "__cudnn$fmha" in line]
    assert len(calls) >= 2  # forward and backward, inside the layer scans
    for line in calls:
        assert re.search(r'"mask_type": ?"(PADDING_)?CAUSAL"', line), line
        assert "Bias" not in re.search(r'custom_call_target="([^"]*)"', line).group(1), line
    bias_text = _bench_program("bias")
    assert re.findall(square, bias_text)

    def kernels(text: str) -> float:
        return sum(op.count for op in roofline.program_ops(hlo.parse_module(text)))

    assert kernels(text) <= kernels(bias_text)
