"""The model-type records (sparsemixer_jax.hf.families): one per type, read both ways."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from sparsemixer_jax import hf
from sparsemixer_jax.hf.families import FAMILIES
from sparsemixer_jax.models.lm_config import MODEL_TYPES
from sparsemixer_jax.models.lm_loss import token_nll
from sparsemixer_jax.routers.registry import ROUTERS

DATA = os.path.join(os.path.dirname(__file__), "data", "hf")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def test_every_model_type_has_one_record():
    assert tuple(FAMILIES) == MODEL_TYPES


def _away_from(value, name=""):
    """A value of the same kind as ``value`` that the type's key ``name`` may take, but
    different (a Gated DeltaNet head count doubled: value heads stay a multiple of key
    heads)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 2 * value if name.startswith("linear_num_") else value + 4
    if isinstance(value, float):
        return round(value + 0.05, 4)
    return 0.7  # clip_qkv: None (off) -> a clamp


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_own_key_is_written_back_as_read(model_type):
    """Every key of a type's record set away from the tiny checkpoint's value survives
    config.json -> LMConfig -> config.json -> LMConfig (a key read but not written, or written
    under another name, would fall back to its default)."""
    family = FAMILIES[model_type]
    with open(os.path.join(DATA, model_type, "config.json")) as f:
        source = json.load(f)
    for key in family.keys:
        cfg = {**source, key.name: _away_from(source.get(key.name, family.default(key.name)),
                                              key.name)}
        config = hf.from_hf(cfg)
        assert config.value(key.fields[0]) == key.cast(cfg[key.name])
        again = hf.from_hf(hf.to_hf(config))
        assert again.replace(hf_config="") == config.replace(hf_config=""), key.name


def test_a_key_of_another_type_is_refused():
    with open(os.path.join(DATA, "mixtral", "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="key 'clip_qkv' is not known for this type"):
        hf.from_hf({**cfg, "clip_qkv": 1.0})


def test_glm4_moe_reads_the_hubs_spelling_as_transformers_5s():
    """GLM-4.5's own config.json: top-level rope_theta and partial_rotary_factor,
    rope_scaling null, the MTP layer count (transformers builds no MTP layer: nothing to read)."""
    with open(os.path.join(DATA, "glm4_moe", "config.json")) as f:
        new = json.load(f)
    hub = {k: v for k, v in new.items() if k != "rope_parameters"}
    hub.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling=None,
               partial_rotary_factor=new["rope_parameters"]["partial_rotary_factor"],
               num_nextn_predict_layers=1)
    config = hf.from_hf(hub)
    assert config.replace(hf_config="") == hf.from_hf(new).replace(hf_config="")
    assert config.arch.rope.partial_rotary_factor == 0.5
    assert config.arch.moe_layers == (False, True, True) and config.selection_bias
    with pytest.raises(ValueError, match=r"norm_topk_prob=False is not implemented \(only True"):
        hf.from_hf({**new, "norm_topk_prob": False})
    # A model routing otherwise than its type (softmax scores) is written with its routing
    # recorded (transformers computes the type's own), which loading restores.
    softmax = config.replace(router_options=(("group_score", "max"), ("score", "softmax")))
    written = hf.to_hf(softmax)
    assert written[hf.ROUTING_KEY]["options"] == {"group_score": "max", "score": "softmax"}
    assert hf.from_hf(written).replace(hf_config="") == softmax.replace(hf_config="")


def test_glm4_moe_lite_reads_the_hubs_spelling_and_refuses_in_one_line():
    """GLM-4.7-Flash's own config.json: top-level rope_theta, rope_scaling null,
    partial_rotary_factor 1.0, the router spelled as DeepSeek-V3's, first_k_dense_replace and
    no mlp_layer_types (transformers' default: the first layer dense), the MTP layer count."""
    with open(os.path.join(DATA, "glm4_moe_lite", "config.json")) as f:
        new = json.load(f)
    hub = {k: v for k, v in new.items() if k not in ("rope_parameters", "mlp_layer_types")}
    hub.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling=None,
               partial_rotary_factor=1.0, topk_method="noaux_tc", first_k_dense_replace=1,
               num_nextn_predict_layers=1)
    config = hf.from_hf(hub)
    assert config.arch.moe_layers == (False, True, True, True)
    dense_first = hf.from_hf({**new, "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    assert config.replace(hf_config="") == dense_first.replace(hf_config="")
    assert hf.to_hf(config)["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    for change, message in (
            ({"first_k_dense_replace": 2}, r"first_k_dense_replace=2 disagrees with the dense "
                                           r"layers \[0\] of mlp_layer_types"),
            ({"mlp_layer_types": ["dense", "moe", "dense", "sparse"]},
             r"mlp_layer_types\[1\]='moe' is not one of sparse, dense"),
            ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types has 2 entries for "
                                                       "num_hidden_layers=4"),
            ({"topk_method": "greedy"}, r"topk_method='greedy' is not implemented"),
            ({"norm_topk_prob": False}, r"norm_topk_prob=False is not implemented"),
            ({"num_key_value_heads": 2}, "latent attention expands keys and values for every "
                                         "head: num_kv_heads=2"),
            ({"partial_rotary_factor": 0.5}, "latent attention rotates qk_rope_head_dim")):
        with pytest.raises(ValueError, match=message) as error:
            hf.from_hf({**hub, **change})
        assert "\n" not in str(error.value)


def test_minimax_m2_reads_the_hubs_spelling_and_refuses_in_one_line():
    """MiniMax-M2's own config.json: top-level rope_theta, the rotated width as rotary_dim
    alone; every key transformers computes at one value only is refused at another."""
    with open(os.path.join(DATA, "minimax_m2", "config.json")) as f:
        new = json.load(f)
    hub = {k: v for k, v in new.items() if k != "rope_parameters"}
    hub["rope_theta"] = new["rope_parameters"]["rope_theta"]
    config = hf.from_hf(hub)
    assert config.replace(hf_config="") == hf.from_hf(new).replace(hf_config="")
    assert config.arch.rotary_dim == 4 and config.arch.qk_norm == "full"
    assert config.selection_bias and config.arch.rope.theta == 20000.0
    written = hf.to_hf(config)
    assert written["rotary_dim"] == 4 and written["attn_type_list"] == [1, 1, 1]
    for change, message in (
            ({"use_qk_norm": False}, "use_qk_norm=False is not implemented"),
            ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head' is not implemented"),
            ({"scoring_func": "softmax"}, "scoring_func='softmax' is not implemented"),
            ({"use_routing_bias": False}, "use_routing_bias=False is not implemented"),
            ({"shared_intermediate_size": 8}, "shared_intermediate_size=8 is not implemented"),
            ({"attn_type_list": [1, 0, 1]}, r"attn_type_list\[1\]=0 is not implemented"),
            ({"rotary_dim": 6, "partial_rotary_factor": 0.5},
             "rotary_dim=6 disagrees with partial_rotary_factor=0.5 of head_dim=8"),
            ({"rotary_dim": 9}, r"rotary_dim=9 must be an int in \[1, head_dim=8\]"),
            ({"sliding_window": 4}, "key 'sliding_window' is not known")):
        with pytest.raises(ValueError, match=message) as error:
            hf.from_hf({**hub, **change})
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3", "glm4_moe_lite",
                                        "minimax_m2"])
