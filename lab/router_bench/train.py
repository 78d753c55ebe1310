"""Training every seed of one arm at once: ``jax.vmap`` over the split state of the student,
its optimizer state, its teacher's data and its keys, ``lax.scan`` over steps.

Seed ``s`` fixes the teacher, the data stream (indices and label noise), the student's init and
its router's random stream. The teacher, the data and the init do not depend on the arm (the
init draws router, ``wi``, ``wo`` in the same order for every router; SparseMixer's ``omega``
starts at 1), so two arms on the same seed differ only by what the arm changes: the
differences are paired.
"""

from __future__ import annotations

import functools
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lab.router_bench import metrics
from lab.router_bench.arms import Arm
from lab.router_bench.student import Student, set_oracle_router
from lab.router_bench.teacher import (
    Data,
    Teacher,
    TeacherConfig,
    make_data,
    make_teacher,
    teacher_forward,
)
from sparsemixer_jax.moe.balancing import balance_plan, end_of_update

# Fresh inputs at a positive margin: draw this many times the batch and keep the first inputs
# the margin accepts (the main setting's margins accept well over half of all inputs, so a
# batch is short of accepted inputs with negligible probability; it is then filled with
# rejected ones).
FRESH_OVERSAMPLE = 4


class TrainConfig(NamedTuple):
    """Sizes shared by every arm. ``lr`` is Adam's base rate (times the arm's ``lr_mult``);
    ``balance_weight`` multiplies the Switch balance loss (summed over layers); metrics are
    logged every ``eval_every`` steps (``steps`` must be a multiple of it)."""

    dim: int = 16
    hidden: int = 32
    teacher_hidden: int = 8
    noise: float = 0.1
    batch: int = 128
    steps: int = 1500
    eval_every: int = 50
    lr: float = 3e-3
    balance_weight: float = 0.01
    grad_tokens: int = 256
    train_size: int = 16384
    eval_size: int = 2048
    dispatch: str = "ragged"
    measure_gradient: bool = True

    def teacher(self, arm: Arm) -> TeacherConfig:
        return TeacherConfig(dim=self.dim, num_experts=arm.k_teacher, hidden=self.teacher_hidden,
                             depth=arm.depth, margin=arm.margin, noise=self.noise,
                             train_size=self.train_size, eval_size=self.eval_size,
                             gate_scale=arm.teacher_gate_scale,
                             activation="tanh" if arm.family == "tanh" else "relu")

    def student_hidden(self, arm: Arm) -> int:
        """Expert width of ``arm``'s student: ``dim`` for the tanh family, else ``hidden``."""
        return self.dim if arm.student_experts == "tanh" else self.hidden


