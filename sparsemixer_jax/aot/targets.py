"""Hardware to compile for without having it: compile-only TPU slices and NVIDIA H100 hosts.

A *target* is written ``platform:...``:

* ``tpu:<generation>:<topology>``, e.g. ``tpu:v5e:4x4`` (16 chips), ``tpu:v5p:2x2x4``,
  ``tpu:v6e:4x4``, ``tpu:v4:2x2x2``: libtpu's own description of that slice (needs ``libtpu``,
  ``pip install "jax[tpu]==0.11.2"``, the jax version of requirements.txt).
* ``h100:<hosts>x<gpus>`` or ``h100:1x<hosts>x<gpus>``, e.g. ``h100:1x8`` (one host of 8 GPUs),
  ``h100:2x8``: H100 SXM GPUs described by :data:`H100_SXM_TARGET_CONFIG` (needs the CUDA PJRT
  plugin, ``jax-cuda13-plugin``, ``jax-cuda13-pjrt`` and ``nvidia-nvshmem-cu13``, and ``ptxas``);
  ``h200:...`` likewise, H200 GPUs (:data:`H200_TARGET_CONFIG`: the H100's processor with the
  H200's memory).

:func:`target_devices` returns the slice's devices: real ``jax.Device`` objects that XLA compiles
for, but that hold no memory and run nothing (``jax.experimental.topologies``). Meshes built from
them lower and compile exactly as on the hardware; the compiled program's memory and cost
analyses are then what the hardware would see.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil

import jax

GiB = 2**30

# An H100 SXM5 80GB as XLA's GpuTargetConfigProto (text format). Where each number comes from:
#   core_count 132 SMs, l2_cache_size 50 MiB, fpus_per_core 128 (FP32 cores per SM), clock
#   1.98 GHz (max boost): NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), Table 3
#   "H100 SXM5".
#   memory_bandwidth 3.35 TB/s, device memory 80 GB (HBM3): NVIDIA H100 Tensor Core GPU datasheet
#   (SXM column); the driver reports 81,559 MiB of it (nvidia-smi on an H100 80GB HBM3).
#   Per compute capability 9.0 (CUDA C++ Programming Guide, "Technical Specifications per
#   Compute Capability"): 1024 threads per block, warp of 32, 48 KiB of shared memory per block
#   without opt-in, 227 KiB (232,448 bytes) with opt-in, 228 KiB (233,472 bytes) per SM, 2048
#   resident threads per SM, 64 Ki 32-bit registers per SM and per block, grid dimensions
#   2^31 - 1 x 65535 x 65535.
#   runtime 13.0 and cuDNN 9.12: the CUDA 13 toolkit jax-cuda13-plugin 0.11.2 is built for and
#   the oldest cuDNN its "with-cuda" extra accepts (nvidia-cudnn-cu13>=9.12).
H100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3350000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85520809984
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    minor: 0
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
runtime_version {
  major: 13
  minor: 0
}
dnn_version_info {
  major: 9
  minor: 12
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# High-bandwidth memory per chip (bytes), from Google Cloud's TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e): v4 32 GiB, v5e 16 GiB, v5p 95 GiB,
# v6e (Trillium) 32 GiB.
TPU_HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
H100_HBM_BYTES = 85_520_809_984  # 81,559 MiB: what the driver of an H100 80GB HBM3 reports

# An H200 is the H100's processor (the same 132 SMs at the same clock, compute capability 9.0)
# with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet); its driver reports
# 143,771 MiB, and CUDA's device properties a 60 MiB L2 cache.
H200_HBM_BYTES = 143_771 * 2**20
H200_TARGET_CONFIG = (H100_SXM_TARGET_CONFIG
                      .replace("memory_bandwidth: 3350000000000", "memory_bandwidth: 4800000000000")
                      .replace("l2_cache_size: 52428800", f"l2_cache_size: {60 * 2**20}")
                      .replace("device_memory_size: 85520809984",
                               f"device_memory_size: {H200_HBM_BYTES}")
                      .replace('"NVIDIA H100 80GB HBM3"', '"NVIDIA H200"'))
GPU_TARGET_CONFIGS = {"h100": H100_SXM_TARGET_CONFIG, "h200": H200_TARGET_CONFIG}
GPU_HBM_BYTES = {"h100": H100_HBM_BYTES, "h200": H200_HBM_BYTES}

_TPU_TOPOLOGY = re.compile(r"^\d+x\d+(x\d+)?$")
_GPU_TOPOLOGY = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target: ``platform`` ("tpu" or "cuda"), the chip (``"v5e"``, ``"h100"``),
    the topology as libtpu / XLA spell it, and the memory of one chip in bytes."""

    spec: str
    platform: str
    chip: str
    topology: str
    hbm_bytes: int

    @property
    def dispatch_platform(self) -> str:
        """The platform name :func:`sparsemixer_jax.moe.dispatch.resolve_dispatch` knows."""
        return "gpu" if self.platform == "cuda" else self.platform