def test_every_router_that_composes_with_sigmoid_scores_takes_the_checkpoint(model_type):
    """Chosen at load, every router of the registry keeps the type's sigmoid scores (and GLM's
    and DeepSeek's groups scored by their two best and scaling); the one whose formula has no
    sigmoid form is refused in one line saying so."""
    with open(os.path.join(DATA, model_type, "config.json")) as f:
        cfg = json.load(f)
    own = dict(hf.from_hf(cfg).router_options)
    assert own["score"] == "sigmoid"
    assert own.get("group_score") == (None if model_type == "minimax_m2" else "top2_sum")
    for name in ROUTERS:
        if name == "densemixer_blog":
            with pytest.raises(ValueError, match="score='sigmoid' does not compose with router "
                                                 "'densemixer_blog': its formula") as error:
                hf.from_hf(cfg, router=name)
            assert "\n" not in str(error.value)
            continue
        config = hf.from_hf(cfg, router=name, jitter_eps=0.1 if "sparsemixer" in name else 0.0)
        assert config.router == name and dict(config.router_options) == own


def test_llama4_text_reads_the_hubs_spelling_and_refuses_in_one_line():
    """Llama 4's text config as the Hub's checkpoints spell it: top-level rope_theta and
    rope_scaling (Scout's llama3 with equal band factors: nothing blended), the routed layers
    listed in moe_layers, no layer_types (the rotary layers chunked), attn_temperature_tuning
    as a number, for_llm_compressor. Its gates scale the experts' inputs, which only the switch
    router computes: every other router of the registry is refused in one line saying so."""
    new = read_json(os.path.join(DATA, "llama4_text", "config.json"))
    hub = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types",
                                                      "interleave_moe_layer_step")}
    rope = dict(new["rope_parameters"])
    hub.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, moe_layers=[1, 3],
               attn_temperature_tuning=4, for_llm_compressor=False)
    config = hf.from_hf(hub)
    assert config.replace(hf_config="") == hf.from_hf(new).replace(hf_config="")
    assert config.arch.sliding_layers == config.arch.rope_layers == (True, True, False, True)
    assert config.input_gates and config.shared_expert_size == config.arch.moe_intermediate_size
    scout = hf.from_hf({**hub, "rope_scaling": {**rope, "high_freq_factor": 1.0}})
    assert scout.arch.rope.low_freq_factor == scout.arch.rope.high_freq_factor
    for change, message in (
            ({"no_rope_layers": [1, 2, 0, 1]}, r"no_rope_layers\[1\]=2 is not one of 0, 1"),
            ({"layer_types": ["chunked_attention"] * 3 + ["sliding_attention"]},
             r"layer_types\[3\]='sliding_attention' is not one of chunked_attention, "
             r"full_attention"),
            ({"moe_layers": [1, 4]}, r"moe_layers=\[1, 4\] must be layer indices below "
                                     r"num_hidden_layers=4")):
        with pytest.raises(ValueError, match=message) as error:
            hf.from_hf({**hub, **change})
        assert "\n" not in str(error.value)
    for name in ROUTERS:
        if name == "switch":
            continue
        with pytest.raises(ValueError, match=rf"input_gates .* take router 'switch' only, got "
                                             rf"'{name}'") as error:
            hf.from_hf(new, router=name, jitter_eps=0.1 if "sparsemixer" in name else 0.0)
        assert "\n" not in str(error.value)


