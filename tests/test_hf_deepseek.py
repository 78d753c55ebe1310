"""DeepSeek-V3: the block-FP8 checkpoints the Hub ships, the Hub's config.json spelling (and
Kimi-K2's ``kimi_k2``), multi-token-prediction layers and the one-line refusals (its logits,
generation, cached decoding and round trip are tests/test_hf.py's, as every type's).

``tests/data/hf/deepseek_v3`` (float32, transformers 5's spelling) and
``tests/data/hf/deepseek_v3_fp8`` (e4m3 weights with 8 x 8 blocks, partial edge blocks
included; the Hub's spelling; one MTP layer's tensors) were made by
``scripts/make_hf_references.py`` with transformers 5.23; the FP8 directory's reference logits
are transformers' of the dequantized weights."""

import json
import logging
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from sparsemixer_jax import hf
from sparsemixer_jax.hf import fp8, safetensors_read
from tests.test_hf import DATA, logits_of, read_json, reference, relative_error, reload

FP8_DIR = os.path.join(DATA, "deepseek_v3_fp8")
SCALE = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"


@pytest.fixture(scope="module")
def quantized():
    return hf.load_pretrained(FP8_DIR)


def test_fp8_checkpoint_equals_transformers_and_exports_in_float32(quantized, tmp_path):
    """Logits within 1e-4 of the largest (float32 sums in another order) and greedy tokens
    equal transformers' of the dequantized weights; the export is float32 without
    quantization_config and reloads to the same logits."""
    model, config = quantized
    # a null rank; the interleave default
    assert config.arch.q_lora_rank == 0 and config.arch.rope_interleave
    ref = reference("deepseek_v3_fp8")
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    hf.save_pretrained(model, config, str(tmp_path))
    saved = read_json(tmp_path / "config.json")
    assert "quantization_config" not in saved and "head_dim" not in saved
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight").dtype == \
            np.float32
    assert not any(name.endswith(fp8.SCALE_SUFFIX) or ".layers.2." in name for name in names)
    again = reload(str(tmp_path), config)
    np.testing.assert_array_equal(np.asarray(logits_of(again, ref["input_ids"])),
                                  np.asarray(logits_of(model, ref["input_ids"])))


def test_fp8_dequantization_of_tensors_we_quantize():
    """A [13, 20] weight in 8 x 8 blocks (the last row and column blocks partial: a 2 x 3
    scale grid) quantized here to e4m3 dequantizes to each value times its own block's scale,
    computed element by element."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(13, 20)).astype(np.float32)
    scale = rng.uniform(0.01, 2.0, size=(2, 3)).astype(np.float32)
    codes = np.empty_like(weight)
    for i in range(13):
        for j in range(20):
            codes[i, j] = weight[i, j] / scale[i // 8, j // 8]
    e4m3 = codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    fp8.check_scale(weight.shape, scale, (8, 8), "w", "file")
    got = fp8.dequantize(e4m3, scale, (8, 8))
    want = np.array([[e4m3[i, j] * scale[i // 8, j // 8] for j in range(20)] for i in range(13)],
                    np.float32)
    np.testing.assert_array_equal(got, want)
    # Blocks of 16 would need a 1 x 2 grid: the 2 x 3 one is refused, naming the scale tensor.
    with pytest.raises(ValueError, match=r"file: tensor 'w_scale_inv' is float32 \[2, 3\], "
                                         r"expected float \[1, 2\]"):
        fp8.check_scale(weight.shape, scale, (16, 16), "w", "file")


def _rewrite(tmp_path, drop=(), replace=None):
    """The FP8 reference directory copied with tensors dropped or replaced (float32 arrays),
    written with its own safetensors header (the numpy writer has no float8)."""
    shutil.copy(os.path.join(FP8_DIR, "config.json"), tmp_path)
    source = os.path.join(FP8_DIR, "model.safetensors")
    entries, blobs, offset = {}, [], 0
    for name, entry in safetensors_read.header(source).items():
        if name in drop:
            continue
        if replace and name in replace:
            data, dtype, shape = replace[name].tobytes(), "F32", list(replace[name].shape)
        else:
            start, end = entry["data_offsets"]
            data = np.fromfile(source, np.uint8, count=end - start,
                               offset=entry["start"]).tobytes()
            dtype, shape = entry["dtype"], entry["shape"]
        entries[name] = {"dtype": dtype, "shape": shape,
                         "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(entries).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    return str(tmp_path)


def test_fp8_bad_scales_are_one_line(tmp_path, caplog):
    path = _rewrite(tmp_path)  # unchanged: loads, and says once which layers it skipped
    with caplog.at_level(logging.INFO, logger="sparsemixer_jax.hf.checkpoint"):
        hf.load_pretrained(path)
    skipped = [r.getMessage() for r in caplog.records if "past num_hidden_layers" in r.message]
    assert len(skipped) == 1 and "layers [2]" in skipped[0]
    weight = SCALE.removesuffix(fp8.SCALE_SUFFIX)
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{weight}' is float8 "
                                         rf"but the checkpoint has no '{SCALE}'"):
        hf.load_pretrained(_rewrite(tmp_path, drop=(SCALE,)))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{SCALE}' is float32 "
                                         r"\[1, 2\], expected float \[2, 2\] \(one scale per 8 x "
                                         r"8 block of .*\[14, 16\]\)"):
        hf.load_pretrained(_rewrite(tmp_path, replace={SCALE: np.ones((1, 2), np.float32)}))


def test_hub_and_kimi_spellings_and_refusals():
    """The Hub's rope_scaling with ``type`` and mscale / mscale_all_dim reads as transformers
    5's rope_parameters; kimi_k2 reads as deepseek_v3 and exports as it; the Hub's router keys
    at other values than DeepSeek-V3's are refused in one line."""
    new = read_json(os.path.join(DATA, "deepseek_v3", "config.json"))
    hub = {k: v for k, v in new.items() if k not in ("rope_parameters", "head_dim",
                                                     "qk_head_dim")}
    rope = dict(new["rope_parameters"])
    hub.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"),
                                                                 **rope},
               topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1,
               aux_loss_alpha=0.001, seq_aux=True, model_type="kimi_k2")
    config = hf.from_hf(hub)
    assert config.replace(hf_config="") == hf.from_hf(new).replace(hf_config="")
    assert config.arch.rope.mscale_all_dim == 0.7 and config.arch.model_type == "deepseek_v3"
    assert hf.to_hf(config)["model_type"] == "deepseek_v3"
    # Kimi-K2's rope_scaling has beta_fast == beta_slow (1.0): read, the ramp at its least width.
    kimi = hf.from_hf({**hub, "rope_scaling": {**hub["rope_scaling"], "beta_fast": 1.0,
                                               "beta_slow": 1.0}})
    assert kimi.arch.rope.beta_fast == kimi.arch.rope.beta_slow == 1.0
    for key, value in (("topk_method", "greedy"), ("scoring_func", "softmax"),
                       ("moe_layer_freq", 2)):
        with pytest.raises(ValueError, match=rf"{key}={value!r} is not implemented"):
            hf.from_hf({**hub, key: value})
    quantization = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match=r"quant_method='bitsandbytes' is not supported for "
                                         r"this type \(supported: fp8\)"):
        hf.from_hf({**hub, "quantization_config": quantization})
    with pytest.raises(ValueError, match=r"supported: .*deepseek_v3.* \(read: kimi_k2 as "):
        hf.from_hf({**hub, "model_type": "kimi_k3"})


