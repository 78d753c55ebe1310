"""The compiled steps of every task: gradient accumulation, the update, evaluation.

Every step takes the train state (:class:`sparsemixer_jax.training.state.TrainState`: step,
parameters, layer state, optimizer state) and returns the next one; the compiled functions donate
it. The model's other state (``rest``: its RNG streams, reseeded from the step's key by the
task) and its graph definition are held by :class:`Steps`.

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

The layer state (``nnx.BatchStat`` variables: Default MoE's running means of expert outputs,
bias balancing's selection biases and per-expert loads;
``{}`` for most models) is what training forwards update and the optimizer does not. It goes
through every micro-batch's forward in order, and is kept unchanged when an update is skipped.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sparsemixer_jax.moe.balancing import BalancePlan, balance_plan, end_of_update
from sparsemixer_jax.moe.layer import report_choices, routing_param_paths
from sparsemixer_jax.packed_tree import PackedTree
from sparsemixer_jax.parallel.partitioning import Partitioner, constrain
from sparsemixer_jax.training import compute_copies
from sparsemixer_jax.training.optim import (
    FROZEN,
    OptimSettings,
    ParamRoles,
    learning_rate_schedule,
    make_optimizer,
    param_labels,
)
from sparsemixer_jax.training.state import TrainState


def _merge(graphdef, params, layer_state, rest) -> nnx.Module:
    # A fresh copy of the RNG-stream variables at this trace level, so that reseeding them under
    # jax.grad does not mutate the caller's.
    rest = jax.tree.map(lambda x: x, rest)
    return nnx.merge(graphdef, nnx.State(params), nnx.State(layer_state), rest)


def micro_batch_loss(graphdef: nnx.GraphDef, task: Any, params: Any, layer_state: Any,
                     rest: Any, batch: dict[str, jax.Array],
                     key: jax.Array) -> tuple[jax.Array, tuple]:
    """The task's loss of one micro-batch as a function of ``params`` (argument 2): what
    the steps differentiate. Returns ``(loss, (metric sums, layer_state after the forward))``.

    ``graphdef``, ``layer_state`` and ``rest`` are those of :class:`Steps` (``steps.graphdef``,
    ``steps.layer_state``, ``steps.rest``); ``task`` may be another than the steps' own,
    e.g. to compare the gradients of two objectives on one model.
    """
    model = _merge(graphdef, params, layer_state, rest)
    loss, metrics = task.loss(model, batch, key)
    return loss, (metrics, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


def _copies(graphdef, task, params, layer_state, rest, batch, partitioner=None):
    """The parameters the model consumes in its compute dtype, cast to it (None for the others;
    :mod:`~sparsemixer_jax.training.compute_copies`). Sharded models cast none: their gradients'
    reductions across devices would run in the compute dtype on the copies."""
    if partitioner is not None:
        return jax.tree.map(lambda _: None, params)
    dtypes = compute_copies.copy_dtypes(
        lambda p, s, r, b: micro_batch_loss(graphdef, task, p, s, r, b, jax.random.key(0)),
        params, layer_state, rest, batch)
    return compute_copies.cast_copies(params, dtypes)


def _gradient(graphdef, task, params, layer_state, rest, batch, key, copies=None,
              partitioner=None):
    """``({"grads", "metrics"}, new layer_state)`` of one micro-batch. The gradient is taken
    with respect to ``copies`` (:func:`_copies`; made here if None) where the model consumes a
    parameter only through its copy, and converted back to the parameter's dtype: the same
    values as the parameter's own gradient, without casting it in every layer of both
    passes."""
    if copies is None:
        copies = _copies(graphdef, task, params, layer_state, rest, batch, partitioner)
    grads, (metrics, layer_state) = jax.grad(micro_batch_loss, argnums=2, has_aux=True)(
        graphdef, task, compute_copies.with_copies(params, copies), layer_state, rest, batch,
        key)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return {"grads": grads, "metrics": metrics}, layer_state


# ``partitioner`` (static; None on one device) places parameters, gradients and optimizer state
# on the mesh by logical axis names: constraining what each step returns keeps them sharded as
# its inputs were, and XLA gathers and reduce-scatters around the constraints.


# keep_unused: the zeros depend on the state's shapes only, and a jit whose arguments are all
# pruned returns arrays not committed to a device, where _accumulate returns committed ones;
# jit keys its executables on that, so the second micro-batch compiled _accumulate again.
@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("partitioner",),
                   keep_unused=True)
def _zero_accumulator(graphdef, task, state, rest, batch, partitioner=None):
    shapes = jax.eval_shape(
        lambda s, r, b: micro_batch_loss(graphdef, task, s.params, s.layer_state, r, b,
                                         jax.random.key(0))[1][0],
        state, rest, batch)
    return {"grads": constrain(partitioner, jax.tree.map(jnp.zeros_like, state.params)),
            "metrics": PackedTree.pack(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                    shapes))}


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("partitioner",))
def _compute_copies(graphdef, task, state, rest, batch, partitioner=None):
    return _copies(graphdef, task, state.params, state.layer_state, rest, batch, partitioner)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,),
                   static_argnames=("partitioner",))
def _accumulate(graphdef, task, state, rest, acc, batch, key, copies=None, partitioner=None):
    summand, layer_state = _gradient(graphdef, task, state.params, state.layer_state, rest,
                                     batch, key, copies, partitioner)
    # Each metric sum is added as a leaf of its own, then packed: XLA computes every sum in
    # one kernel, each as the same expression as before packing (the same rounding: a
    # product added in one fused expression may be contracted, a packed product not).
    grads = jax.tree.map(jnp.add, acc["grads"], summand["grads"])
    metrics = jax.tree.map(jnp.add, acc["metrics"].unpack(), summand["metrics"])
    return {"grads": constrain(partitioner, grads),
            "metrics": PackedTree.pack(metrics)}, layer_state


def _keep_if_finite(finite, new, old):
    """``new`` where the update is finite, else ``old`` (a skipped update changes nothing)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _apply_update(task, optim: OptimSettings, state: TrainState, acc, layer_state,
                  balance: BalancePlan = (), partitioner: Partitioner | None = None
                  ) -> tuple[TrainState, dict[str, Any]]:
    """The next train state from summed gradients and the layer state after the update's
    forwards; the parameters, layer and optimizer states are kept if the loss or gradient is not
    finite. The step counts every update taken, skipped or not (the loop stops at a skip).
    ``balance``: the MoE layers whose bias and loads the update steps (:class:`Steps`);
    ``partitioner``: keeps the new state sharded (module comment above)."""
    divisor, out = task.summarize(acc["metrics"].unpack())
    grads = constrain(partitioner, jax.tree.map(lambda g: g / divisor, acc["grads"]))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(out["loss"])
    updates, new_opt_state = make_optimizer(optim).update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    # -- bias balancing: the selection biases move after the step, outside the optimizer.
    layer_state = end_of_update(layer_state, balance)
    new = TrainState(step=state.step + 1,
                     params=_keep_if_finite(finite, new_params, state.params),
                     layer_state=_keep_if_finite(finite, layer_state, state.layer_state),
                     opt_state=_keep_if_finite(finite, new_opt_state, state.opt_state))
    return constrain(partitioner, new), PackedTree.pack(
        {**out, "grad_norm": grad_norm, "finite": finite})


