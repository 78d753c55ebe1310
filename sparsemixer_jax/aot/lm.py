"""The language-modelling task's training step, compiled for a target without its hardware.

The model (:class:`~sparsemixer_jax.models.causal_lm.CausalLM` of the task's
:class:`~sparsemixer_jax.models.lm_config.LMConfig`: ``config.model`` from scratch, or the
checkpoint's ``config.json`` with ``config.init_from``) is built abstractly (``nnx.eval_shape``:
shapes, dtypes and shardings, no values, no weights read) on a mesh of the target's compile-only
devices laid out as ``config.mesh`` says; parameters, gradients and Adam state are placed by the
partitioner's rules, as the training loop places them. The batch is one micro-batch of
``data.micro_batch_size`` packed rows of ``data.seq_len`` tokens; several micro-batches per
update compile the loop's two programs, ``accumulate`` and ``update``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.aot import model_flops
from sparsemixer_jax.aot import steps as aot_steps
from sparsemixer_jax.aot.analysis import ProgramReport
from sparsemixer_jax.layers.packed_attention import compute_capability_of
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.tasks.language_model import LMTask
from sparsemixer_jax.training.run_config import RunConfig
from sparsemixer_jax.training.steps import Steps


def target_mesh(run: RunConfig, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """The ``(data, fsdp, expert)`` mesh of ``run.mesh`` over ``devices`` (all of them), or a
    ValueError naming the config field that does not fit the target."""
    task: LMTask = run.task
    data, fsdp, expert = run.mesh.sizes(len(devices))
    try:
        mesh = sharding.make_mesh(data, expert, devices, fsdp=fsdp)
        sharding.check_mesh(mesh, task.lm.num_experts)
    except ValueError as err:
        raise ValueError(f"config.mesh (data={data}, fsdp={fsdp}, expert={expert}) does not "
                         f"shard over the target's {len(devices)} devices: {err}") from err
    rows = task.data.micro
    if rows % mesh.size:
        raise ValueError(f"config.data.micro_batch_size: {rows} rows per micro-batch do not "
                         f"split over the target's {mesh.size} devices (a multiple of "
                         f"{mesh.size} is needed)")
    return mesh


def abstract_model(task: LMTask, mesh: jax.sharding.Mesh | None) -> CausalLM:
    """The task's model as shapes, dtypes and shardings, in training mode. Fine-tuning builds
    the checkpoint's shapes without reading its weights (they do not change the program)."""
    def build() -> CausalLM:
        model = CausalLM(task.lm, mesh=mesh, rngs=nnx.Rngs(params=0, router=2))
        if mesh is not None:
            sharding.shard_state(model, mesh)
        model.train()
        return model

    return nnx.eval_shape(build)


def batch_model_flops(task: LMTask, rows: int, length: int) -> float:
    """Model FLOPs (:mod:`sparsemixer_jax.aot.model_flops`) of one training pass over a batch of
    ``rows`` packed rows of ``length`` tokens, over all devices."""
    return model_flops.lm_flops_per_token(task.lm, length)["total"] * rows * length


def compile_lm(run: RunConfig, devices: Sequence[jax.Device], *, decode_step: bool = True,
               ) -> list[ProgramReport]:
    """Compile the training programs of ``run`` (its task's dispatch resolved for the target:
    :func:`sparsemixer_jax.aot.command.run_for_target`) for the target's ``devices``: the fused
    step (one micro-batch per update) or ``accumulate`` and ``update``. ``decode_step`` is
    accepted for the command's sake; generation is not compiled. Raises ValueError (one line)
    when the config does not shard over the target."""
    del decode_step
    task: LMTask = run.task
    mesh = target_mesh(run, devices)
    # The grouped kernels' device check asks the default device; cuDNN's packed layout
    # (model.cudnn_document_mask="offsets") the compute capability of the target's GPU.
    with jax.default_device(devices[0]), compute_capability_of(devices[0]):
        model = abstract_model(task, mesh if mesh.size > 1 else None)
        partitioner = sharding.mesh_partitioner(run.mesh, mesh)
        steps = Steps(model, task, run.optim, partitioner if mesh.size > 1 else None)
        state, rest = aot_steps.train_state(steps, mesh, partitioner)
        rows, length = task.data.micro, task.data.seq_len
        placement = sharding.batch_sharding(mesh)
        batch = {"tokens": jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=placement),
                 "segments": jax.ShapeDtypeStruct((rows, length), jnp.int32,
                                                  sharding=placement),
                 "targets": jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=placement),
                 "bytes": jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=placement)}
        micro_batches = task.data.batch_size // task.data.micro
        return aot_steps.compile_training(steps, state, rest, batch, micro_batches,
                                          f"[{rows}, {length}]")