def test_latent_attention_flops_count_its_tensors():
    """Model FLOPs of latent attention's projections: 2 per weight per token, x 3 for the
    backward, counted from the reference checkpoint's attention tensors; the scores and weighted
    sum: 2 H (d + v) per key over (L + 1) / 2 keys."""
    from sparsemixer_jax.aot.model_flops import lm_flops_per_token

    config = hf.from_hf(read_json(os.path.join(DATA, "deepseek_v3", "config.json")))
    with safe_open(os.path.join(DATA, "deepseek_v3", "model.safetensors"), "np") as f:
        weights = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()  # noqa: SIM118
                      if ".self_attn." in k and k.endswith(("proj.weight", "_mqa.weight")))
    got = lm_flops_per_token(config, 12)
    assert got["attention_proj"] == 3 * 2 * weights
    h, d, v = config.arch.num_heads, config.arch.head_dim, config.arch.v_head_dim
    assert got["attention_scores"] == 3 * config.arch.num_layers * 2 * 13 / 2 * h * (d + v)


def test_rope_halves_equal_interleaved_pairs_with_permuted_weights(tmp_path):
    """``rope_interleave=False`` rotates halves (transformers' ``rotate_half``): the reference
    model with each head's rotated query rows and the shared key's rows reordered from pairs
    ``(x0, x1), (x2, x3)`` to halves ``(x0, x2), (x1, x3)`` computes transformers' logits of
    the interleaved original (the rotations agree exactly; float32 sums within 1e-4)."""
    from safetensors.numpy import load_file, save_file

    source = os.path.join(DATA, "deepseek_v3")
    cfg = {**read_json(os.path.join(source, "config.json")), "rope_interleave": False}
    nope, rope, heads = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    order = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    head = np.concatenate([np.arange(nope), nope + order])
    queries = np.concatenate([h * (nope + rope) + head for h in range(heads)])
    shared = np.concatenate([np.arange(cfg["kv_lora_rank"]), cfg["kv_lora_rank"] + order])
    tensors = load_file(os.path.join(source, "model.safetensors"))
    for name in tensors:
        if name.endswith("q_b_proj.weight"):
            tensors[name] = np.ascontiguousarray(tensors[name][queries])
        elif ".kv_a_proj_with_mqa." in name:
            tensors[name] = np.ascontiguousarray(tensors[name][shared])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    model, config = hf.load_pretrained(str(tmp_path))
    assert not config.arch.rope_interleave
    ref = reference("deepseek_v3")
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
