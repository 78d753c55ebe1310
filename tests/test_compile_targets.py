"""Targets, HLO analysis and the compile command's one-line errors: no compiler needed."""

import dataclasses

import pytest

from configs import wmt
from sparsemixer_jax.aot import analysis, command, targets, translation
from sparsemixer_jax.tasks import run_config


def test_parse_target():
    tpu = targets.parse_target("tpu:v5e:4x4")
    assert (tpu.platform, tpu.chip, tpu.topology) == ("tpu", "v5e", "v5e:4x4")
    assert tpu.hbm_bytes == 16 * 2**30
    assert targets.parse_target("tpu:v5p:2x2x4").hbm_bytes == 95 * 2**30
    gpu = targets.parse_target("h100:1x1x8")
    assert (gpu.platform, gpu.topology, gpu.dispatch_platform) == ("cuda", "1x1x8", "gpu")
    assert targets.parse_target("h100:2x8").topology == "1x2x8"


@pytest.mark.parametrize("spec, message", [
    ("tpu:v9:4x4", "generation one of"),
    ("tpu:v5e", "tpu:<generation>:<topology>"),
    ("h100:eight", "h100:<hosts>x<gpus per host>"),
    ("h100:2x2x8", "first of three sizes must be 1"),
    ("a100:1x8", "expected tpu:"),
])
def test_parse_target_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        targets.parse_target(spec)


def test_h200_is_the_h100_processor_with_the_h200_memory():
    h200 = targets.parse_target("h200:1x8")
    assert (h200.platform, h200.chip, h200.topology) == ("cuda", "h200", "1x1x8")
    assert h200.hbm_bytes == 143_771 * 2**20
    h100_lines = targets.H100_SXM_TARGET_CONFIG.splitlines()
    h200_lines = targets.H200_TARGET_CONFIG.splitlines()
    changed = {a.split(":")[0].strip() for a, b in zip(h100_lines, h200_lines, strict=True)
               if a != b}
    assert changed == {"memory_bandwidth", "l2_cache_size", "device_memory_size",
                       "device_description_str"}
    assert "memory_bandwidth: 4800000000000" in targets.H200_TARGET_CONFIG


def test_target_config_describes_an_h100_sxm():
    text = targets.H100_SXM_TARGET_CONFIG
    for field in ("core_count: 132", "shared_memory_per_block_optin: 232448", "major: 9",
                  'device_description_str: "NVIDIA H100 80GB HBM3"'):
        assert field in text


HLO = """
  %all-to-all.1 = (bf16[4,8]{1,0}) all-to-all(bf16[4,8]{1,0} %p), replica_groups={{0,1}}
  %ars = f32[8]{0} all-reduce-start(f32[8]{0} %x), to_apply=%add
  %ard = f32[8]{0} all-reduce-done(f32[8]{0} %ars)
  %ag = f32[16]{0} all-gather(f32[8]{0} %x), dimensions={0}
  %all-to-all.2 = bf16[4,8]{1,0} all-to-all(bf16[4,8]{1,0} %q), dimensions={0}
  %k = bf16[128,64]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  %f = f32[8]{0} fusion(%all-to-all.2), kind=kLoop, calls=%fused
"""


def test_collectives_and_kernels_are_counted_from_hlo():
    # A fusion consuming an all-to-all's result, and the "-done" half of an asynchronous
    # all-reduce, are not collectives of their own.
    assert analysis.collective_counts(HLO) == {"all-to-all": 2, "all-reduce": 1,
                                               "all-gather": 1}
    assert analysis.kernel_count(HLO) == 1
    assert analysis.kernel_count("%x = f32[] add(%a, %b)") == 0


def _report(total_temp: int) -> analysis.ProgramReport:
    return analysis.ProgramReport(name="step", compile_seconds=1.0, arguments=2 * 2**30,
                                  outputs=2**30, aliased=2**30, temporaries=total_temp,
                                  flops=1e12, bytes_accessed=2**31, collectives={},
                                  kernels=0)


def test_report_total_and_verdicts():
    small, big = _report(2**30), _report(20 * 2**30)
    assert small.total == 3 * 2**30
    assert "fits" in analysis.format_report(small, 16 * 2**30)
    assert "DOES NOT FIT" in analysis.format_report(big, 16 * 2**30)
    result = {"target": "tpu:v5e:4x4", "hbm_bytes": 16 * 2**30,
              "programs": [analysis.as_dict(small), analysis.as_dict(big)]}
    assert command.summary_line(result).startswith("tpu:v5e:4x4: DOES NOT FIT")
    assert command.exit_code([result]) == 1
    result["programs"] = [analysis.as_dict(small)]
    assert command.exit_code([result]) == 0


def test_a_config_that_does_not_shard_says_so_in_one_line():
    run = run_config(wmt.get_config("n4"))
    run = dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, expert=3))
    with pytest.raises(ValueError,
                       match=r"^config.mesh \(data=-1, fsdp=1, expert=3\) does not shard"):
        translation.target_mesh(run, list(range(16)))
    config = wmt.get_config("n4")
    config.mesh.expert = 3
    result = command.compile_for_target(config, "tpu:v5e:nope")
    assert "\n" not in result["error"] and "tpu:<generation>" in result["error"]


def test_a_batch_too_small_for_the_mesh_says_so():
    data = run_config(wmt.get_config("n4")).task.data
    mesh = type("Mesh", (), {"size": 16})()
    with pytest.raises(ValueError, match="max_tokens=1024 cannot hold one row of max_len=256"):
        translation.batch_shape(dataclasses.replace(data, max_tokens=1024), mesh)
    assert translation.batch_shape(dataclasses.replace(data, max_tokens=4096), mesh) == (16, 256)


def test_dispatch_auto_is_resolved_for_the_target():
    """In the typed task the command compiles (its ``for_platform``); the config is only read."""
    from configs import lm_quickstart

    for config, dispatch_of in ((wmt.get_config("n4"), lambda task: task.model.moe.dispatch),
                                (lm_quickstart.get_config(),
                                 lambda task: task.lm.execution.dispatch)):
        before = config.to_json()
        for spec, dispatch in (("tpu:v5e:4x4", "ragged"), ("h100:1x8", "padded")):
            run = command.run_for_target(config, targets.parse_target(spec))
            assert dispatch_of(run.task) == dispatch, spec
        assert config.to_json() == before
        assert dispatch_of(run_config(config).task) == config.model.dispatch == "auto"
    explicit = wmt.get_config("n4")
    explicit.model.dispatch = "padded"
    run = command.run_for_target(explicit, targets.parse_target("tpu:v5e:4x4"))
    assert run.task.model.moe.dispatch == "padded"  # only "auto" is resolved


def test_the_command_says_in_one_line_that_a_config_does_not_shard():
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "experiments.compile", "--config", "configs/wmt_n4.py",
         "--config.mesh.expert=3", "--target", "tpu:v5e:4x4"],
        capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu:v5e:4x4: cannot compile: ")
    assert "config.mesh.expert=3" in lines[0]  # the config check names the field


def test_a_mesh_axis_that_splits_a_torus_axis_is_laid_on_the_slice():
    """8 x 8 on a TPU v5p 4x4x4 slice (the layout of the 64-chip real-size configs): 8 is no
    product of whole torus axes, so one is split; every chip is used once."""
    from sparsemixer_jax.parallel.sharding import make_mesh
    from tests import kit

    _, devices = kit.target_devices_or_skip("tpu:v5p:4x4x4")
    mesh = make_mesh(1, 8, devices, fsdp=8)
    assert mesh.shape == {"data": 1, "fsdp": 8, "expert": 8}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
