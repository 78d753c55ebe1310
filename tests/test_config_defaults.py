"""The config builders of :mod:`sparsemixer_jax.config` write the typed sections' own defaults:
a field left at its builder's value reads as the field's default, so a section built directly
computes what a config built by the builder does."""

import dataclasses

import pytest

from sparsemixer_jax import config as config_schema
from sparsemixer_jax.partitioning import read_rules
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.runtime import RuntimeConfig
from sparsemixer_jax.sharding import MeshConfig
from sparsemixer_jax.training.optim import OptimSettings

# Fields a section fills from another section or from the model, not from its own builder.
NOT_BUILT = {OptimSettings: {"train_routers", "roles"}}
# Builder fields read by another section: config.router.trainable is OptimSettings.train_routers.
READ_ELSEWHERE = {RouterConfig: {"trainable"}}


def _defaults(cls: type) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _differences(built: dict, cls: type) -> list[str]:
    """``"field: builder X, section Y"`` for each default that differs, and the fields only one
    side has."""
    defaults = {name: value for name, value in _defaults(cls).items()
                if name not in NOT_BUILT.get(cls, set())}
    built = {name: value for name, value in built.items()
             if name not in READ_ELSEWHERE.get(cls, set())}
    out = [f"{name}: builder {value!r}, section {defaults[name]!r}"
           for name, value in built.items() if name in defaults and defaults[name] != value]
    out += [f"{name}: the builder has no default" for name in defaults.keys() - built.keys()]
    out += [f"{name}: the section has no field" for name in built.keys() - defaults.keys()]
    return sorted(out)


@pytest.mark.parametrize("cls, built", [
    (RouterConfig, config_schema.router_config().to_dict()),
    (RuntimeConfig, config_schema.runtime_config().to_dict()),
    (OptimSettings, config_schema.optim_config(OptimSettings.schedule).to_dict()),
], ids=["router", "runtime", "optim"])
def test_every_builder_default_is_its_sections_default(cls, built):
    assert _differences(built, cls) == []


def test_the_mesh_builder_writes_the_mesh_sections_defaults():
    built = config_schema.mesh_config().to_dict()
    assert read_rules(built.pop("rules")) == MeshConfig.rules
    assert _differences(built, MeshConfig) == ["rules: the builder has no default"]


def test_router_trainable_is_the_optimiser_sections_default():
    assert config_schema.router_config().trainable == OptimSettings.train_routers


def test_the_check_sees_a_differing_default():
    built = {**config_schema.runtime_config().to_dict(), "rng_impl": "rbg", "extra": 1}
    del built["deterministic"]
    assert _differences(built, RuntimeConfig) == [
        "deterministic: the builder has no default", "extra: the section has no field",
        "rng_impl: builder 'rbg', section 'threefry2x32'"]
