"""hf.routes_from_vllm / hf.routes_from_sglang on arrays written in the engines' layouts.

vLLM's first form: one array per completion ``[tokens, num_hidden_layers, top_k]``, prompt rows
first, int32, zeros where a dense layer never wrote. Its later form: ``prompt_routed_experts``
and ``routed_experts`` ``[tokens, num_moe_layers, top_k]``, int16. SGLang: base64 of the int32
bytes of ``[tokens, num_hidden_layers, top_k]``. Numpy only.
"""

import base64
import os

import numpy as np
import pytest

from sparsemixer_jax import hf
from tests import kit

HF_DATA = os.path.join(os.path.dirname(__file__), "data", "hf")


def _config(model_type: str, **keys):
    return hf.from_hf({**hf.read_config(os.path.join(HF_DATA, model_type)), **keys})


@pytest.fixture(scope="module")
def interleaved():
    """qwen2_moe with decoder_sparse_step=2 over 5 layers: MoE at layers 1 and 3 only."""
    config = _config("qwen2_moe")
    assert config.arch.moe_layers == (False, True, False, True, False)
    return config


@pytest.fixture(scope="module")
def first_dense():
    """deepseek_v3 with first_k_dense_replace=1 over 3 layers: MoE at layers 1 and 2."""
    config = _config("deepseek_v3")
    assert config.arch.moe_layers == (False, True, True)
    return config


def _moe_ids(seed: int, tokens: int, config) -> np.ndarray:
    """Random distinct top-k ids per token and MoE layer: ``[tokens, MoE layers, top_k]``."""
    rng = np.random.default_rng(seed)
    layers = sum(config.arch.moe_layers)
    return np.stack([[rng.permutation(config.num_experts)[:config.top_k] for _ in range(layers)]
                     for _ in range(tokens)]).reshape(tokens, layers, config.top_k)


def _per_decoder_layer(moe: np.ndarray, config, dense_fill: int = 0,
                       dtype=np.int32) -> np.ndarray:
    """``moe`` written as an engine's buffer of one row per decoder layer: filled with
    ``dense_fill`` (vLLM's and SGLang's zeros, SGL-JAX's -1), the MoE layers' rows written."""
    full = np.full((moe.shape[0], config.arch.num_layers, config.top_k), dense_fill, dtype=dtype)
    for slot, layer in enumerate(i for i, m in enumerate(config.arch.moe_layers) if m):
        full[:, layer] = moe[:, slot]
    return full


def _sglang_text(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")


@pytest.mark.parametrize("dense_fill", [0, -1])
@pytest.mark.parametrize("model", ["interleaved", "first_dense"])
def test_vllm_rows_per_decoder_layer_keep_exactly_the_moe_layers(model, dense_fill, request):
    config = request.getfixturevalue(model)
    moe = _moe_ids(0, 7, config)
    got = hf.routes_from_vllm(_per_decoder_layer(moe, config, dense_fill), config=config)
    assert got.dtype == np.int32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, moe)


@pytest.mark.parametrize("dtype", [np.int16, np.int64, np.uint8])
def test_vllm_prompt_rows_come_first(first_dense, dtype):
    prompt, generated = _moe_ids(1, 5, first_dense), _moe_ids(2, 3, first_dense)
    got = hf.routes_from_vllm(generated.astype(dtype), prompt.astype(dtype), config=first_dense)
    assert got.dtype == np.int32 and got.shape == (8, 2, first_dense.top_k)
    np.testing.assert_array_equal(got[:5], prompt)
    np.testing.assert_array_equal(got[5:], generated)


def test_vllm_zero_generated_rows_give_the_prompts_rows(interleaved):
    prompt = _moe_ids(3, 4, interleaved).astype(np.int16)
    empty = np.zeros((0, 2, interleaved.top_k), np.int16)
    np.testing.assert_array_equal(
        hf.routes_from_vllm(empty, prompt, config=interleaved), prompt)
    assert hf.routes_from_vllm(empty, config=interleaved).shape == (0, 2, interleaved.top_k)


def test_padded_slots_are_kept(first_dense):
    moe = _moe_ids(4, 6, first_dense)
    moe[2, 1, -1] = -1
    moe[5, 0, :] = -1
    np.testing.assert_array_equal(
        hf.routes_from_vllm(_per_decoder_layer(moe, first_dense).astype(np.int64),
                            config=first_dense), moe)
    np.testing.assert_array_equal(hf.routes_from_vllm(moe), moe)


