"""The compiled steps of every task: gradient accumulation, the update, evaluation.

The task (:class:`sparsemixer_jax.training.Task`) is a hashable object (a frozen dataclass; a
static argument of the compiled functions); the steps call three of its methods:

* ``loss(model, batch, key) -> (loss, metric_sums)``: the training objective of one micro-batch
  and metrics that add up over micro-batches. The task reseeds the model's RNG streams from
  ``key`` itself (``nnx.reseed``), so a step's randomness is a function of the key alone.
* ``summarize(metric_sums) -> (divisor, metrics)``: what the summed gradient is divided by (the
  tokens, or the micro-batches, of the update) and the update's metrics, which must hold
  ``"loss"`` (a non-finite one skips the update) and may hold ``"moe"`` (per-layer router
  metrics, logged every ``log_every`` steps).
* ``evaluate(model, batch, key) -> sums``: the deterministic forward's metric sums on one batch.

The functions are module-level, keyed by (graph definition, task, optimizer settings), so
every model of the same structure and shapes in a process reuses one compilation. Parameters
travel as a pure pytree (nested dict of arrays) so that optax and orbax see plain arrays.

``batch_stats`` is the model's state that training forwards update and the optimizer does not
(``nnx.BatchStat`` variables: Default MoE's default vectors); a pure pytree too, empty for most
models. It travels beside the parameters through every step (micro-batch after micro-batch), is
kept unchanged when an update is skipped, and is saved in checkpoints.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparsemixer_jax.training.optim import OptimSettings, learning_rate_schedule, make_optimizer


def _merge(graphdef, params, batch_stats, rest) -> nnx.Module:
    # A fresh copy of the RNG-stream variables at this trace level, so that reseeding them under
    # jax.grad does not mutate the caller's.
    rest = jax.tree.map(lambda x: x, rest)
    return nnx.merge(graphdef, nnx.State(params), nnx.State(batch_stats), rest)


def micro_batch_loss(graphdef: nnx.GraphDef, task: Any, params: Any, batch_stats: Any,
                     rest: Any, batch: dict[str, jax.Array],
                     key: jax.Array) -> tuple[jax.Array, tuple]:
    """The task's loss of one micro-batch as a function of ``params`` (argument 2): what
    the steps differentiate. Returns ``(loss, (metric sums, batch_stats after the forward))``.

    ``graphdef``, ``batch_stats`` and ``rest`` are those of :class:`Steps` (``steps.graphdef``,
    ``steps.batch_stats``, ``steps.rest``); ``task`` may be another than the steps' own,
    e.g. to compare the gradients of two objectives on one model.
    """
    model = _merge(graphdef, params, batch_stats, rest)
    loss, metrics = task.loss(model, batch, key)
    return loss, (metrics, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


def _gradient(graphdef, task, params, batch_stats, rest, batch, key):
    """``({"grads", "metrics"}, new batch_stats)`` of one micro-batch."""
    grads, (metrics, batch_stats) = jax.grad(micro_batch_loss, argnums=2, has_aux=True)(
        graphdef, task, params, batch_stats, rest, batch, key)
    return {"grads": grads, "metrics": metrics}, batch_stats


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_accumulator(graphdef, task, params, batch_stats, rest, batch):
    shapes = jax.eval_shape(
        lambda p, s, r, b: micro_batch_loss(graphdef, task, p, s, r, b,
                                            jax.random.key(0))[1][0],
        params, batch_stats, rest, batch)
    return {"grads": jax.tree.map(jnp.zeros_like, params),
            "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)}


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5,))
def _accumulate(graphdef, task, params, batch_stats, rest, acc, batch, key):
    summand, batch_stats = _gradient(graphdef, task, params, batch_stats, rest, batch, key)
    return jax.tree.map(jnp.add, acc, summand), batch_stats


def _keep_if_finite(finite, new, old):
    """``new`` where the update is finite, else ``old`` (a skipped update changes nothing)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


_keep_if_finite_jit = jax.jit(_keep_if_finite)


def _apply_update(task, optim: OptimSettings, params, opt_state, acc):
    """One optimizer update from summed gradients; skipped if the loss or gradient is not finite."""
    divisor, out = task.summarize(acc["metrics"])
    grads = jax.tree.map(lambda g: g / divisor, acc["grads"])
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(out["loss"])
    updates, new_opt_state = make_optimizer(optim).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = _keep_if_finite(finite, new_params, params)
    opt_state = _keep_if_finite(finite, new_opt_state, opt_state)
    return params, opt_state, {**out, "grad_norm": grad_norm, "finite": finite}


_update = functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))(_apply_update)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 6))
def _train_step(graphdef, task, optim, params, batch_stats, rest, opt_state, batch, key):
    """A whole update from one micro-batch in one compiled call: gradient, then optimizer.

    The same arithmetic as accumulating into zeros then updating, without materialising the
    accumulator, with one dispatch instead of three, and with XLA free to fuse the gradient's
    last ops into the optimizer's. Parameters and optimizer state are donated.
    """
    summand, new_batch_stats = _gradient(graphdef, task, params, batch_stats, rest, batch, key)
    params, opt_state, metrics = _apply_update(task, optim, params, opt_state, summand)
    batch_stats = _keep_if_finite(metrics["finite"], new_batch_stats, batch_stats)
    return params, batch_stats, opt_state, metrics


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(graphdef, task, params, batch_stats, rest, batch, key):
    return task.evaluate(_merge(graphdef, params, batch_stats, rest), batch, key)