_update = functools.partial(jax.jit, static_argnums=(0, 1, 5), donate_argnums=(2,),
                            static_argnames=("partitioner",))(_apply_update)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 7), donate_argnums=(3,),
                   static_argnames=("partitioner",))
def _train_step(graphdef, task, optim, state, rest, batch, key, balance: BalancePlan = (),
                partitioner=None):
    """A whole update from one micro-batch in one compiled call: gradient, then optimizer.

    The same arithmetic as accumulating into zeros then updating, without materialising the
    accumulator, with one dispatch instead of three, and with XLA free to fuse the gradient's
    last ops into the optimizer's. The train state is donated.
    """
    summand, layer_state = _gradient(graphdef, task, state.params, state.layer_state, rest,
                                     batch, key, partitioner=partitioner)
    summand = {**summand, "metrics": PackedTree.pack(summand["metrics"])}
    return _apply_update(task, optim, state, summand, layer_state, balance, partitioner)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _evaluate(graphdef, task, state, rest, batch, key):
    return task.evaluate(_merge(graphdef, state.params, state.layer_state, rest), batch, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _routing(graphdef, task, state, rest, batch):
    return task.routing_choices(_merge(graphdef, state.params, state.layer_state, rest), batch)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("partitioner",))
def _initial_state(optim: OptimSettings, params, layer_state, partitioner=None):
    # Under jit, so that the step and the optimizer's count are placed as its other outputs
    # (replicated on the parameters' mesh) and the parameters are not copied: they are passed
    # through, as the model holds them. The moments are sharded as their parameters.
    return jnp.zeros((), jnp.int32), constrain(partitioner, make_optimizer(optim).init(params))


