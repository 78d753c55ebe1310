"""The model-type records (sparsemixer_jax.hf.families): one per type, read both ways."""

import json
import os

import pytest

from sparsemixer_jax import hf
from sparsemixer_jax.hf.families import FAMILIES
from sparsemixer_jax.models.lm_config import MODEL_TYPES

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
        assert getattr(config, key.fields[0]) == key.cast(cfg[key.name])
        again = hf.from_hf(hf.to_hf(config))
        assert again.replace(hf_config="") == config.replace(hf_config=""), key.name


def test_a_key_of_another_type_is_refused():
    with open(os.path.join(DATA, "mixtral", "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="key 'clip_qkv' is not known for this type"):
        hf.from_hf({**cfg, "clip_qkv": 1.0})
