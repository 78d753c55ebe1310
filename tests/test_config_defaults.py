"""The config builders of :mod:`sparsemixer_jax.training.config` write the typed sections' own
defaults:
a field left at its builder's value reads as the field's default, so a section built directly
computes what a config built by the builder does. The model sections' schema configs (each
task's config file) differ from their sections' defaults only where named, with the reason."""

import dataclasses
import importlib

import ml_collections
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax.layers.fairseq import ModelConfig
from sparsemixer_jax.models.electra import Electra, GeneratorConfig
from sparsemixer_jax.models.encoder import EncoderConfig
from sparsemixer_jax.models.encoder_decoder import Transformer, TransformerConfig
from sparsemixer_jax.models.lm_config import LMExecution
from sparsemixer_jax.moe import MoEConfig, MoEFeedForward
from sparsemixer_jax.moe.config import family_fields
from sparsemixer_jax.parallel.partitioning import read_rules
from sparsemixer_jax.parallel.sharding import MeshConfig
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.tasks import TASKS, run_config
from sparsemixer_jax.tasks.lm_sections import LMModelConfig
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.optim import OptimSettings
from sparsemixer_jax.training.runtime import RuntimeConfig
from tests import kit

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


# ------------------------------------------------------------------------------ model sections


def _model_defaults(cls: type) -> dict:
    """The defaults of model section ``cls``, with its feed-forward section's (``MoEConfig``,
    read from the same ``config.model``) for a section that holds one."""
    defaults = _defaults(cls)
    if any(f.name == "moe" for f in dataclasses.fields(cls)):
        # The fields a model family sets are in no config schema.
        defaults.update({name: value for name, value in _defaults(MoEConfig).items()
                         if name not in family_fields()})
    if cls is LMModelConfig:  # the same config.model's execution fields (LMExecution's)
        defaults.update(_defaults(LMExecution))
    return defaults


def _model_differences(built: dict, cls: type) -> list[str]:
    """:func:`_differences` for a model section: a field without a default (a width, set by
    every config) is a field, not a difference."""
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    defaults = _model_defaults(cls)
    out = [f"{name}: builder {value!r}, section {defaults[name]!r}"
           for name, value in built.items() if name in defaults and defaults[name] != value]
    out += [f"{name}: the builder has no default" for name in defaults.keys() - built.keys()]
    out += [f"{name}: the section has no field"
            for name in built.keys() - defaults.keys() - required]
    return sorted(out)


def test_the_model_builder_writes_the_shared_model_sections_defaults():
    built = config_schema.moe_model_fields(ml_collections.ConfigDict()).to_dict()
    assert _model_differences(built, ModelConfig) == []
    assert set(built) == set(_model_defaults(ModelConfig))  # every shared field, no other


# Where each task's schema config (TASKS[task].schema) sets a model section away from the
# section's default, and why; anything else it writes is the default.
SCHEMA_CHOICES = {
    # Transformer-base Switch: 4 experts (the n4 variant), MoE on every other layer.
    ("translation", "model", TransformerConfig): [
        "moe_every: builder 2, section 1", "num_experts: builder 4, section 0"],
    # The paper's BERT-base discriminator: GELU, bf16, BERT's 512 learned positions beside the
    # relative bias, Admin's initialisation, 4 experts on every other layer.
    ("pretraining", "model", EncoderConfig): [
        "absolute_positions: builder 512, section 0", "activation: builder 'gelu', section 'relu'",
        "compute_dtype: builder 'bfloat16', section 'float32'",
        "init: builder 'admin', section 'fairseq'", "moe_every: builder 2, section 1",
        "num_experts: builder 4, section 0"],
    # The generator's section holds overrides of the discriminator's (None = the same): 4 layers
    # and no experts, the paper's.
    ("pretraining", "generator", GeneratorConfig): [
        "moe_every: the builder has no default", "mlp_dim: the builder has no default",
        "num_experts: builder 0, section None", "num_heads: the builder has no default",
        "num_layers: builder 4, section None"],
    # The quickstart language model is grouped-query (2 key/value heads); a from-scratch
    # Mixtral needs no further config.json keys.
    ("lm", "model", LMModelConfig): [
        "hf_keys: the builder has no default", "num_kv_heads: builder 2, section 0"],
}


@pytest.mark.parametrize("task, section, cls", SCHEMA_CHOICES,
                         ids=[f"{t}.{s}" for t, s, _ in SCHEMA_CHOICES])
def test_each_schema_config_differs_from_its_model_sections_defaults_only_by_choice(
        task, section, cls):
    schema = TASKS[task].schema.removesuffix(".py").replace("/", ".")
    built = importlib.import_module(schema).get_config()[section].to_dict()
    assert _model_differences(built, cls) == sorted(SCHEMA_CHOICES[task, section, cls])


def test_every_model_section_is_checked_against_its_schema_config():
    """A task's config-read model section missing from SCHEMA_CHOICES would go unchecked."""
    assert {(task, section) for task, section, _ in SCHEMA_CHOICES} == {
        (task, section) for task, registered in TASKS.items()
        for section in ("model", "generator") if section in registered.sections}


def test_a_layer_built_directly_is_initialised_as_the_configs_build_it():
    """``MoEFeedForward`` of the sections' own defaults draws the same parameters as the layer
    a config's model and router sections build (the paper's ``fairseq`` initialisation), bit
    for bit (the same draws in the same order)."""
    model = config_schema.moe_model_fields(ml_collections.ConfigDict())
    model.num_experts = 3
    moe = MoEConfig.from_config(model)
    router = RouterConfig.from_config(config_schema.router_config())
    direct = MoEFeedForward((8, 16), MoEConfig(num_experts=3), RouterConfig(), rngs=nnx.Rngs(0))
    built = MoEFeedForward((8, 16), moe, router, rngs=nnx.Rngs(0))
    assert (direct.moe, direct.router_config) == (moe, router)
    assert direct.moe.init == "fairseq"
    for a, b in zip(direct.expert_params(), built.expert_params(), strict=True):
        np.testing.assert_array_equal(a[...], b[...])
    np.testing.assert_array_equal(direct.router.bias[...], built.router.bias[...])


@pytest.mark.parametrize("task_name", ["translation", "pretraining"])
def test_a_model_built_directly_equals_the_tasks(task_name):
    """A model built from the typed sections read straight off the config, with the loop's
    seeds, has the parameters of the model its task builds, bit for bit: the task hands its
    sections to the model unchanged, and the constructors take nothing else."""
    config = kit.tiny_config(task_name)
    run = run_config(config)
    vocab_size = 40
    by_task = run.task.build_model(run, vocab_size, None)
    seed = config.seed
    rngs = nnx.Rngs(params=seed, dropout=seed + 1, router=seed + 2)
    if task_name == "translation":
        direct = Transformer(*kit.sections(config, TransformerConfig), vocab_size, rngs=rngs)
    else:
        model, router = kit.sections(config, EncoderConfig)
        generator = GeneratorConfig.from_config(config.generator).encoder(model)
        direct = Electra(model, router, generator, vocab_size, rngs=rngs)
    ours, theirs = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (direct, by_task))
    assert [path for path, _ in ours] == [path for path, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
