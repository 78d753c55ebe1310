"""Two processes on this machine (CPU backend, gloo collectives, coordinator on localhost) train
a few steps and agree with one process that holds both devices and sees the same global batch,
in losses and in the test set's translations.

The one-process run happens in this test process, on two of its eight simulated devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from sparsemixer_jax.tasks import translation
from tests import tiny_wmt_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
OVERRIDES = {
    "train_steps": STEPS,
    "eval_every": STEPS,
    "checkpoint_every": STEPS,
}
# Two devices, one per process: data parallelism (parameters replicated), or FSDP (each process
# holds half of every matrix and of its Adam moments).
MESHES = {"data": {"mesh.data": 2}, "fsdp": {"mesh.data": 1, "mesh.fsdp": 2}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        **extra,
    )
    return env


def _losses(workdir: str) -> tuple[list[float], float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r["loss"] for r in records if "loss" in r]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    return train, valid[-1]


@pytest.mark.slow  # kept out of the default run for time; python -m pytest -q -m slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_two_processes_match_one_process(tmp_path, mesh):
    overrides = {**OVERRIDES, **MESHES[mesh]}
    args = ["--config", "tests/tiny_wmt_config.py"]
    args += [f"--config.{key}={value}" for key, value in overrides.items()]
    config = tiny_wmt_config.get_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    single = str(tmp_path / "single")
    translation.train_and_evaluate(config, single)

    command = [sys.executable, "-m", "experiments.wmt"]
    multi = str(tmp_path / "multi")
    address = f"127.0.0.1:{_free_port()}"
    processes = [
        subprocess.Popen(
            [*command, *args, "--workdir", multi], cwd=REPO,
            env=_env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                     JAX_PROCESS_ID=str(i)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    try:
        errors = [p.communicate(timeout=600)[1] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for i, p in enumerate(processes):
        # Both logs: a process that fails takes the other down with it a few minutes later.
        assert p.returncode == 0, f"process {i} failed; its log, then the other's:\n" + "\n".join(
            err[-3000:] for err in (errors[i], errors[1 - i])
        )

    single_train, single_valid = _losses(single)
    multi_train, multi_valid = _losses(multi)
    assert len(single_train) == len(multi_train) == STEPS
    # Same global batches, same keys; only the order of the cross-device sums may differ.
    np.testing.assert_allclose(multi_train, single_train, rtol=1e-5)
    np.testing.assert_allclose(multi_valid, single_valid, rtol=1e-5)
    with open(os.path.join(multi, "results.json")) as f:
        assert json.load(f)["steps"] == STEPS  # written once, by process 0
    # Test-set beam search: each process decodes its rows; process 0 puts them in file order.
    with open(os.path.join(single, "translations_last.txt")) as f:
        expected = f.read()
    with open(os.path.join(multi, "translations_last.txt")) as f:
        assert f.read() == expected
