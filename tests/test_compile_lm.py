"""Deviceless compiles of the language model's training step (``sparsemixer_jax.aot.lm``).

The default run compiles a two-layer model of the OLMoE family (q/k norms over the projection,
top-8 of 16 experts) on the TPU v5e 4x4 slice with ``configs/olmoe_1b_7b.py``'s layout: experts
split 4 ways, the model width 4 ways, every other matrix over both axes, two micro-batches per
update. It checks what sharding promises: a device holds about a sixteenth of the parameters
and twice that of Adam state, the weights are gathered (all-gather) and the tokens travel to
their experts (all-to-all), and no device computes every row's logits. The real sizes
(``configs/{olmoe_1b_7b,mixtral_8x7b,phi35_moe,qwen3_30b_a3b}.py`` on the slices of docs/tpu.md,
``configs/{gpt_oss_20b,gpt_oss_120b,moonlight_16b_a3b,glm45_air}.py`` on those of docs/gpu.md,
``configs/{qwen36_35b_a3b,qwen3_next_80b_a3b}.py`` on both)
take minutes of CPU each and run with ``-m slow``. The packages are in
requirements-compile.txt; without them these tests skip, saying which is missing.
"""

import functools

import jax
import pytest
from flax import nnx

from configs import (
    glm45_air,
    gpt_oss_20b,
    gpt_oss_120b,
    mixtral_8x7b,
    moonlight_16b_a3b,
    olmoe_1b_7b,
    phi35_moe,
    qwen3_30b_a3b,
    qwen3_next_80b_a3b,
    qwen36_35b_a3b,
)
from sparsemixer_jax.aot import lm, targets
from sparsemixer_jax.training.steps import count_params
from tests import kit

CONFIGS = {"olmoe_1b_7b": olmoe_1b_7b, "mixtral_8x7b": mixtral_8x7b, "phi35_moe": phi35_moe,
           "qwen3_30b_a3b": qwen3_30b_a3b, "gpt_oss_20b": gpt_oss_20b,
           "gpt_oss_120b": gpt_oss_120b, "moonlight_16b_a3b": moonlight_16b_a3b,
           "glm45_air": glm45_air, "qwen36_35b_a3b": qwen36_35b_a3b,
           "qwen3_next_80b_a3b": qwen3_next_80b_a3b}


def _two_layer_olmoe():
    config = olmoe_1b_7b.get_config("tpu")
    config.model.update(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
                        mlp_dim=64, num_experts=16)
    config.data.update(vocab_size=4096, seq_len=128, batch_size=32, micro_batch_size=16)
    return config


@functools.cache
def _programs(name: str, variant: str, spec: str):
    """``(target, config, {program: report}, parameter bytes)``: the parameters counted on the
    model built for the target's own mesh (a model built for this CPU host would refuse the
    H100 targets' Mosaic GPU kernels)."""
    target, devices = kit.target_devices_or_skip(spec)
    config = _two_layer_olmoe() if name == "small" else CONFIGS[name].get_config(variant)
    run = kit.run_for_target(config, target)
    # As the command compiles it (runtime.matmul_precision "default"), not at the precision
    # the test session sets for CPU comparisons (bfloat16 TPU kernels refuse "highest").
    with jax.default_matmul_precision("default"):
        reports = lm.compile_lm(run, devices)
    model = lm.abstract_model(run.task, lm.target_mesh(run, devices))
    param_bytes = 4 * count_params(nnx.state(model, nnx.Param))
    return target, config, {r.name.split(" ")[0]: r for r in reports}, param_bytes


def test_two_layer_olmoe_training_step_is_sharded_on_the_v5e_slice():
    target, config, programs, param_bytes = _programs("small", "tpu", "tpu:v5e:4x4")
    assert set(programs) == {"accumulate", "update"}
    accumulate = programs["accumulate"]
    assert accumulate.total < target.hbm_bytes
    # Every matrix split 16 ways (norm scales whole): about a sixteenth per device.
    assert param_bytes / 16 <= accumulate.parameters < 1.05 * param_bytes / 16
    # Adam's two moments (and its step counts)
    assert 2 * accumulate.parameters <= accumulate.optimizer_state < 2 * accumulate.parameters + 64
    # FSDP: weights gathered before use; expert parallelism: tokens to their experts and back.
    assert accumulate.collectives.get("all-gather", 0) >= 1
    assert accumulate.collectives.get("all-to-all", 0) >= 2 * config.model.num_layers
    # Rows stay split: no device holds every row's logits ([16, 128, 4096], 16 MiB in bfloat16;
    # a device's row is 1 MiB), the largest array a step of this size would otherwise make.
    rows, length, vocab = 16, 128, 4096
    assert accumulate.largest_buffer[1] < rows * length * vocab * 2 // 4
    assert "all-to-all" not in programs["update"].collectives


def test_a_mesh_that_does_not_fit_the_slice_is_one_line():
    target, devices = kit.target_devices_or_skip("tpu:v5e:4x4")
    config = _two_layer_olmoe()
    config.mesh.fsdp = 3
    with pytest.raises(ValueError, match=r"^config.mesh: fsdp=3 x expert=4 does not divide the 16"):
        lm.compile_lm(kit.run_for_target(config, target), devices)


def test_cudnn_attention_without_cudnn_names_the_way_out():
    """On a host without cuDNN's package (requirements-compile.txt installs it) cuDNN's
    attention cannot lower: the compile command says so on one line and names the package."""
    kit.target_devices_or_skip("h100:1x1")
    from sparsemixer_jax.aot import command

    if targets.module_found("nvidia.cudnn"):
        pytest.skip("cuDNN is installed here")
    config = _two_layer_olmoe()
    config.model.update(attention_impl="cudnn", compute_dtype="bfloat16")
    config.mesh.update(data=1, fsdp=1, expert=1)
    config.data.micro_batch_size = 0
    result = command.compile_for_target(config, "h100:1x1", decode_step=False)
    assert "cuDNN" in result["error"] and "pip install nvidia-cudnn-cu13" in result["error"]
    assert "\n" not in result["error"]


REAL_SIZES = [("olmoe_1b_7b", "tpu", "tpu:v5e:4x4"), ("olmoe_1b_7b", "h100", "h100:1x1x8")] + [
    (name, variant, spec)
    for name in ("mixtral_8x7b", "phi35_moe", "qwen3_30b_a3b", "gpt_oss_120b", "glm45_air",
                 "qwen36_35b_a3b", "qwen3_next_80b_a3b")
    for variant, spec in (("tpu", "tpu:v5p:4x4x4"), ("h100", "h100:1x8x8"))] + [
    (name, variant, spec) for name in ("gpt_oss_20b", "moonlight_16b_a3b")
    for variant, spec in (("tpu", "tpu:v5p:2x2x2"), ("h100", "h100:1x1x8"))]


@pytest.mark.slow  # minutes of CPU each
@pytest.mark.parametrize("name, variant, spec", REAL_SIZES)
def test_real_size_training_step_fits(name, variant, spec):
    target, _, programs, param_bytes = _programs(name, variant, spec)
    for report in programs.values():
        assert report.total <= target.hbm_bytes, (report.name, report.total)
    accumulate = programs["accumulate"]
    assert accumulate.collectives.get("all-to-all", 0) >= 1
    # The train state is split over every device: a device holds at most about 1/16 of it.
    assert accumulate.parameters < 1.05 * param_bytes / min(16, len(targets.target_devices(
        target)))
