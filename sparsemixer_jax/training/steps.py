"""The compiled steps of every task: gradient accumulation, the update, evaluation.

A task supplies an *objective*: a hashable object (a frozen dataclass; it is a static argument
of the compiled functions) with three methods:

* ``loss(model, batch, key) -> (loss, metric_sums)``: the training objective of one micro-batch
  and metrics that add up over micro-batches. The objective reseeds the model's RNG streams from
  ``key`` itself (``nnx.reseed``), so a step's randomness is a function of the key alone.
* ``summarize(metric_sums) -> (divisor, metrics)``: what the summed gradient is divided by (the
  tokens, or the micro-batches, of the update) and the update's metrics, which must hold
  ``"loss"`` (a non-finite one skips the update) and may hold ``"moe"`` (per-layer router
  metrics, logged every ``log_every`` steps).
* ``evaluate(model, batch, key) -> sums``: the deterministic forward's metric sums on one batch.

The functions are module-level, keyed by (graph definition, objective, optimizer settings), so
every model of the same structure and shapes in a process reuses one compilation. Parameters
travel as a pure pytree (nested dict of arrays) so that optax and orbax see plain arrays.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparsemixer_jax.training.optim import OptimSettings, learning_rate_schedule, make_optimizer


def _loss(graphdef, objective, params, rest, batch, key):
    # A fresh copy of the RNG-stream variables at this trace level, so that reseeding them under
    # jax.grad does not mutate the caller's.
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, nnx.State(params), rest)
    return objective.loss(model, batch, key)


def _gradient(graphdef, objective, params, rest, batch, key):
    grads, metrics = jax.grad(_loss, argnums=2, has_aux=True)(
        graphdef, objective, params, rest, batch, key)
    return {"grads": grads, "metrics": metrics}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_accumulator(graphdef, objective, params, rest, batch):
    shapes = jax.eval_shape(lambda p, r, b: _loss(graphdef, objective, p, r, b,
                                                  jax.random.key(0))[1], params, rest, batch)
    return {"grads": jax.tree.map(jnp.zeros_like, params),
            "metrics": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)}


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _accumulate(graphdef, objective, params, rest, acc, batch, key):
    return jax.tree.map(jnp.add, acc, _gradient(graphdef, objective, params, rest, batch, key))


def _apply_update(objective, optim: OptimSettings, params, opt_state, acc):
    """One optimizer update from summed gradients; skipped if the loss or gradient is not finite."""
    divisor, out = objective.summarize(acc["metrics"])
    grads = jax.tree.map(lambda g: g / divisor, acc["grads"])
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(out["loss"])
    updates, new_opt_state = make_optimizer(optim).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep_if_finite(new, old):
        return jnp.where(finite, new, old)

    params = jax.tree.map(keep_if_finite, new_params, params)
    opt_state = jax.tree.map(keep_if_finite, new_opt_state, opt_state)
    return params, opt_state, {**out, "grad_norm": grad_norm, "finite": finite}


_update = functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))(_apply_update)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 5))
def _train_step(graphdef, objective, optim, params, rest, opt_state, batch, key):
    """A whole update from one micro-batch in one compiled call: gradient, then optimizer.

    The same arithmetic as accumulating into zeros then updating, without materialising the
    accumulator, with one dispatch instead of three, and with XLA free to fuse the gradient's
    last ops into the optimizer's. Parameters and optimizer state are donated.
    """
    return _apply_update(objective, optim, params, opt_state,
                         _gradient(graphdef, objective, params, rest, batch, key))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(graphdef, objective, params, rest, batch, key):
    model = nnx.merge(graphdef, nnx.State(params), rest)
    return objective.evaluate(model, batch, key)


@functools.partial(jax.jit, static_argnums=(0,))
def _init_optimizer(optim: OptimSettings, params):
    return make_optimizer(optim).init(params)


class Steps:
    """The compiled steps bound to one model, its objective and optimizer settings."""

    def __init__(self, model: nnx.Module, objective: Any, optim: OptimSettings):
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = nnx.to_pure_dict(params)
        self.objective = objective
        self.optim = optim
        self.schedule = learning_rate_schedule(optim)

    def init_opt(self, params):
        return _init_optimizer(self.optim, params)

    def opt_state_shapes(self, params):
        """The optimizer state's shapes, without computing it (a restore template)."""
        return jax.eval_shape(lambda p: make_optimizer(self.optim).init(p), params)

    def zeros(self, params, batch):
        """A zero accumulator of gradients and metric sums for batches shaped like ``batch``."""
        return _zero_accumulator(self.graphdef, self.objective, params, self.rest, batch)

    def accumulate(self, params, acc, batch, key):
        """``acc`` plus the gradient and metric sums of ``batch`` (``acc`` is donated)."""
        return _accumulate(self.graphdef, self.objective, params, self.rest, acc, batch, key)

    def update(self, params, opt_state, acc):
        """The optimizer update from an accumulator: ``(params, opt_state, metrics)``."""
        return _update(self.objective, self.optim, params, opt_state, acc)

    def train_step(self, params, opt_state, micro_batches, step_key):
        """One update from ``micro_batches`` (device batches); micro-batch ``j`` draws its
        randomness from ``fold_in(step_key, j)``. Returns ``(params, opt_state, metrics)``.

        One micro-batch: a single compiled call. Several: zero, accumulate each, update. Both
        donate ``params`` and ``opt_state``.
        """
        if len(micro_batches) == 1:
            return _train_step(self.graphdef, self.objective, self.optim, params, self.rest,
                               opt_state, micro_batches[0], jax.random.fold_in(step_key, 0))
        acc = self.zeros(params, micro_batches[0])
        for j, batch in enumerate(micro_batches):
            acc = self.accumulate(params, acc, batch, jax.random.fold_in(step_key, j))
        return self.update(params, opt_state, acc)

    def evaluate(self, params, batch, key):
        return _evaluate(self.graphdef, self.objective, params, self.rest, batch, key)

    def model(self, params: Any) -> nnx.Module:
        """The module holding ``params`` (for decoding, or to take a part of it)."""
        return nnx.merge(self.graphdef, nnx.State(params), self.rest)


def count_params(params: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