@functools.partial(jax.jit, static_argnums=(0,))
def _init_optimizer(optim: OptimSettings, params):
    return make_optimizer(optim).init(params)


class Steps:
    """The compiled steps bound to one model, its task and optimizer settings."""

    def __init__(self, model: nnx.Module, task: Any, optim: OptimSettings):
        self.graphdef, params, batch_stats, self.rest = nnx.split(model, nnx.Param, nnx.BatchStat,
                                                                  ...)
        # Committed to their devices, as arrays restored from a checkpoint are: jit keys its
        # cache on committedness, so a resumed run then reuses the compiled steps.
        self.params = _committed(nnx.to_pure_dict(params))
        self.batch_stats = _committed(nnx.to_pure_dict(batch_stats))  # {} for most models
        self.task = task
        self.optim = optim
        self.schedule = learning_rate_schedule(optim)

    def init_opt(self, params):
        return _init_optimizer(self.optim, params)

    def with_rest(self, rest: Any) -> Steps:
        """These steps with the model's other state (its RNG streams) replaced by ``rest``: an
        outer ``jit`` passes it as a traced argument where an abstract model's own state holds
        shapes only, which a traced computation cannot close over (compile-only targets)."""
        bound = copy.copy(self)
        bound.rest = rest
        return bound

    def opt_state_shapes(self, params):
        """The optimizer state's shapes, without computing it (a restore template)."""
        return jax.eval_shape(lambda p: make_optimizer(self.optim).init(p), params)

    def zeros(self, params, batch_stats, batch):
        """A zero accumulator of gradients and metric sums for batches shaped like ``batch``."""
        return _zero_accumulator(self.graphdef, self.task, params, batch_stats, self.rest,
                                 batch)

    def accumulate(self, params, batch_stats, acc, batch, key):
        """``(acc + the gradient and metric sums of batch, batch_stats after its forward)``;
        ``acc`` is donated."""
        return _accumulate(self.graphdef, self.task, params, batch_stats, self.rest, acc,
                           batch, key)

    def update(self, params, opt_state, acc):
        """The optimizer update from an accumulator: ``(params, opt_state, metrics)``."""
        return _update(self.task, self.optim, params, opt_state, acc)

    def train_step(self, params, batch_stats, opt_state, micro_batches, step_key):
        """One update from ``micro_batches`` (device batches); micro-batch ``j`` draws its
        randomness from ``fold_in(step_key, j)``. Returns ``(params, batch_stats, opt_state,
        metrics)``; ``batch_stats`` has gone through every micro-batch's forward, in order,
        unless the update was skipped (then it is returned unchanged).

        One micro-batch: a single compiled call. Several: zero, accumulate each, update. Both
        donate ``params`` and ``opt_state``.
        """
        if len(micro_batches) == 1:
            return _train_step(self.graphdef, self.task, self.optim, params, batch_stats,
                               self.rest, opt_state, micro_batches[0],
                               jax.random.fold_in(step_key, 0))
        acc = self.zeros(params, batch_stats, micro_batches[0])
        new_batch_stats = batch_stats
        for j, batch in enumerate(micro_batches):
            acc, new_batch_stats = self.accumulate(params, new_batch_stats, acc, batch,
                                             jax.random.fold_in(step_key, j))
        params, opt_state, metrics = self.update(params, opt_state, acc)
        batch_stats = _keep_if_finite_jit(metrics["finite"], new_batch_stats, batch_stats)
        return params, batch_stats, opt_state, metrics

    def evaluate(self, params, batch_stats, batch, key):
        return _evaluate(self.graphdef, self.task, params, batch_stats, self.rest, batch, key)

    def train_state(self, params: Any, opt_state: Any, batch_stats: Any = None) -> dict[str, Any]:
        """What a checkpoint holds: ``params``, ``opt_state`` and, where the model has layer
        state, ``batch_stats`` (the initial state if None). Models without layer state keep the
        two-item layout of checkpoints written before layer state existed."""
        batch_stats = self.batch_stats if batch_stats is None else batch_stats
        state = {"params": params, "opt_state": opt_state}
        return {**state, "batch_stats": batch_stats} if batch_stats else state

    def model(self, params: Any, batch_stats: Any = None) -> nnx.Module:
        """The module holding ``params`` and ``batch_stats`` (the initial state if None), for
        decoding or to take a part of it."""
        batch_stats = self.batch_stats if batch_stats is None else batch_stats
        return nnx.merge(self.graphdef, nnx.State(params), nnx.State(batch_stats), self.rest)


def _committed(tree: Any) -> Any:
    # Shapes without values (a model built under nnx.eval_shape, to compile ahead of time) pass.
    return jax.tree.map(
        lambda a: a if not isinstance(a, jax.Array) or a.committed
        else jax.device_put(a, a.sharding), tree)


def count_params(params: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