def parse_target(spec: str) -> Target:
    """``"tpu:v5e:4x4"`` or ``"h100:1x8"`` as a :class:`Target`; ValueError naming what is wrong."""
    parts = spec.split(":")
    if parts[0] == "tpu":
        if len(parts) != 3 or parts[1] not in TPU_HBM_BYTES or not _TPU_TOPOLOGY.match(parts[2]):
            raise ValueError(
                f"target {spec!r}: expected tpu:<generation>:<topology> with generation one of "
                f"{', '.join(TPU_HBM_BYTES)} and a topology like 4x4 or 2x2x4")
        return Target(spec, "tpu", parts[1], f"{parts[1]}:{parts[2]}", TPU_HBM_BYTES[parts[1]])
    if parts[0] in GPU_TARGET_CONFIGS:
        chip = parts[0]
        match = _GPU_TOPOLOGY.match(parts[1]) if len(parts) == 2 else None
        if match is None:
            raise ValueError(
                f"target {spec!r}: expected {chip}:<hosts>x<gpus per host> (e.g. {chip}:1x8) "
                f"or {chip}:1x<hosts>x<gpus per host>")
        if match.group(1) not in (None, "1"):
            raise ValueError(f"target {spec!r}: the first of three sizes must be 1 (slices)")
        hosts, gpus = int(match.group(2)), int(match.group(3))
        return Target(spec, "cuda", chip, f"1x{hosts}x{gpus}", GPU_HBM_BYTES[chip])
    raise ValueError(
        f"target {spec!r}: expected tpu:<generation>:<topology> (e.g. tpu:v5e:4x4) or "
        "h100:<hosts>x<gpus> (e.g. h100:1x8; h200 likewise)")


def module_found(name: str) -> bool:
    """Whether module ``name`` can be imported; False also when a parent package of a dotted
    name is missing (where ``importlib.util.find_spec`` raises instead)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def missing_support(target: Target) -> str | None:
    """Why ``target`` cannot be compiled for in this environment (one line), or None."""
    if target.platform == "tpu":
        if not module_found("libtpu"):
            return (f'TPU targets need libtpu: pip install "jax[tpu]=={jax.__version__}" '
                    "(or -r requirements-compile.txt)")
        return None
    if not module_found("jax_plugins.xla_cuda13"):  # no jax_plugins at all without the extras
        return (f"H100 targets need the CUDA PJRT plugin: pip install "
                f"jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__} "
                "nvidia-nvshmem-cu13==3.8.0 (or -r requirements-compile.txt)")
    if not _ptxas_found():
        return ("H100 targets need ptxas: the CUDA toolkit on the PATH, or pip install "
                "nvidia-cuda-nvcc==13.0.88 (as requirements-compile.txt)")
    return None


def _ptxas_found() -> bool:
    """ptxas on the PATH or in a pip-installed ``nvidia`` package (where XLA also looks)."""
    if shutil.which("ptxas"):
        return True
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.exists(os.path.join(root, sub, "bin", "ptxas"))
               for root in roots for sub in os.listdir(root))


def target_devices(target: Target | str) -> list[jax.Device]:
    """The compile-only devices of ``target``, in the topology's order.

    Raises RuntimeError (one line) when the packages the target needs are missing.
    """
    target = parse_target(target) if isinstance(target, str) else target
    reason = missing_support(target)
    if reason is not None:
        raise RuntimeError(f"cannot compile for {target.spec}: {reason}")
    from jax.experimental import topologies

    if target.platform == "tpu":
        # libtpu looks for the TPU VM's metadata server unless told it runs on one host, and
        # locks the chips against a second process: a compile-only slice needs neither.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
    else:
        # The plugin checks the CUDA libraries it would load on a GPU; none are needed to
        # compile, so the check is skipped.
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        topology = topologies.get_topology_desc(
            target.chip, "cuda", target_config=GPU_TARGET_CONFIGS[target.chip],
            topology=target.topology)
    return list(topology.devices)