def test_without_a_config_the_layer_axis_is_kept():
    rows = np.arange(2 * 3 * 4, dtype=np.int64).reshape(4, 3, 2).transpose(0, 2, 1)
    got = hf.routes_from_vllm(rows)
    assert got.dtype == np.int32 and got.flags.c_contiguous and got.shape == (4, 2, 3)
    np.testing.assert_array_equal(got, rows)


@pytest.mark.parametrize("model", ["interleaved", "first_dense"])
def test_sglang_base64_round_trip(model, request):
    config = request.getfixturevalue(model)
    moe = _moe_ids(5, 9, config)
    full = _per_decoder_layer(moe, config)
    text = _sglang_text(full)
    np.testing.assert_array_equal(
        hf.routes_from_sglang(text, config.arch.num_layers, config.top_k, config=config), moe)
    got = hf.routes_from_sglang(text, config.arch.num_layers, config.top_k)
    assert got.dtype == np.int32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, full)
    np.testing.assert_array_equal(hf.routes_from_sglang(text.encode(), config.arch.num_layers,
                                                        config.top_k), full)


def test_sglang_moe_layer_rows_and_no_tokens(first_dense):
    moe = _moe_ids(6, 3, first_dense)
    moe[0, 0, 0] = -1
    np.testing.assert_array_equal(
        hf.routes_from_sglang(_sglang_text(moe), 2, first_dense.top_k, config=first_dense), moe)
    assert hf.routes_from_sglang("", 3, 3, config=first_dense).shape == (0, 2, 3)


def _refused(match: str, call, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_vllm_refusals(first_dense, interleaved):
    good = _moe_ids(7, 2, first_dense)
    _refused("dtype float32; expected an integer", hf.routes_from_vllm, good.astype(np.float32))
    _refused("dtype bool", hf.routes_from_vllm, good > 0)
    _refused(r"shape \(2, 6\); expected \[tokens, layers, top_k\]", hf.routes_from_vllm,
             good.reshape(2, 6))
    _refused(r"prompt_routed_experts has shape \(2, 2, 2\) and routed_experts \(2, 2, 3\)",
             hf.routes_from_vllm, good, good[:, :, :2])
    _refused(r"4 layers; expected 3 \(one per decoder layer\) or 2 \(the MoE layers\)",
             hf.routes_from_vllm, np.zeros((2, 4, 3), np.int32), config=first_dense)
    _refused("top_k=2; the config routes each token to top_k=3", hf.routes_from_vllm,
             good[:, :, :2], config=first_dense)
    high = good.copy()
    high[1, 1, 2] = first_dense.num_experts
    _refused(r"expert id 8; expected ids in \[-1, 8\)", hf.routes_from_vllm, high,
             config=first_dense)
    low = good.copy()
    low[0, 0, 0] = -2
    _refused(r"expert id -2", hf.routes_from_vllm, low)
    _refused(r"expert id 2147483648", hf.routes_from_vllm,
             np.full((1, 1, 1), 2**31, np.int64))
    # an id past num_experts in a dense layer's row is dropped, not refused; in an MoE row it is
    full = _per_decoder_layer(_moe_ids(8, 2, interleaved), interleaved, dense_fill=99)
    assert hf.routes_from_vllm(full, config=interleaved).shape == (2, 2, 3)
    _refused("expert id 99", hf.routes_from_vllm, full[:, [0, 2]],
             config=interleaved)


def test_sglang_refusals(first_dense):
    text = _sglang_text(_moe_ids(9, 2, first_dense))
    _refused("holds 48 bytes, not a whole number of tokens of num_layers=3 x top_k=3",
             hf.routes_from_sglang, text, 3, 3)
    _refused("not base64 text", hf.routes_from_sglang, "not*base64", 2, 3)
    _refused("num_layers must be an int >= 1, got 0", hf.routes_from_sglang, text, 0, 3)
    _refused("top_k must be an int >= 1, got True", hf.routes_from_sglang, text, 2, True)
    _refused(r"top_k=2; the config routes", hf.routes_from_sglang, text, 3, 2,
             config=first_dense)


def test_the_docs_example_runs_and_keeps_the_moe_layers_rows(monkeypatch):
    """docs/lm.md's example, run from the repository's root as it says."""
    names = kit.run_docs_example(monkeypatch, "## Routes from an inference engine")
    want = np.concatenate([names["prompt_rows"], names["generated_rows"]])[:, 1:]
    assert names["routes"].dtype == np.int32
    np.testing.assert_array_equal(names["routes"], want)
