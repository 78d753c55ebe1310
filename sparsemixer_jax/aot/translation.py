"""The translation task's training and decode steps, compiled for a target without its hardware.

The model is built abstractly (``nnx.eval_shape``: shapes, dtypes and shardings, no values) on a
mesh of the target's compile-only devices, laid out as the run's mesh section says; the steps
are the library's own (:class:`sparsemixer_jax.training.steps.Steps` of the
:class:`~sparsemixer_jax.tasks.translation.TranslationTask`), lowered with
``jax.ShapeDtypeStruct`` arguments sharded as the training loop places them, and compiled by the
target's compiler. The batch is the longest length bucket (``data.max_len`` tokens per row, as
many rows as ``data.max_tokens`` allows on the mesh): the one that needs the most memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.aot import model_flops
from sparsemixer_jax.aot import steps as aot_steps
from sparsemixer_jax.aot.analysis import ProgramReport
from sparsemixer_jax.data.batching import bucket_batch_size, bucket_lengths
from sparsemixer_jax.data.sources import DataConfig
from sparsemixer_jax.data.tokenizer import EOS_ID
from sparsemixer_jax.models import decode
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.tasks.translation import TranslationTask, accumulation_steps
from sparsemixer_jax.training.run_config import RunConfig
from sparsemixer_jax.training.steps import Steps


def target_mesh(run: RunConfig, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """The ``(data, fsdp, expert)`` mesh of ``run.mesh`` over ``devices`` (all of them), or a
    ValueError naming the config field that does not fit the target."""
    data, fsdp, expert = run.mesh.data, run.mesh.fsdp, run.mesh.expert
    num_experts = run.task.model.moe.num_experts
    try:
        mesh = sharding.make_mesh(data, expert, devices, fsdp=fsdp)
        if num_experts:
            sharding.check_mesh(mesh, num_experts)
    except ValueError as err:
        raise ValueError(f"config.mesh (data={data}, fsdp={fsdp}, expert={expert}) does not "
                         f"shard over the target's {len(devices)} devices: {err}") from err
    return mesh


def batch_shape(data: DataConfig, mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """``(rows, length)`` of the longest bucket's batch, as the data pipeline would make it."""
    step = data.bucket_step
    length = bucket_lengths(data.max_len, min_len=step, step=step)[-1]
    max_tokens = data.max_tokens
    if max_tokens < mesh.size * length:
        raise ValueError(
            f"config.data.max_tokens={max_tokens} cannot hold one row of max_len={length} tokens "
            f"per device on {mesh.size} devices: raise it to >= {mesh.size * length}")
    return bucket_batch_size(length, max_tokens, mesh.size), length


def abstract_model(run: RunConfig, mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """The run's model as shapes, dtypes and shardings (``nnx.eval_shape``), with a vocabulary
    of ``data.vocab_size`` (the size the tokenizer is trained to)."""
    task: TranslationTask = run.task
    return nnx.eval_shape(lambda: task.build_model(run, task.data.vocab_size, mesh))


def batch_model_flops(task: TranslationTask, rows: int, length: int) -> float:
    """Model FLOPs (:mod:`sparsemixer_jax.aot.model_flops`) of one training pass over a batch of
    ``rows`` rows of ``length`` tokens (source and target alike), over all devices."""
    model = task.model
    sizes = {"emb": model.emb_dim, "mlp": model.mlp_dim, "layers": model.encoder_layers,
             "vocab": task.data.vocab_size, "length": length, "tokens": rows * length}
    return model_flops.model_flops_per_step(sizes, model.moe.num_experts, task.router.name)


def compile_translation(run: RunConfig, devices: Sequence[jax.Device], *,
                        decode_step: bool = True) -> list[ProgramReport]:
    """Compile the training step (and the beam-search decode step) of ``run`` (its task's
    dispatch resolved for the target: :func:`sparsemixer_jax.aot.command.run_for_target`) for
    the target's ``devices``.

    One micro-batch per update: the fused training step. Several (gradient accumulation): the
    two programs the loop runs, ``accumulate`` (one micro-batch's gradient added to the
    accumulator) and ``update``. Raises ValueError (one line) when the config does not shard.
    """
    mesh = target_mesh(run, devices)
    with jax.default_device(devices[0]):  # what the grouped kernels' device check asks
        return _compile_all(run, mesh, decode_step)


def _compile_all(run: RunConfig, mesh: jax.sharding.Mesh, decode_step: bool
                 ) -> list[ProgramReport]:
    task: TranslationTask = run.task
    rows, length = batch_shape(task.data, mesh)
    # One device: no mesh in the model, as the training loop does (sharding.device_mesh).
    model = abstract_model(run, mesh if mesh.size > 1 else None)
    # Placed as the training loop places them: parameters, gradients and optimizer state by
    # the mesh section's rules, everything else replicated.
    partitioner = sharding.mesh_partitioner(run.mesh, mesh)
    steps = Steps(model, task, run.optim, partitioner if mesh.size > 1 else None)
    micro_batches = accumulation_steps(task.tokens_per_update, task.data.max_tokens)
    state, rest = aot_steps.train_state(steps, mesh, partitioner)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding.batch_sharding(mesh))
    batch = {"inputs": tokens, "targets": tokens}
    shape = f"[{rows}, {length}]"
    reports = aot_steps.compile_training(steps, state, rest, batch, micro_batches, shape)
    if decode_step:
        beam = task.decode

        def beam_search(state, rest, inputs):
            model = steps.with_rest(rest).model(state)
            return decode.beam_search_model(
                model, inputs, eos_id=EOS_ID, beam_size=beam.beam_size, alpha=beam.length_penalty,
                max_extra_len=beam.max_extra_len, max_len=task.data.max_len)

        reports.append(aot_steps.compile_program(
            f"beam search (beam {beam.beam_size}), batch {shape}", beam_search,
            (state, rest, tokens)))
    return reports