class History(NamedTuple):
    """Per seed ``S`` and log point ``E`` (``steps / eval_every + 1``, step 0 first).

    ``train_mse`` ``[S, E]`` (mean over the steps since the last log; at step 0 the eval MSE),
    ``eval_mse`` (clean labels, argmax routing), ``zero_grad``, ``non_argmax``, ``load_max``
    (training-mode routing, means since the last log), ``load_imbalance`` (max load over mean
    load of each step's whole batch, all its micro-batches, in training mode; mean over layers,
    then over the steps since the last log), ``grad_cos``, ``grad_norm_ratio``
    (realised / exact router gradient, NaN where not measured), ``confusion`` ``[S, E, L, N, K]``
    on the evaluation set. ``acceptance [S]``: the margin's acceptance rate.
    ``final_state``: the students' split state after the last step, ``(params, rest)`` with a
    leading seed axis (``rest``: everything but ``nnx.Param``, e.g. the router's RNG counts and
    Default MoE's ``expert_defaults``); None where not kept.
    """

    steps: np.ndarray
    train_mse: np.ndarray
    eval_mse: np.ndarray
    zero_grad: np.ndarray
    non_argmax: np.ndarray
    load_max: np.ndarray
    grad_cos: np.ndarray
    grad_norm_ratio: np.ndarray
    confusion: np.ndarray
    acceptance: np.ndarray
    final_state: tuple | None = None
    load_imbalance: np.ndarray | None = None


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Teacher, data and student keys of seed ``seed``; none depends on the arm."""
    root = jax.random.key(seed)
    return jax.random.fold_in(root, 0), jax.random.fold_in(root, 1), jax.random.fold_in(root, 2)


def prepare_data(arm: Arm, cfg: TrainConfig, seeds: list[int]) -> tuple[Teacher, Data]:
    """Teachers and their data for ``seeds``, each stacked on a leading seed axis."""
    tcfg = cfg.teacher(arm)
    teachers, datas = [], []
    for seed in seeds:
        k_teacher, k_data, _ = seed_keys(seed)
        teacher = make_teacher(k_teacher, tcfg)
        datas.append(make_data(teacher, k_data, tcfg))
        teachers.append(teacher)
    stacked = Data(*(np.stack([getattr(d, f) for d in datas]) for f in Data._fields))
    return jax.tree.map(lambda *a: jnp.stack(a), *teachers), stacked


def _measures_gradient(arm: Arm, cfg: TrainConfig) -> bool:
    return (cfg.measure_gradient and arm.measure_gradient and arm.depth == 1
            and arm.top_k == 1 and arm.dense is None and arm.family == "mlp"
            and arm.student_experts == "mlp")


def _router_grad(grads) -> jax.Array:
    router = grads["layers"][0]["router"]
    return router["kernel"][...], router["bias"][...]


@functools.cache
def _compiled(arm: Arm, cfg: TrainConfig):
    """The jitted, seed-vmapped init and run functions of ``arm`` (cached per arm)."""
    template = _student(arm, cfg, jax.random.key(0), None, None)
    graphdef = nnx.split(template, nnx.Param, ...)[0]
    plan = balance_plan(template)  # the layers whose loads the bias step and global loss read
    optimizer = optax.adam(cfg.lr * arm.lr_mult)
    n, k = (1 if arm.dense else arm.num_experts), arm.k_teacher
    batch = arm.batch or cfg.batch
    if batch % arm.micro_batches:
        raise ValueError(f"arm {arm.name!r}: micro_batches={arm.micro_batches} does not divide "
                         f"the batch of {batch} tokens")
    balance_weight = cfg.balance_weight if arm.balance_weight is None else arm.balance_weight
    tcfg = cfg.teacher(arm)
    probs_fn = metrics.oracle_probs_fn(arm.router, arm.jitter_eps)

    def loss_fn(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        pred, aux = model(x)
        mse = jnp.mean(jnp.square(pred - y))
        loss = mse + balance_weight * aux["balance_loss"]
        return loss, (mse, aux, nnx.state(model, nnx.Not(nnx.Param)))

    frozen = (["'router'"] if arm.oracle_router else []) + ([] if arm.omega else ["'omega'"])

    def freeze(grads):
        """Zero the gradients of the frozen parameters (Adam then leaves them as they are)."""
        if not frozen:
            return grads
        return jax.tree_util.tree_map_with_path(
            lambda path, g: jnp.zeros_like(g)
            if any(f in jax.tree_util.keystr(path) for f in frozen) else g, grads)

    def batch_of(key, data: Data, teacher: Teacher):
        """One training batch ``(x, y)``: from the pool with fresh label noise, or fresh
        inputs with clean labels."""
        if arm.fresh_data:
            over = FRESH_OVERSAMPLE if arm.margin > 0 else 1
            x = jax.random.normal(key, (over * batch, cfg.dim))
            y, _, gaps = teacher_forward(teacher, x, tcfg.gate_scale, tcfg.activation)
            if over > 1:
                accepted = jnp.all(gaps >= arm.margin, axis=0)
                first = jnp.argsort(~accepted, stable=True)[:batch]
                x, y = x[first], y[first]
            return x, y
        k_idx, k_noise = jax.random.split(key)
        idx = jax.random.randint(k_idx, (batch,), 0, data.train_x.shape[0])
        x = data.train_x[idx]
        return x, data.train_y[idx] + cfg.noise * jax.random.normal(k_noise, x.shape)

    def after_update(rest):
        """Bias balancing's step and the reset of the update's loads (the library's own)."""
        if not plan:
            return rest
        pure = end_of_update(nnx.to_pure_dict(rest), plan)
        rest = jax.tree.map(lambda a: a, rest)  # a copy: the carry is not mutated in place
        nnx.replace_by_pure_dict(rest, pure)
        return rest

    def train_step(carry, key, data: Data, teacher: Teacher):
        """One optimizer step on ``batch`` tokens: the gradients of ``arm.micro_batches``
        equal micro-batches, averaged (micro-batches in order, each seeing the loads that the
        earlier ones added to the layer state), then the step after the update."""
        params, rest, opt_state = carry
        x, y = batch_of(key, data, teacher)
        m = arm.micro_batches
        grads, logs, share = None, [], 0.0
        for xm, ym in zip(jnp.split(x, m), jnp.split(y, m), strict=True):
            g, (mse, aux, rest) = jax.grad(loss_fn, has_aux=True)(params, rest, xm, ym)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            logs.append(jnp.stack([mse, aux["zero_grad"], aux["non_argmax"], aux["load_max"]]))
            share = share + aux["expert_share"] / m
        grads = jax.tree.map(lambda g: g / m, grads)
        updates, opt_state = optimizer.update(freeze(grads), opt_state, params)
        params = optax.apply_updates(params, updates)
        rest = after_update(rest)
        imbalance = jnp.mean(share.shape[-1] * jnp.max(share, axis=-1))
        logged = jnp.concatenate([jnp.mean(jnp.stack(logs), axis=0), imbalance[None]])
        return (params, rest, opt_state), logged

    def gradient_check(params, rest, data: Data):
        if not _measures_gradient(arm, cfg):
            return jnp.full((), jnp.nan), jnp.full((), jnp.nan)
        x, y = data.eval_x[: cfg.grad_tokens], data.eval_y[: cfg.grad_tokens]

        def task(params, rest):  # rest as an argument: the router stream is advanced inside
            pred, _ = nnx.merge(graphdef, params, rest, copy=True)(x)
            return jnp.mean(jnp.square(pred - y))

        realised = _router_grad(jax.grad(task)(params, rest))
        layer = nnx.merge(graphdef, params, rest, copy=True).layers[0]
        logits = layer.router(x)
        expert_params = tuple(p[...] for p in (layer.wi, layer.bi, layer.wo, layer.bo))
        omega = None if layer.omega is None else layer.omega[...]
        exact = metrics.exact_router_grad(logits, x, y, expert_params, omega, probs_fn)
        flat_r = jnp.concatenate([g.reshape(-1) for g in realised])
        flat_e = jnp.concatenate([g.reshape(-1) for g in exact])
        ratio = jnp.linalg.norm(flat_r) / jnp.maximum(jnp.linalg.norm(flat_e), 1e-30)
        return metrics.cosine(flat_r, flat_e), ratio

    def evaluate(params, rest, data: Data):
        pred, aux = nnx.merge(graphdef, params, rest, copy=True)(data.eval_x, deterministic=True)
        mse = jnp.mean(jnp.square(pred - data.eval_y))
        conf = jax.vmap(lambda s, t: metrics.confusion(s, t, n, k))(aux["choices"],
                                                                   data.eval_experts)
        cos, ratio = gradient_check(params, rest, data)
        return mse, cos, ratio, conf

    def run(params, rest, key, data: Data, teacher: Teacher):
        opt_state = optimizer.init(params)
        num_logs = cfg.steps // cfg.eval_every

        def chunk(carry, chunk_key):
            keys = jax.random.split(chunk_key, cfg.eval_every)
            carry, logged = jax.lax.scan(lambda c, kk: train_step(c, kk, data, teacher), carry,
                                         keys)
            mse, cos, ratio, conf = evaluate(*carry[:2], data)
            return carry, (jnp.mean(logged, axis=0), mse, cos, ratio, conf)

        first = evaluate(params, rest, data)
        final, (logged, mse, cos, ratio, conf) = jax.lax.scan(
            chunk, (params, rest, opt_state), jax.random.split(key, num_logs))
        head = lambda a, b: jnp.concatenate([a[None], b])
        train0 = jnp.stack([first[0], jnp.nan, jnp.nan, jnp.nan, jnp.nan])
        return (head(train0, logged), head(first[0], mse), head(first[1], cos),
                head(first[2], ratio), head(first[3], conf)), final[:2]

    return jax.jit(jax.vmap(run))


_EXECUTABLES: dict = {}


def _executable(arm: Arm, cfg: TrainConfig, args: tuple):
    """The compiled run of ``arm`` for arguments shaped like ``args`` (cached), compiled ahead
    of the call so that compilation and running are timed apart."""
    leaves, treedef = jax.tree.flatten(args)
    key = (arm, cfg, treedef, tuple((a.shape, str(a.dtype)) for a in leaves))
    if key not in _EXECUTABLES:
        _EXECUTABLES[key] = _compiled(arm, cfg).lower(*args).compile()
    return _EXECUTABLES[key]


def _student(arm: Arm, cfg: TrainConfig, key: jax.Array, router_w, router_b) -> Student:
    k_params, k_router = jax.random.split(key)
    model = Student(arm, cfg.dim, cfg.student_hidden(arm),
                    rngs=nnx.Rngs(params=k_params, router=k_router), dispatch=cfg.dispatch)
    if arm.oracle_router and router_w is not None:
        set_oracle_router(model, router_w, router_b)
    return model


def init_students(arm: Arm, cfg: TrainConfig, seeds: list[int], teachers: Teacher):
    """Split states of the students of ``seeds``, stacked on a leading seed axis.

    Built eagerly, one seed after another: compiling a vmapped constructor costs more than it
    saves at this size.
    """
    states = [nnx.split(_student(arm, cfg, seed_keys(s)[2], teachers.router_w[i],
                                 teachers.router_b[i]), nnx.Param, ...)[1:]
              for i, s in enumerate(seeds)]
    return jax.tree.map(lambda *a: jnp.stack(a), *states)


def _run_args(arm: Arm, cfg: TrainConfig, seeds: list[int], data_cache: dict | None):
    """The arguments of the compiled run of ``arm`` (initial students, keys, data on the
    device) and the host copy of the data. ``data_cache`` is keyed by teacher setting."""
    cache_key = (cfg.teacher(arm), tuple(seeds))
    if data_cache is not None and cache_key in data_cache:
        teachers, data = data_cache[cache_key]
    else:
        teachers, data = prepare_data(arm, cfg, seeds)
        if data_cache is not None:
            data_cache[cache_key] = (teachers, data)
    run_keys = jnp.stack([jax.random.fold_in(seed_keys(s)[2], 1) for s in seeds])
    params, rest = init_students(arm, cfg, seeds, teachers)
    run_data = Data(*(jnp.asarray(a) for a in data[:5]), acceptance=jnp.asarray(data[5]))
    args = (params, rest, run_keys, run_data, teachers)
    jax.block_until_ready(args)
    return args, data


def time_steps(arms: list[Arm], cfg: TrainConfig, seeds: list[int], steps: int = 200,
               rounds: int = 5, data_cache: dict | None = None) -> dict[str, list[float]]:
    """Wall time of one training step of every seed at once, after compilation.

    Each arm's run of ``steps`` steps (no gradient measurement; one evaluation before and one
    after) is compiled first; then the arms run in turn, ``rounds`` times over, so that a change
    in the machine's load falls on every arm alike. Returns, per arm name, the seconds per step
    of each round (the run's time divided by ``steps``).
    """
    cfg = cfg._replace(steps=steps, eval_every=steps, measure_gradient=False)
    prepared = {}
    for arm in arms:
        args, _ = _run_args(arm, cfg, seeds, data_cache)
        prepared[arm.name] = (_executable(arm, cfg, args), args)
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            run, args = prepared[arm.name]
            t0 = time.perf_counter()
            jax.block_until_ready(run(*args))
            times[arm.name].append((time.perf_counter() - t0) / steps)
    return times


def train_arm(arm: Arm, cfg: TrainConfig, seeds: list[int], data_cache: dict | None = None
              ) -> tuple[History, dict]:
    """Train ``arm`` on every seed at once. ``data_cache`` (by teacher setting) saves rebuilding
    teachers shared by several arms.

    Returns the history and timings: ``data_s`` (teachers, data and the students' init),
    ``compile_s`` (XLA compilation; 0 when this process compiled the arm before), ``run_s``
    (every step of every seed plus the logged evaluations, after compilation) and ``load_1m``
    (the machine's 1-minute load average when the run ended; the wall times are only
    comparable at similar load)."""
    t0 = time.perf_counter()
    args, data = _run_args(arm, cfg, seeds, data_cache)
    t1 = time.perf_counter()
    run = _executable(arm, cfg, args)
    t2 = time.perf_counter()
    out, final_state = jax.device_get(run(*args))
    t3 = time.perf_counter()
    logged, mse, cos, ratio, conf = (np.asarray(a) for a in out)
    steps = np.arange(cfg.steps // cfg.eval_every + 1) * cfg.eval_every
    history = History(steps=steps, train_mse=logged[..., 0], eval_mse=mse,
                      zero_grad=logged[..., 1], non_argmax=logged[..., 2],
                      load_max=logged[..., 3], grad_cos=cos, grad_norm_ratio=ratio,
                      confusion=conf, acceptance=np.asarray(data.acceptance),
                      final_state=final_state, load_imbalance=logged[..., 4])
    return history, {"data_s": t1 - t0, "compile_s": t2 - t1, "run_s": t3 - t2,
                     "load_1m": os.getloadavg()[0]}
