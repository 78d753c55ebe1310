"""Two processes on this machine (CPU backend, gloo collectives, coordinator on localhost) train
a few steps and agree with one process that holds both devices and sees the same global batch."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
ARGS = [
    "--config", "tests/tiny_wmt_config.py",
    "--config.mesh.data=-1",  # every device: 2 in both set-ups
    f"--config.train_steps={STEPS}",
    f"--config.eval_every={STEPS}",
    f"--config.checkpoint_every={STEPS}",
    "--config.decode.test_bleu=False",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
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


def test_two_processes_match_one_process(tmp_path):
    command = [sys.executable, "-m", "experiments.wmt"]
    single = str(tmp_path / "single")
    run = subprocess.run([*command, *ARGS, "--workdir", single], cwd=REPO, env=_env(2),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    multi = str(tmp_path / "multi")
    address = f"127.0.0.1:{_free_port()}"
    processes = [
        subprocess.Popen(
            [*command, *ARGS, "--workdir", multi], cwd=REPO,
            env=_env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                     JAX_PROCESS_ID=str(i)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    for p in processes:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]

    single_train, single_valid = _losses(single)
    multi_train, multi_valid = _losses(multi)
    assert len(single_train) == len(multi_train) == STEPS
    # Same global batches, same keys; only the order of the cross-device sums may differ.
    np.testing.assert_allclose(multi_train, single_train, rtol=1e-5)
    np.testing.assert_allclose(multi_valid, single_valid, rtol=1e-5)
    with open(os.path.join(multi, "results.json")) as f:
        assert json.load(f)["steps"] == STEPS  # written once, by process 0
