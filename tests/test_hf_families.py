"""The model-type records (sparsemixer_jax.hf.families): one per type, read both ways."""

import json
import os

import pytest

from sparsemixer_jax import hf
from sparsemixer_jax.hf.families import FAMILIES
from sparsemixer_jax.models.lm_config import MODEL_TYPES
from sparsemixer_jax.routers.registry import ROUTERS

DATA = os.path.join(os.path.dirname(__file__), "data", "hf")


def test_every_model_type_has_one_record():
    assert tuple(FAMILIES) == MODEL_TYPES


def _away_from(value):
    """A value of the same kind as ``value`` that the type's key may take, but different."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 4
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
        cfg = {**source, key.name: _away_from(source.get(key.name, family.default(key.name)))}
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


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3", "glm4_moe_lite"])
def test_every_router_that_composes_with_sigmoid_scores_takes_the_checkpoint(model_type):
    """Chosen at load, every router of the registry keeps the type's sigmoid scores, groups
    scored by their two best and scaling; the one whose formula has no sigmoid form is
    refused in one line saying so."""
    with open(os.path.join(DATA, model_type, "config.json")) as f:
        cfg = json.load(f)
    own = dict(hf.from_hf(cfg).router_options)
    assert own["score"] == "sigmoid" and own["group_score"] == "top2_sum"
    for name in ROUTERS:
        if name == "densemixer_blog":
            with pytest.raises(ValueError, match="score='sigmoid' does not compose with router "
                                                 "'densemixer_blog': its formula") as error:
                hf.from_hf(cfg, router=name)
            assert "\n" not in str(error.value)
            continue
        config = hf.from_hf(cfg, router=name, jitter_eps=0.1 if "sparsemixer" in name else 0.0)
        assert config.router == name and dict(config.router_options) == own
