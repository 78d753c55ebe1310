"""``configs/lm_bench.py`` and the language model's dense variant (``model.num_experts = 0``):
built abstractly (shapes only), so the test is fast."""

import dataclasses

import pytest
from flax import nnx

from configs import lm_bench, lm_quickstart
from lab.benchmarks.lm_step import dense_twin
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import ARCH_FIELDS, EXECUTION_FIELDS
from sparsemixer_jax.tasks.language_model import LMTask
from sparsemixer_jax.training.steps import count_params


def _params(lm) -> int:
    model = nnx.eval_shape(lambda: CausalLM(lm, rngs=nnx.Rngs(0)))
    return count_params(nnx.state(model, nnx.Param))


def test_the_bench_models_have_equal_active_parameters():
    tasks = {}
    for variant in lm_bench.VARIANTS:
        config = lm_bench.get_config(variant)
        config.model.dispatch = "padded"  # grouped kernels refuse a CPU; the shapes are the same
        tasks[variant] = LMTask.from_config(config)
    moe, dense = tasks["moe"].lm, tasks["dense"].lm
    a = moe.arch
    assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == \
        (2048, 16, 16, 4, 128)
    assert all(moe.arch.moe_layers) and (moe.num_experts, moe.top_k) == (8, 2)
    assert not any(dense.arch.moe_layers) and dense.arch.intermediate_size == 4096
    assert tasks["moe"].data.batch_size * tasks["moe"].data.seq_len == 65536
    # Dense: the MoE model less its 6 unchosen experts (3 matrices of 2048 x 2048 each) and its
    # router (2048 x 8) in each of the 16 layers.
    unchosen = 16 * (6 * 3 * 2048 * 2048 + 2048 * 8)
    assert _params(dense) == _params(moe) - unchosen


def test_num_experts_0_is_the_benchmarks_dense_twin():
    config = lm_quickstart.get_config()
    twin = dense_twin(LMTask.from_config(config)).lm
    config.model.num_experts, config.model.mlp_dim = 0, 2 * config.model.mlp_dim
    dense = LMTask.from_config(config).lm
    # The expert fields route nothing in a model without routed layers.
    unused = {"num_experts", "moe_intermediate_size", "hf_config"}
    names = (*ARCH_FIELDS, *EXECUTION_FIELDS, *(f.name for f in dataclasses.fields(dense)))
    differ = {name for name in names if name not in ("arch", "execution")
              and dense.value(name) != twin.value(name)}
    assert differ <= unused
    assert _params(dense) == _params(twin)


def test_a_negative_expert_count_is_refused_in_one_line():
    config = lm_quickstart.get_config()
    config.model.num_experts = -1
    with pytest.raises(ValueError, match=r"^config.model.num_experts must be an int >= 0"):
        LMTask.from_config(config)
