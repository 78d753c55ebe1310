"""What XLA's SPMD partitioner says about the models' sharded training programs.

Where the partitioner cannot move an array between two shardings efficiently it replicates it
and logs "Involuntary full rematerialization". The translation model and ELECTRA on a mesh
whose batch split (``data x fsdp x expert``) and width split (``fsdp``) use different axes did
so for the gradients of their embedding lookups, until the lookups read the tables gathered
whole (:func:`sparsemixer_jax.parallel.sharding.lookup_rows`). The partitioner is the same for CPUs
and
GPUs, so the default run compiles small models' training steps on the 8 simulated CPU devices
(mesh 1 x 2 x 4) in a subprocess whose XLA log is read; the translation model's compile for 8
H100s (``h100:1x1x8``, minutes of CPU) is slow. The grouped dispatch under expert parallelism in a
differentiated scan compiles (XLA once crashed on it: ``lab/shardy_zero_size_residual.py``).
"""

import os
import subprocess
import sys

import pytest

from tests import kit

WARNING = "Involuntary full rematerialization"

# The design card's structure, one encoder and one decoder layer (the first an MoE layer),
# experts over 4 devices and the model width over 2.
SMALL = dict(encoder_layers=1, decoder_layers=1, emb_dim=64, mlp_dim=128, num_heads=2)
SMALL_DATA = dict(vocab_size=512, max_len=32, max_tokens=1024)

_CPU_STEPS = f"""
import jax
import jax.numpy as jnp
from flax import nnx
from configs import electra, wmt
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.aot import steps, translation
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.training.steps import Steps

mesh = sharding.make_mesh(1, 4, jax.devices()[:8], fsdp=2)
config = wmt.get_config("n4")
config.model.update(dispatch="padded", **{SMALL!r})
config.data.update(**{SMALL_DATA!r})
config.optim.tokens_per_update = 0  # one micro-batch: the fused training step
config.mesh.update(data=1, fsdp=2, expert=4)
(report,) = translation._compile_all(run_config(config), mesh, decode_step=False)
print("compiled translation", report.name)

# ELECTRA: a two-layer discriminator (the second an MoE layer), a one-layer generator.
config = electra.get_config("n4")
config.model.update(num_layers=2, emb_dim=64, mlp_dim=128, num_heads=2, dispatch="padded")
config.generator.num_layers = 1
config.data.update(vocab_size=512, seq_len=32, batch_size=16, micro_batch_size=0)
config.mesh.update(data=1, fsdp=2, expert=4)
run = run_config(config)
model = nnx.eval_shape(lambda: run.task.build_model(run, 512, mesh))
partitioner = sharding.mesh_partitioner(run.mesh, mesh)
pretraining = Steps(model, run.task, run.optim, partitioner)
state, rest = steps.train_state(pretraining, mesh, partitioner)
ids = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=sharding.batch_sharding(mesh))
batch = dict(tokens=ids, segments=ids, inputs=ids, selected=jax.ShapeDtypeStruct(
    (16, 32), jnp.bool_, sharding=sharding.batch_sharding(mesh)))
(report,) = steps.compile_training(pretraining, state, rest, batch, 1, "[16, 32]")
print("compiled pretraining", report.name)
"""


def _xla_log(args: list[str], timeout: float) -> str:
    """stdout and stderr of ``python args`` with XLA's warnings logged."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_training_steps_on_a_fsdp_and_expert_mesh_are_partitioned_without_replicating():
    """The translation model and ELECTRA, whose embedding lookups read width-split tables."""
    log = _xla_log(["-c", _CPU_STEPS], timeout=600)
    assert "compiled translation train step" in log and "compiled pretraining train step" in log
    assert WARNING not in log, [line for line in log.splitlines() if WARNING in line][:2]


@pytest.mark.slow  # about two minutes of CPU
def test_translation_accumulate_program_for_8_h100s_is_partitioned_without_replicating():
    kit.target_devices_or_skip("h100:1x1x8")
    overrides = [f"--config.model.{k}={v}" for k, v in SMALL.items()] + [
        f"--config.data.{k}={v}" for k, v in SMALL_DATA.items()]
    log = _xla_log(["-m", "experiments.compile", "--config", "configs/wmt_n4.py",
                    "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.expert=4",
                    "--config.optim.tokens_per_update=2048", "--target", "h100:1x1x8",
                    "--nodecode", *overrides], timeout=1200)
    assert "h100:1x1x8: fits" in log
    assert WARNING not in log, [line for line in log.splitlines() if WARNING in line][:2]


def test_grouped_dispatch_under_expert_parallelism_in_a_differentiated_scan_compiles():
    from lab.shardy_zero_size_residual import run_case

    assert run_case("grouped") == "compiled"