class Steps:
    """The compiled steps bound to one model, its task and optimizer settings.

    ``params`` and ``layer_state`` are the model's initial ones (pure dicts); ``graphdef`` and
    ``rest`` (its RNG streams) are the parts of the model no update changes. ``partitioner``
    (:class:`sparsemixer_jax.parallel.partitioning.Partitioner`, for a model placed on a mesh by it)
    keeps parameters, gradients and optimizer state sharded; None on one device.
    """

    def __init__(self, model: nnx.Module, task: Any, optim: OptimSettings,
                 partitioner: Partitioner | None = None):
        self.graphdef, params, layer_state, self.rest = nnx.split(model, nnx.Param,
                                                                  nnx.BatchStat, ...)
        # Committed to their devices, as arrays restored from a checkpoint are: jit keys its
        # cache on committedness, so a resumed run then reuses the compiled steps.
        self.params = _committed(nnx.to_pure_dict(params))
        self.layer_state = _committed(nnx.to_pure_dict(layer_state))  # {} for most models
        self.task = task
        self.optim = _with_roles(optim, model, self.params)
        self.partitioner = partitioner
        self.balance = balance_plan(model)  # the MoE layers whose loads each update reads
        self.schedule = learning_rate_schedule(optim)
        self._routing_graph: tuple[nnx.GraphDef, int] | None = None  # built on first use

    def new_state(self, params: Any, layer_state: Any) -> TrainState:
        """The train state of step 0 with ``params`` and ``layer_state`` and a fresh optimizer
        state (abstract arguments give an abstract state under ``jax.eval_shape``)."""
        step, opt_state = _initial_state(self.optim, params, layer_state,
                                         partitioner=self.partitioner)
        # Replicated where the parameters are: jit put this constant on the default device
        # alone, and a step takes no arguments on different devices.
        replicated = _replicated_like(params)
        if replicated is not None and isinstance(step, jax.Array):
            step = jax.device_put(step, replicated)
            # Likewise the optimizer's constant outputs (its step counts): jit leaves them
            # uncommitted, the updated state has them committed, and the first update would
            # compile twice.
            opt_state = jax.tree.map(
                lambda a: jax.device_put(a, replicated)
                if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
                and not a.committed else a, opt_state)
        return TrainState(step=step, params=params, layer_state=layer_state, opt_state=opt_state)

    def init_state(self) -> TrainState:
        """The train state of step 0: the model's parameters and layer state, a fresh
        optimizer state. The first update donates it, and with it :attr:`params` and
        :attr:`layer_state`: take a model after training from the state it returned."""
        return self.new_state(self.params, self.layer_state)

    def abstract_state(self) -> TrainState:
        """The train state's shapes, dtypes and shardings (``jax.ShapeDtypeStruct`` leaves),
        computing nothing: the template to restore a checkpoint into for reading only."""
        def shapes(tree):  # placed as the model's arrays are (eval_shape drops placements)
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)

        params, layer_state = shapes(self.params), shapes(self.layer_state)
        state = jax.eval_shape(self.new_state, params, layer_state).replace(
            params=params, layer_state=layer_state)
        if self.partitioner is None:
            # eval_shape leaves the step and the optimizer state unplaced, and orbax restores
            # an unplaced leaf onto the devices that saved it: devices of other processes, for
            # a run saved on several hosts. Every leaf goes where the model's arrays are.
            device = next((s for s in (getattr(a, "sharding", None)
                                       for a in jax.tree.leaves(self.params)) if s is not None),
                          jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            return jax.tree.map(lambda a: a if a.sharding is not None else jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=device), state)

        def placed(tree):  # by the rules, whatever the model's arrays hold (shapes only, too)
            return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                tree, self.partitioner.shardings(tree))

        return TrainState(step=jax.ShapeDtypeStruct((), state.step.dtype,
                                                    sharding=self.partitioner.replicated()),
                          params=placed(params), layer_state=placed(layer_state),
                          opt_state=placed(state.opt_state))

    def with_rest(self, rest: Any) -> Steps:
        """These steps with the model's other state (its RNG streams) replaced by ``rest``: an
        outer ``jit`` passes it as a traced argument where an abstract model's own state holds
        shapes only, which a traced computation cannot close over (compile-only targets)."""
        bound = copy.copy(self)
        bound.rest = rest
        return bound

    def zeros(self, state: TrainState, batch: dict[str, jax.Array]) -> dict[str, Any]:
        """A zero accumulator of gradients and metric sums for batches shaped like ``batch``."""
        return _zero_accumulator(self.graphdef, self.task, state, self.rest, batch,
                                 partitioner=self.partitioner)

    def compute_copies(self, state: TrainState, batch: dict[str, jax.Array]) -> Any:
        """The parameters of ``state`` that the model consumes in its compute dtype, cast to it
        (None for the others), for batches shaped like ``batch``: made once per update and
        passed to every :meth:`accumulate` of it."""
        return _compute_copies(self.graphdef, self.task, state, self.rest, batch,
                               partitioner=self.partitioner)

    def accumulate(self, state: TrainState, acc: dict[str, Any], batch: dict[str, jax.Array],
                   key: jax.Array, copies: Any = None) -> tuple[dict[str, Any], Any]:
        """``(acc + the gradient and metric sums of batch at state.params, the layer state
        after its forward from state.layer_state)``; ``acc`` is donated. ``copies``:
        :meth:`compute_copies` of ``state`` (None: made inside, once per micro-batch)."""
        return _accumulate(self.graphdef, self.task, state, self.rest, acc, batch, key,
                           copies, partitioner=self.partitioner)

    def update(self, state: TrainState, acc: dict[str, Any],
               layer_state: Any = None) -> tuple[TrainState, dict[str, Any]]:
        """The optimizer update from an accumulator: ``(next state, metrics)``. ``layer_state``
        is the layer state after the update's forwards (None: ``state.layer_state``); ``state``
        is donated."""
        layer_state = state.layer_state if layer_state is None else layer_state
        return _update(self.task, self.optim, state, acc, layer_state, self.balance,
                       partitioner=self.partitioner)

    def train_step(self, state: TrainState, micro_batches: list[dict[str, jax.Array]],
                   step_key: jax.Array) -> tuple[TrainState, dict[str, Any]]:
        """One update from ``micro_batches`` (device batches); micro-batch ``j`` draws its
        randomness from ``fold_in(step_key, j)``. Returns ``(next state, metrics)``: its step is
        one more; its layer state has gone through every micro-batch's forward, in order,
        unless the update was skipped (then parameters, layer and optimizer states are the
        given ones).

        One micro-batch: a single compiled call. Several: zero, accumulate each, update. Both
        donate ``state``.
        """
        if len(micro_batches) == 1:
            return _train_step(self.graphdef, self.task, self.optim, state, self.rest,
                               micro_batches[0], jax.random.fold_in(step_key, 0),
                               self.balance, partitioner=self.partitioner)
        acc = self.zeros(state, micro_batches[0])
        copies = self.compute_copies(state, micro_batches[0])
        layer_state = state.layer_state
        for j, batch in enumerate(micro_batches):
            acc, layer_state = self.accumulate(state.replace(layer_state=layer_state), acc,
                                               batch, jax.random.fold_in(step_key, j), copies)
        return self.update(state, acc, layer_state)

    def evaluate(self, state: TrainState, batch: dict[str, jax.Array], key: jax.Array) -> Any:
        """The task's evaluation sums of the deterministic forward on ``batch``."""
        return _evaluate(self.graphdef, self.task, state, self.rest, batch, key)

    def routing(self, state: TrainState, batch: dict[str, jax.Array]
                ) -> tuple[dict[str, jax.Array], jax.Array]:
        """The task's ``routing_choices`` on ``batch``: each MoE layer's chosen experts per
        token ``[B, T, k]`` (sorted) under the deterministic forward, and the bool ``[B, T]``
        mask of the tokens that count. Compiled once, for a copy of the model graph that
        reports its choices (:func:`sparsemixer_jax.moe.layer.report_choices`)."""
        graphdef, _ = self._routing_graph_of(state)
        return _routing(graphdef, self.task, state, self.rest, batch)

    def num_routed_experts(self, state: TrainState) -> int:
        """The most experts of an MoE layer of the model (0: no MoE layer)."""
        return self._routing_graph_of(state)[1]

    def _routing_graph_of(self, state: TrainState) -> tuple[nnx.GraphDef, int]:
        if self._routing_graph is None:
            model = self.model(state)
            experts = report_choices(model)
            self._routing_graph = (nnx.split(model, nnx.Param, nnx.BatchStat, ...)[0], experts)
        return self._routing_graph

    def model(self, state: TrainState | None = None) -> nnx.Module:
        """The module holding ``state``'s parameters and layer state (the initial ones if None),
        for decoding or to take a part of it."""
        params = self.params if state is None else state.params
        layer_state = self.layer_state if state is None else state.layer_state
        return nnx.merge(self.graphdef, nnx.State(params), nnx.State(layer_state), self.rest)


