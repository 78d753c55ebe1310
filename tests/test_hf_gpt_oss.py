"""gpt-oss: the MXFP4 checkpoints the Hub ships, the Hub's config.json spelling and the
one-line refusals (its logits, generation, cached decoding and round trip are
tests/test_hf.py's, as every type's).

``tests/data/hf/gpt_oss`` (float32, transformers 5's spelling) and
``tests/data/hf/gpt_oss_mxfp4`` (experts in MXFP4, the Hub's spelling) were made by
``scripts/make_hf_references.py`` with transformers 5.23; the MXFP4 directory's reference
logits are transformers' own after it dequantized the directory."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from sparsemixer_jax import hf
from sparsemixer_jax.hf import mxfp4
from tests.test_hf import DATA, logits_of, read_json, reference, relative_error, reload

MXFP4_DIR = os.path.join(DATA, "gpt_oss_mxfp4")


@pytest.fixture(scope="module")
def quantized():
    return hf.load_pretrained(MXFP4_DIR)


def test_mxfp4_checkpoint_equals_transformers_and_exports_in_float32(quantized, tmp_path):
    model, config = quantized
    ref = reference("gpt_oss_mxfp4")
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    # The export holds the dequantized experts in float32 and says nothing of quantization.
    hf.save_pretrained(model, config, str(tmp_path))
    saved = read_json(tmp_path / "config.json")
    assert "quantization_config" not in saved and saved["dtype"] == "float32"
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").shape == (4, 32, 64)
    assert not any(name.endswith(("_blocks", "_scales")) for name in names)
    again = reload(str(tmp_path), config)
    np.testing.assert_array_equal(np.asarray(logits_of(again, ref["input_ids"])),
                                  np.asarray(logits_of(model, ref["input_ids"])))


def test_mxfp4_dequantization_of_codes_we_encode():
    """Random FP4 codes and scales packed as the format says (low nibble the even element,
    scale = exponent + 127, blocks along the input axis) dequantize to exactly
    ``value(code) * 2^exponent``, transposed to ``[N, in, out]``."""
    rng = np.random.default_rng(0)
    n, out, groups = 3, 5, 2
    codes = rng.integers(0, 16, (n, out, groups, 32), dtype=np.uint8)
    exponents = rng.integers(-20, 20, (n, out, groups))
    sign = np.where(codes >= 8, -1.0, 1.0)
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes % 8]
    want = (sign * magnitude * 2.0 ** exponents[..., None]).reshape(n, out, groups * 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponents + 127).astype(np.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.dtype == np.float32 and got.shape == (n, groups * 32, out)
    np.testing.assert_array_equal(got, np.swapaxes(want, 1, 2))


def _copy(tmp_path, edit_tensors=None, edit_config=None):
    """The MXFP4 reference directory copied to ``tmp_path`` with its tensors or config edited."""
    shutil.copy(os.path.join(MXFP4_DIR, "config.json"), tmp_path)
    tensors = load_file(os.path.join(MXFP4_DIR, "model.safetensors"))
    save_file(edit_tensors(tensors) if edit_tensors else tensors,
              str(tmp_path / "model.safetensors"))
    if edit_config:
        cfg = edit_config(read_json(tmp_path / "config.json"))
        with open(tmp_path / "config.json", "w") as f:
            json.dump(cfg, f)
    return str(tmp_path)


def test_mxfp4_bad_input_is_one_line(tmp_path):
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    file = str(tmp_path / "model.safetensors")

    def without_scales(tensors):
        del tensors[scales]
        return tensors

    with pytest.raises(ValueError, match=rf"^{file}: tensor '.*down_proj_blocks' has no "
                                         f"'{scales}' in the checkpoint"):
        hf.load_pretrained(_copy(tmp_path, without_scales))

    def short_scales(tensors):
        tensors[scales] = tensors[scales][:, :-1].copy()
        return tensors

    with pytest.raises(ValueError, match=rf"^{file}: tensor '{scales}' is uint8 \[4, 31, 1\], "
                                         r"expected uint8 \[4, 32, 1\]"):
        hf.load_pretrained(_copy(tmp_path, short_scales))

    def fp8(cfg):
        return {**cfg, "quantization_config": {"quant_method": "fp8"}}

    with pytest.raises(ValueError, match=r"config.json \(gpt_oss\): quantization_config."
                                         r"quant_method='fp8' is not supported for this type "
                                         r"\(supported: mxfp4\)"):
        hf.load_pretrained(_copy(tmp_path, edit_config=fp8))
    mixtral = read_json(os.path.join(DATA, "mixtral", "config.json"))
    with pytest.raises(ValueError, match=r"quant_method='mxfp4' is not supported for this "
                                         r"type \(supported: none\)"):
        hf.from_hf({**mixtral, "quantization_config": {"quant_method": "mxfp4"}})


def test_the_hubs_spelling_reads_as_transformers_5s():
    """gpt-oss's config.json on the Hub: rope_scaling and rope_theta, experts_per_token,
    initial_context_length, no swiglu_alpha (1.702); layer_types absent means every other
    layer slides, from the first; an unknown entry is refused in one line."""
    new = read_json(os.path.join(DATA, "gpt_oss", "config.json"))
    hub = {k: v for k, v in new.items() if k not in ("rope_parameters", "swiglu_alpha")}
    rope = dict(new["rope_parameters"])
    hub.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope,
               experts_per_token=new["num_experts_per_tok"], initial_context_length=4096)
    config = hf.from_hf(hub)
    assert config.replace(hf_config="") == hf.from_hf(new).replace(hf_config="")
    assert config.arch.rope.kind == "yarn" and not config.arch.rope.truncate
    assert config.arch.sliding_layers == (True, False, False, True) and config.arch.attention_sinks
    # YaRN's frequencies span the rotated width where only part of each head rotates.
    partial = {**new["rope_parameters"], "partial_rotary_factor": 0.5}
    assert hf.from_hf({**new, "rope_parameters": partial}).arch.rope.partial_rotary_factor == 0.5
    default = hf.from_hf({k: v for k, v in new.items() if k != "layer_types"})
    assert default.arch.sliding_layers == (True, False, True, False)
    with pytest.raises(ValueError, match=r"^config.json \(gpt_oss\): layer_types\[2\]="
                                         r"'chunked_attention' is not implemented"):
        hf.from_hf({**new, "layer_types": ["sliding_attention", "full_attention",
                                           "chunked_attention", "full_attention"]})
    with pytest.raises(ValueError, match="the experts per token disagree"):
        hf.from_hf({**hub, "experts_per_token": 2})