def _write_safetensors(path, arrays):
    """``arrays`` (numpy, float8 ones as ml_dtypes) as a safetensors file (the numpy writer of
    the safetensors package has no float8)."""
    dtypes = {"float32": "F32", "float8_e4m3fn": "F8_E4M3"}
    entries, blobs, offset = {}, [], 0
    for name, value in arrays.items():
        data = np.ascontiguousarray(value).tobytes()
        entries[name] = {"dtype": dtypes[value.dtype.name], "shape": list(value.shape),
                         "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(entries).encode()
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def test_minimax_m2_block_fp8_checkpoint_loads_dequantized(tmp_path):
    """MiniMax-M2 as the Hub ships it: every projection of the layers (attention and experts)
    e4m3 with a float32 weight_scale_inv per block (8 x 8 here: the experts' 12 rows end in a
    partial block), the router, selection bias, norms, embeddings and head unquantized. The
    model holds each e4m3 value times its block's scale exactly (float32 products of an e4m3
    value and a float32 scale; the export writes them back unrounded)."""
    source = os.path.join(DATA, "minimax_m2")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    stored, want = {}, {}
    for name, value in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith(("proj.weight", "w1.weight",
                                                                     "w2.weight", "w3.weight"))):
            stored[name] = want[name] = value
            continue
        rows, cols = -(-value.shape[0] // 8), -(-value.shape[1] // 8)
        tiles = np.pad(np.abs(value), ((0, rows * 8 - value.shape[0]),
                                       (0, cols * 8 - value.shape[1])))
        scale = (tiles.reshape(rows, 8, cols, 8).max(axis=(1, 3)) / 448.0).astype(np.float32)
        expanded = np.repeat(np.repeat(scale, 8, 0), 8, 1)[:value.shape[0], :value.shape[1]]
        codes = (value / expanded).astype(ml_dtypes.float8_e4m3fn)
        stored[name], stored[name[:-len("weight")] + "weight_scale_inv"] = codes, scale
        want[name] = codes.astype(np.float32) * expanded
    _write_safetensors(tmp_path / "model.safetensors", stored)
    cfg = read_json(os.path.join(source, "config.json"))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn",
                                  "activation_scheme": "dynamic", "weight_block_size": [8, 8],
                                  "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                             "lm_head"]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    model, config = hf.load_pretrained(str(tmp_path))
    hf.save_pretrained(model, config, str(tmp_path / "export"))
    assert "quantization_config" not in read_json(tmp_path / "export" / "config.json")
    written = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert written.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert not np.array_equal(written["model.layers.1.block_sparse_moe.experts.2.w2.weight"],
                              tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "minimax_m2", "llama4_text"])
def test_every_router_fine_tunes_the_checkpoint(model_type):
    """Each router of the registry chosen at load takes two SGD updates of the checkpoint in
    training mode (next-token loss plus the balance loss): both losses finite, and every MoE
    layer's router and every MoE layer's experts receive a gradient (moved by the update). The
    one router whose formula has no sigmoid form is refused in one line, and Llama 4 takes
    switch alone (the fast tests above)."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)
    path = os.path.join(DATA, model_type)
    for name in ["switch"] if model_type == "llama4_text" else ROUTERS:
        if name == "densemixer_blog":
            continue
        model, _ = hf.load_pretrained(path, router=name,
                                      jitter_eps=0.1 if "sparsemixer" in name else 0.0)
        model.train()
        before = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def update(model, optimizer):
            def loss(model):
                out = model.forward(ids[:, :-1])
                return token_nll(out.logits, ids[:, 1:]).mean() + 0.01 * out.aux["balance_loss"]
            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        losses = [float(update(model, optimizer)) for _ in range(2)]
        assert all(np.isfinite(losses)), (name, losses)
        after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        checked = 0
        for path_, old in jax.tree_util.tree_leaves_with_path(before):
            keys = [getattr(k, "key", k) for k in path_]
            if "moe" in keys and keys[-1] in ("kernel", "w_gate", "w_up", "w_down") and \
                    ("router" in keys or keys[-1] != "kernel"):
                new = after
                for k in keys:
                    new = new[k]
                assert not np.array_equal(np.asarray(new), np.asarray(old)), (name, keys)
                checked += 1
        # A router kernel and 3 expert arrays per MoE layer of each stack's unit.
        assert checked == 4 * sum(sum(unit) for unit, _ in model.stack_patterns), name