def _with_roles(optim: OptimSettings, model: nnx.Module, params: Any) -> OptimSettings:
    """``optim`` with the model's routers and experts (:class:`ParamRoles`) when its fine-tuning
    policy needs them; a one-line ValueError for a policy that would train nothing."""
    if not optim.has_policy:
        return optim
    optim = dataclasses.replace(optim, roles=ParamRoles(*routing_param_paths(model)))
    labels = jax.tree.leaves(param_labels(optim, params))
    if all(label == FROZEN for label in labels):
        raise ValueError(f"config.optim.train_only={optim.train_only!r} trains no parameter of "
                         "this model (it has no MoE layer)")
    return optim


def _replicated_like(tree: Any) -> jax.sharding.Sharding | None:
    """A sharding that replicates over the devices of ``tree``'s first array (None if it holds
    none with a placement: shapes only, or tracers)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            sharding = leaf.sharding
            if isinstance(sharding, jax.sharding.NamedSharding):
                return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            return sharding if len(sharding.device_set) == 1 else None
    return None


def _committed(tree: Any) -> Any:
    # Shapes without values (a model built under nnx.eval_shape, to compile ahead of time) pass.
    return jax.tree.map(
        lambda a: a if not isinstance(a, jax.Array) or a.committed
        else jax.device_put(a, a.sharding), tree)


def count_params(params: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
